"""Data-parallel masters in one process: M backbone replicas (threads) split every micro-batch and share the
ExpertManagers, and training is plain peft's on the whole batch."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses
from vela_ray.config import JobConfig
from vela_ray.runtime.local import InProcessPool
from vela_ray.runtime.runner import JobRunner
from vela_ray.training.replicas import ThreadGroup

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")
    init_adapter(model, model.parent / "adapter")
    return model


def _config(model_dir: Path, out: Path, masters: int, **sections) -> JobConfig:
    sections.setdefault("lora", {"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")})
    training = {"optimizer": {"lr": 5e-3, "warmup_steps": 1}, "batch_size": 6, "micro_batch_size": 3}
    return JobConfig.from_dict(job_dict(model_dir, out, steps=STEPS, training=training,
                                        cluster={"num_masters": masters}, **sections))


def _adapter(summary) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


def test_masters_splitting_the_batch_train_exactly_like_one_master_and_peft(model_dir, tmp_path):
    one = JobRunner(_config(model_dir, tmp_path / "one", 1), InProcessPool(_config(model_dir, tmp_path / "one", 1))).run()
    config = _config(model_dir, tmp_path / "three", 3)
    three = JobRunner(config, InProcessPool(config)).run()

    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(three.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(three.losses), torch.tensor(one.losses), rtol=1e-5, atol=0)
    adapter = _adapter(three)
    assert set(adapter) == set(_adapter(one))
    for name, value in _adapter(one).items():
        torch.testing.assert_close(adapter[name], value, rtol=1e-4, atol=1e-6)
    # the same rows travel, split among the masters: every worker's bytes and every expert's tokens add up
    assert three.master_nodes == ["local"] * 3 and one.master_nodes == ["local"]
    assert three.traffic_bytes_by_worker == one.traffic_bytes_by_worker
    assert three.sent_bytes_by_worker == three.worker_received_bytes
    assert three.tokens_routed == one.tokens_routed
    for a, b in zip(three.history, one.history):
        assert a.bytes_by_worker == b.bytes_by_worker
    assert three.placement.problem.master_nodes == ["local"] * 3


def test_thread_group_sums_agree_bitwise_on_every_thread():
    group, results = ThreadGroup(3), {}
    values = [torch.tensor([0.1, 1e-8, 3.0]) * (rank + 1) for rank in range(3)]

    def run(rank: int) -> None:
        member = group.member(rank)
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = values[rank].clone()
        member.sync_grads([param])
        results[rank] = (param.grad, member.sum(float(rank)))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = values[0] + values[1] + values[2]
    for grad, total in results.values():
        assert torch.equal(grad, expected) and total == 3.0


@pytest.mark.parametrize("sections, message", [
    ({"cluster": {"num_masters": 2, "transport": "collective"}},
     r"cluster.num_masters is 2 but cluster.transport is 'collective'.*use transport: object_ref"),
    ({"cluster": {"num_masters": 3}, "training": {"steps": 1, "batch_size": 4, "micro_batch_size": 2}},
     r"a micro-batch of 2 rows cannot feed cluster.num_masters = 3 masters"),
])
def test_masters_the_job_cannot_feed_are_refused_in_one_line(tmp_path, sections, message):
    with pytest.raises(ValueError, match=message):
        JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out", **sections))
