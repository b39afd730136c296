"""The torch RNG states a checkpoint carries: the CPU's always, each CUDA device's when the master used CUDA.

A resumed run draws the same dropout masks as the run it continues only if every generator it draws from
comes back; an older checkpoint (CPU state only) and a CPU-only writer's must still load.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vela_ray.training import checkpoint


def _round_trip(tmp_path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` through a backbone file, as a checkpoint writes and a resume reads them."""
    path = tmp_path / "backbone.safetensors"
    checkpoint.write_tensors(path, tensors)
    return checkpoint.read_tensors(path)


def test_the_cpu_rng_state_comes_back_from_the_file(tmp_path):
    torch.manual_seed(7)
    saved = _round_trip(tmp_path, checkpoint.rng_state())
    want = torch.rand(5)
    torch.manual_seed(123)  # the resumed process starts elsewhere
    checkpoint.restore_rng_state(saved)
    assert torch.equal(torch.rand(5), want)


def test_a_process_that_never_used_cuda_writes_only_the_cpu_state():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("this process already used CUDA")
    assert set(checkpoint.rng_state()) == {"rng.torch"}


def test_an_old_checkpoint_without_cuda_states_loads(tmp_path):
    torch.manual_seed(3)
    saved = _round_trip(tmp_path, {"rng.torch": torch.get_rng_state(), "base.lora_A.weight": torch.ones(2, 2)})
    want = torch.rand(3)
    torch.manual_seed(9)
    checkpoint.restore_rng_state(saved)
    assert torch.equal(torch.rand(3), want)


def test_cuda_states_for_devices_this_process_lacks_are_skipped_with_a_warning(tmp_path, caplog):
    """A GPU run's checkpoint resumed on fewer (or no) GPUs still loads; the log says the draws differ."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    torch.manual_seed(5)
    state = torch.get_rng_state()
    saved = _round_trip(tmp_path, {"rng.torch": state, f"rng.cuda.{visible}": torch.zeros(16, dtype=torch.uint8)})
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        checkpoint.restore_rng_state(saved)
    assert torch.equal(torch.get_rng_state(), state)
    assert f"CUDA RNG states for devices [{visible}]" in caplog.text


@pytest.mark.gpu
def test_every_cuda_devices_rng_state_comes_back_from_the_file(tmp_path):
    devices = range(torch.cuda.device_count())
    for index in devices:
        torch.cuda.manual_seed_all(11)
        torch.rand(1, device=f"cuda:{index}")  # use CUDA: its state is then part of the checkpoint
    saved = _round_trip(tmp_path, checkpoint.rng_state())
    assert {f"rng.cuda.{i}" for i in devices} <= set(saved)
    want = [torch.rand(4, device=f"cuda:{i}").cpu() for i in devices]
    torch.cuda.manual_seed_all(99)
    checkpoint.restore_rng_state(saved)
    assert all(torch.equal(torch.rand(4, device=f"cuda:{i}").cpu(), w) for i, w in zip(devices, want))
