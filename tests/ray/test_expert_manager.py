"""ExpertManager as a plain class (no Ray): loading only its experts, sizing, spec checks, edge cases."""

from __future__ import annotations

import pytest
import ray
import torch

from vela_ray.model.traffic import link_tiers
from vela_ray.errors import ExpertWorkerError
from vela_ray.runtime.pool import capacity_from_memory
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec
from tests.ray.helpers import HIDDEN, SYNTHETIC_CONFIG, synthetic_weights
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, find_moe_blocks
from vela_ray.training import checkpoint

LORA = LoraSpec(r=4, alpha=8)


def _manager(keys, worker: int = 0) -> ExpertManager:
    weights = synthetic_weights()
    spec = ExpertManagerSpec(worker=worker, keys=keys, weights={k: weights[k] for k in keys},
                             hf_config=SYNTHETIC_CONFIG, lora=LORA)
    return ExpertManager(spec)


def test_reads_only_its_experts_from_the_checkpoint(tmp_path):
    model = debug_model("mixtral", seed=0)
    model.save_pretrained(tmp_path)
    keys = [(1, 4), (0, 1)]
    manager = ExpertManager(ExpertManagerSpec(worker=2, keys=keys, model_dir=str(tmp_path), lora=LORA))
    assert manager.shard.keys == sorted(keys)
    expected = expert_weights(find_moe_blocks(model), keys)
    hosted = manager.shard.weights()
    for key in keys:
        assert hosted[key].keys() == expected[key].keys() == {"gate_up_proj", "down_proj"}
        for name, value in expected[key].items():
            torch.testing.assert_close(hosted[key][name], value, rtol=0, atol=0)


def test_bytes_per_expert_counts_weights_and_lora_with_adam_state():
    manager = _manager([(0, 0), (1, 3)])
    # frozen: (2I*D + D*I) fp32 = (48*16 + 16*24) * 4 = 4608 bytes
    # LoRA r=4: (r*D + 2I*r + r*I + D*r) * 4 = (64 + 192 + 96 + 64) * 4 = 1664 bytes, x4 (value, grad, 2 moments)
    report = manager.report()
    assert report.bytes_per_expert == 4608 + 4 * 1664
    assert capacity_from_memory([report.free_bytes], report.bytes_per_expert)[0] > 1000  # > 11 MB free
    with pytest.raises(ValueError, match="bytes_per_expert must be positive"):
        capacity_from_memory([report.free_bytes], 0)


def test_seconds_per_row_times_an_expert_without_touching_training_state():
    manager = _manager([(0, 0), (1, 3)])
    before = manager.lora_state()
    manager.forward_rows(0, torch.zeros(32, dtype=torch.long), torch.randn(32, HIDDEN), "k")
    manager.backward_rows("k", torch.ones(32, HIDDEN))  # some real gradient to keep
    grads = manager.lora_grads()
    report = manager.report(256)
    assert 0 < report.seconds_per_row < 1e-2
    assert report.compute_s > 0  # the forward/backward above were timed
    for key, params in manager.lora_grads().items():  # the probe accumulated no gradient ...
        for name, grad in params.items():
            torch.testing.assert_close(grad, grads[key][name], rtol=0, atol=0)
    for key, params in manager.lora_state().items():  # ... and changed no weight
        for name, value in params.items():
            torch.testing.assert_close(value, before[key][name], rtol=0, atol=0)
    assert _manager([], worker=4).report(8).seconds_per_row is None


def test_worker_without_experts_still_steps_and_reports_zero_norm():
    manager = _manager([], worker=5)
    assert manager.grad_sq_norm() == 0.0
    manager.step(1e-3, 1.0)
    assert manager.lora_state() == {}
    assert manager.forward_rows(0, torch.zeros(0, dtype=torch.long), torch.zeros(0, HIDDEN)).shape == (0, HIDDEN)
    assert manager.report().bytes_per_expert is None  # nothing to size experts by


def test_load_lora_state_takes_its_own_experts_and_names_missing_ones():
    manager = _manager([(0, 2)], worker=1)
    donor = _manager([(0, 2), (1, 1)], worker=0).lora_state()
    manager.load_lora_state(donor)
    torch.testing.assert_close(manager.lora_state()[(0, 2)]["lora_A_down"], donor[(0, 2)]["lora_A_down"])
    with pytest.raises(ExpertWorkerError, match=r"expert worker 1: adapter state lacks hosted experts \[\(0, 2\)\]"):
        manager.load_lora_state({(1, 1): donor[(1, 1)]})


def _mid_step(manager: ExpertManager) -> None:
    """A step in progress: a finished backward's gradients and a forward whose graph waits for its backward."""
    experts = torch.tensor([e for _, e in manager.keys] * 4)
    manager.forward_rows(0, experts, torch.randn(len(experts), HIDDEN), "done")
    manager.backward_rows("done", torch.ones(len(experts), HIDDEN))
    manager.forward_rows(0, experts, torch.randn(len(experts), HIDDEN), "waiting")
    assert any(grad.abs().sum() > 0 for named in manager.lora_grads().values() for grad in named.values())


@pytest.mark.parametrize("load", ["load_lora_state", "load_checkpoint"])
def test_loading_state_drops_the_step_in_progress(load, tmp_path):
    """A recovery loads the last checkpoint over a failed step's gradients and graphs: none may survive."""
    manager = _manager([(0, 0), (0, 2)], worker=1)
    staging = checkpoint.begin(tmp_path, step=1)
    manager.snapshot_checkpoint_part(str(staging))
    manager.finish_checkpoint_part()
    saved = {"load_lora_state": manager.lora_state(),
             "load_checkpoint": str(checkpoint.finalize(staging, step=1, meta={}))}[load]
    _mid_step(manager)
    getattr(manager, load)(saved)
    assert all(grad.abs().sum() == 0 for named in manager.lora_grads().values() for grad in named.values())
    with pytest.raises(ExpertWorkerError, match="backward of key 'waiting'"):
        manager.backward_rows("waiting", torch.ones(8, HIDDEN))


def test_topology_outside_ray():
    manager = _manager([(0, 0)], worker=3)
    assert manager.ping() == 3 and manager.report().pid > 0
    if not ray.is_initialized():
        assert manager.report().node_id == "local"
    assert link_tiers("a", ["local", "a", "b"]) == ["same_process", "same_node", "cross_node"]


@pytest.mark.parametrize("overrides, message", [
    ({"model_dir": "/ckpt"}, "exactly one of `model_dir` and `weights`"),
    ({"hf_config": None}, "need the `hf_config`"),
    ({"keys": [(0, 0), (0, 0)]}, "lists an expert twice"),
    ({"keys": [(0, 0), (9, 9)]}, r"lacks experts \[\(9, 9\)\]"),
])
def test_spec_errors_name_the_worker_and_the_fix(overrides, message):
    weights = synthetic_weights()
    fields = dict(worker=4, keys=[(0, 0)], weights={(0, 0): weights[(0, 0)]}, hf_config=SYNTHETIC_CONFIG)
    with pytest.raises(ValueError, match=f"worker 4: .*{message}"):
        ExpertManagerSpec(**{**fields, **overrides})
