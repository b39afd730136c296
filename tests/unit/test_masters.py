"""Data-parallel masters in one process: M backbone replicas (threads) split every micro-batch and share the
ExpertManagers, and training is plain peft's on the whole batch."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.observability.report import summary_text
from vela_ray.runtime.local import InProcessPool
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
                                        masters={"count": masters}, **sections))


def _adapter(summary) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


@pytest.mark.job
def test_masters_splitting_the_batch_train_exactly_like_one_master_and_peft(model_dir, tmp_path):
    one = run_in_process(_config(model_dir, tmp_path / "one", 1))
    config = _config(model_dir, tmp_path / "three", 3)
    three = run_in_process(config)

    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(three.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(three.losses), torch.tensor(one.losses), rtol=1e-5, atol=0)
    adapter = _adapter(three)
    assert set(adapter) == set(_adapter(one))
    for name, value in _adapter(one).items():
        # summation order differs (threads, expert gradients arriving in any order): AdamW amplifies it
        torch.testing.assert_close(adapter[name], value, rtol=1e-3, atol=5e-5)
    # the same rows travel, split among the masters: every worker's bytes and every expert's tokens add up
    assert three.master_nodes == ["local"] * 3 and one.master_nodes == ["local"]
    assert three.traffic_bytes_by_worker == one.traffic_bytes_by_worker
    assert three.sent_bytes_by_worker == three.worker_received_bytes
    assert three.tokens_routed == one.tokens_routed
    for a, b in zip(three.history, one.history):
        assert a.bytes_by_worker == b.bytes_by_worker
    assert three.placement.problem.master_nodes == ["local"] * 3
    assert "3 data-parallel masters on 1 node(s); no expert copies" in summary_text(three)
    assert "data-parallel masters" not in summary_text(one)


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
    ({"masters": {"count": 3}, "training": {"steps": 1, "batch_size": 4, "micro_batch_size": 2}},
     r"a micro-batch of 2 rows cannot feed masters.count = 3 masters"),
    ({"masters": {"count": 2}, "cluster": {"workers_on_master": 1}},
     r"cluster.workers_on_master and several master processes .* do not combine: the other master processes "
     r"cannot reach ExpertManagers in master 0's process. Fix: set cluster.workers_on_master: 0"),
    ({"cluster": {"num_gpus_per_worker": 1, "workers_on_master": 3}},
     r"cluster.num_gpus_per_worker must be 0"),
    ({"cluster": {"workers_on_master": 4}}, r"cluster.workers_on_master \(4\) cannot exceed cluster.num_workers \(3\)"),
    ({"cluster": {"experts_on_master": True}}, r"cluster.experts_on_master is now cluster.workers_on_master"),
])
def test_masters_the_job_cannot_feed_are_refused_in_one_line(tmp_path, sections, message):
    with pytest.raises(ValueError, match=message):
        JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out", **sections))


@pytest.mark.job
def test_replicated_experts_train_like_peft_and_their_copies_stay_identical(model_dir, tmp_path):
    """Two masters, each using its own copy of half the experts: the copies' summed gradients keep their
    adapters and AdamW moments bitwise equal, and the run equals peft; a checkpoint holds each expert once."""
    from placement import Placement, sequential_table

    from vela_ray.runtime.migration import copies_of
    from vela_ray.training import checkpoint

    table = sequential_table(2, 6, 3)  # the tiny Mixtral: 2 MoE layers x 6 experts on 3 workers
    routes = np.stack([table, table.copy()])
    routes[1, :, :2] = (table[:, :2] + 1) % 3  # master 1 uses a copy of experts 0 and 1 on the next worker
    placement = Placement(expert_to_worker=table.tolist(), num_workers=3, capacities=[8] * 3, solver="file",
                          expected_step_time=0.0, routes=routes.tolist())
    placement.to_json(tmp_path / "placement.json")
    config = _config(model_dir, tmp_path / "out", 2,
                     placement={"solver": "file", "file": str(tmp_path / "placement.json"), "profile": "uniform"},
                     checkpoint={"every": STEPS})
    pool = _KeepingPool(config)
    summary = run_in_process(config, pool=pool)

    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    copies = copies_of(routes)
    assert len(copies) == 4 and summary.placement.routes == routes.tolist()
    assert "2 data-parallel masters on 1 node(s); 4 expert copies (replicas)" in summary_text(summary)
    assert "4 expert copies" in (Path(summary.report)).read_text()
    for key, workers in copies.items():
        states = [pool.kept[w].expert_states([key])[key] for w in workers]
        assert states[0].keys() == states[1].keys() and any("." in name for name in states[0])  # AdamW too
        for name in states[0]:
            assert torch.equal(states[0][name], states[1][name]), (key, name)
    # the checkpoint holds every expert once
    parts = sorted((Path(summary.checkpoint) / "experts").iterdir())
    experts_in = [{".".join(name.split(".")[:2]) for name in checkpoint.read_tensors(part)} for part in parts]
    assert sum(len(part) for part in experts_in) == len(set().union(*experts_in)) == 12


class _KeepingPool(InProcessPool):
    """Keeps its ExpertManagers past the run's end, for the test to look at."""

    def close(self) -> None:
        self.kept = self.managers
        super().close()


@pytest.mark.slow  # waits out a watch timeout
def test_a_master_waiting_in_the_gradient_sum_gives_up_as_soon_as_its_watch_sees_a_failed_master():
    """A real gloo group of two ranks (threads): with both in, the sum is right; with rank 1 gone, rank 0's
    watch ends its wait long before the group's timeout."""
    import time

    from vela_ray.model.collective import make_group, make_store
    from vela_ray.training.replicas import ProcessGroupReplicas

    store = make_store("127.0.0.1", 0, 2, is_master=True, timeout_s=GROUP_TIMEOUT_S)
    groups = {}

    def join(rank: int) -> None:
        peer_store = store if rank == 0 else make_store("127.0.0.1", store.port, 2, is_master=False,
                                                         timeout_s=GROUP_TIMEOUT_S)
        groups[rank] = make_group(peer_store, rank, 2, timeout_s=GROUP_TIMEOUT_S)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    watched = ProcessGroupReplicas(groups[0], watch=lambda group_failed: None)
    other, totals = ProcessGroupReplicas(groups[1]), {}
    helper = threading.Thread(target=lambda: totals.setdefault(1, other.sum(2.0)))
    helper.start()
    assert watched.sum(1.0) == 3.0
    helper.join()
    assert totals[1] == 3.0

    start = time.monotonic()

    def failed_master(group_failed: bool) -> None:
        if time.monotonic() - start > 0.2:
            raise RuntimeError("master 1 died")

    watched.watch = failed_master
    with pytest.raises(RuntimeError, match="master 1 died"):
        watched.sum(1.0)  # rank 1 never joins
    assert time.monotonic() - start < GROUP_TIMEOUT_S / 3  # not the group's timeout


GROUP_TIMEOUT_S = 6.0  # the abandoned sum is only released by it (when the group is dropped)
