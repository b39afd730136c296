"""Replicated experts' gradients over Ray actors: summed among the workers that hold the copies, each handed the
others' gradients as references to their object stores (`ExpertManager.sum_copy_grads`, `ExpertManagerActor.pass_on`),
so that no gradient passes through the master's process; with
ExpertManagers in the master's process too (`cluster.workers_on_master`), which get the values of the refs.
The in-process form and the summing order: tests/unit/test_replicated_grads.py."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.workers import Stored, actor_workers
from tests.ray.helpers import (
    REPLICATED_COPIES, TIMEOUT_S, replicas_mid_step, replicated_specs, spawn, summed_in_worker_order,
)
from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.expert_workers import ExpertWorkers


@pytest.fixture(scope="module")
def replicated_cluster(ray_session):
    """3 ExpertManager actors of `replicated_specs`: expert (0, 0) on each, (1, 0) on workers 0 and 1."""
    cluster = spawn(replicated_specs())
    yield cluster
    cluster.shutdown()


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        value = list(value.values())
    return sum(map(_tensor_bytes, value)) if isinstance(value, (list, tuple)) else 0


def _assert_copies_hold_the_worker_order_sum(workers: ExpertWorkers, before: list[dict]) -> None:
    after = workers.wait([workers.call_one(n, "lora_grads") for n in range(workers.num_workers)])
    for key, holders in REPLICATED_COPIES.items():
        for name, want in summed_in_worker_order(before, REPLICATED_COPIES)[key].items():
            for worker in holders:
                assert torch.equal(after[worker][key][name], want), (key, worker, name)


def test_copies_sum_their_gradients_among_the_actors_and_the_master_gets_none_back(replicated_cluster,
                                                                                   monkeypatch):
    workers = actor_workers(replicated_cluster.handles, timeout_s=TIMEOUT_S)
    workers.set_copies(REPLICATED_COPIES)
    before = replicas_mid_step(workers)
    received = []
    real_get = ray.get

    def counting_get(*args, **kwargs):
        value = real_get(*args, **kwargs)
        received.append(value)
        return value

    with monkeypatch.context() as patch:
        patch.setattr(ray, "get", counting_get)
        sq_norm = workers.grad_sq_norm()

    assert received and sq_norm > 0  # the driver got the norms through `ray.get` ...
    assert sum(map(_tensor_bytes, received)) == 0  # ... and no gradient
    _assert_copies_hold_the_worker_order_sum(workers, before)
    # what a worker's pending answer holds for the driver: a reference to its own object store, however small the
    # gradients (Ray would otherwise return them inline, through the driver's process)
    assert isinstance(ray.get(workers.call_one(0, "lora_grads", [(1, 0)])), Stored)


def test_a_worker_in_the_masters_process_sums_with_the_actors(replicated_cluster):
    """Worker 2 an ExpertManager of this process: it gets the actors' gradients as values, they get its own."""
    local = ExpertManager(replicated_specs()[2])
    workers = actor_workers(replicated_cluster.handles[:2], timeout_s=TIMEOUT_S, local=[local])
    workers.set_copies(REPLICATED_COPIES)
    before = replicas_mid_step(workers)
    workers.grad_sq_norm()
    _assert_copies_hold_the_worker_order_sum(workers, before)
