"""Replicated experts' gradients are summed among their workers (`ExpertWorkers.grad_sq_norm` ->
`ExpertManager.sum_copy_grads`): every copy gets the sum of all copies' gradients, added in worker order, so the
copies hold the same bits and take the same optimizer step; the norm counts each expert once. Here in one
process; over Ray actors, with no gradient reaching the master: tests/ray/test_replicated_grads.py."""

from __future__ import annotations

import pytest
import torch

from tests.ray.helpers import (
    REPLICATED_COPIES, REPLICATED_KEYS, replicas_mid_step, replicated_specs, summed_in_worker_order,
)
from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.expert_workers import ExpertWorkers


def test_each_copy_gets_the_worker_order_sum_of_all_copies_gradients_bit_for_bit():
    managers = [ExpertManager(spec) for spec in replicated_specs()]
    workers = ExpertWorkers.in_process(managers)
    workers.set_copies(REPLICATED_COPIES)
    before = replicas_mid_step(workers)

    sq_norm = workers.grad_sq_norm()

    after = [manager.lora_grads() for manager in managers]
    summed = summed_in_worker_order(before, REPLICATED_COPIES)
    for key, holders in REPLICATED_COPIES.items():
        for worker in holders:
            for name, want in summed[key].items():
                assert torch.equal(after[worker][key][name], want), (key, worker, name)
    # the same additions in another order give other bits: the order is what keeps the copies equal
    flat = [torch.cat([t.flatten() for t in grads[(0, 0)].values()]) for grads in before]
    assert not torch.equal((flat[0] + flat[1]) + flat[2], flat[0] + (flat[1] + flat[2]))
    # an expert hosted once keeps its own gradient; the norm counts every expert once
    once = {key: before[w][key] for w, keys in enumerate(REPLICATED_KEYS) for key in keys
            if key not in REPLICATED_COPIES}
    for key, named in once.items():
        worker = next(w for w, keys in enumerate(REPLICATED_KEYS) if key in keys)
        assert all(torch.equal(after[worker][key][name], grad) for name, grad in named.items()), key
    want_sq = sum(float(t.double().pow(2).sum()) for named in [*once.values(), *summed.values()]
                  for t in named.values())
    assert sq_norm == pytest.approx(want_sq, rel=1e-6)


def test_without_copies_the_norm_is_every_workers_own_and_no_gradient_changes():
    managers = [ExpertManager(spec) for spec in replicated_specs()]
    workers = ExpertWorkers.in_process(managers)
    before = replicas_mid_step(workers)
    sq_norm = workers.grad_sq_norm()
    assert sq_norm == pytest.approx(sum(float(t.double().pow(2).sum()) for grads in before
                                        for named in grads.values() for t in named.values()), rel=1e-6)
    for manager, grads in zip(managers, before):
        assert all(torch.equal(manager.lora_grads()[key][name], grad)
                   for key, named in grads.items() for name, grad in named.items())
