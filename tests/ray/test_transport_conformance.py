"""One conformance suite for every Transport: in-process, Ray object refs, collective (torch.distributed), and the
collective plane of a second master process whose workers serve another master's plane too.

Each backend hosts the same synthetic experts under the same placement; the
reference is one in-process ExpertShard holding all of them. The end-to-end
check trains a debug model for 5 steps through each backend and compares the
losses and the exported adapter with plain transformers + peft.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Callable

import pytest
import ray
import torch
from safetensors.torch import load_file

from vela_ray.errors import ExpertWorkerError
from actors.transports import RayObjectRefTransport, collective_transport
from actors.workers import actor_workers
from tests.equivalence import LORA, build_pair, reference_adapter_state, run_both
from tests.ray.helpers import (
    HIDDEN, NUM_WORKERS, TIMEOUT_S, random_lora_state, specs_for, specs_from_shards, split_weights,
    synthetic_placement, synthetic_prototypes, synthetic_weights,
)
from vela_ray.model import wire
from vela_ray.model.experts import ExpertShard
from vela_ray.model.families import debug_config
from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.adapter_io import export
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.model.transport import ForwardRequest, InProcessTransport

class BesideAnotherMaster:
    """Master 1 of 2's collective transport with master 0's planes formed, idle, beside it (closed with it): every
    worker serves two masters' loops (issue 51), and the suite runs on the second one."""

    def __init__(self, handles, worker_tiers, timeout_s: float):
        self.other = collective_transport(handles, worker_tiers, timeout_s=timeout_s, master=0, num_masters=2)
        try:
            self.own = collective_transport(handles, worker_tiers, timeout_s=timeout_s, master=1, num_masters=2)
        except BaseException:
            self.other.close()
            raise
        self.num_workers = self.own.num_workers

    def forward(self, requests):
        return self.own.forward(requests)

    def backward(self, key, grads):
        return self.own.backward(key, grads)

    def worker_tiers(self):
        return self.own.worker_tiers()

    def describe(self) -> str:
        return self.own.describe()

    def close(self) -> None:
        try:
            self.own.close()
        finally:
            self.other.close()


BACKENDS = ["in_process", "object_refs", "collective", "collective_second_master"]
RAY_TRANSPORTS = {"object_refs": RayObjectRefTransport, "collective": collective_transport,
                  "collective_second_master": BesideAnotherMaster}


@dataclass
class Backend:
    name: str
    transport: object  # vela_ray.model.transport.Transport
    workers: object  # vela_ray.training.expert_workers.ExpertWorkers
    lora_grads: Callable[[], dict]
    close: Callable[[], None]


def _in_process_backend() -> Backend:
    """ExpertManagers in this process, as `cluster.workers_on_master` runs them, behind a direct call."""
    managers = [ExpertManager(spec) for spec in
                specs_for(split_weights(synthetic_weights(), synthetic_placement(), NUM_WORKERS))]

    def grads():
        return {key: by_name for m in managers for key, by_name in m.lora_grads().items()}

    return Backend("in_process", InProcessTransport(managers), ExpertWorkers.in_process(managers), grads,
                   close=lambda: None)


def _ray_backend(name: str, cluster) -> Backend:
    transport = RAY_TRANSPORTS[name](cluster.handles, cluster.worker_tiers(), timeout_s=TIMEOUT_S)

    def grads():
        merged = {}
        for part in ray.get([h.lora_grads.remote() for h in cluster.handles], timeout=TIMEOUT_S):
            merged.update(part)
        return merged

    return Backend(name, transport, actor_workers(cluster.handles, timeout_s=TIMEOUT_S), grads, transport.close)


@pytest.fixture(scope="module")
def reference() -> ExpertShard:
    """All synthetic experts in one shard, with the adapters every backend gets."""
    shard = ExpertShard.from_weights(synthetic_weights(), LORA, synthetic_prototypes())
    shard.load_lora_state(random_lora_state(shard.keys))
    return shard


@pytest.fixture(params=BACKENDS)
def backend(request, reference) -> Backend:
    """A fresh transport over the synthetic experts: same adapters as `reference`, no grads, no saved graphs.

    Function-scoped so that a collective group's serving loops run only during its own tests.
    """
    if request.param == "in_process":
        built = _in_process_backend()
    else:
        built = _ray_backend(request.param, request.getfixturevalue("synthetic_cluster"))
    built.workers.load_lora_state(random_lora_state(reference.keys))  # and no grads, no saved graphs
    reference.zero_grad(set_to_none=True)
    reference.release()
    yield built
    built.close()


def _requests(layer: int, rows_per_expert: int, key, skip_worker: int | None = None):
    """Rows for every expert of `layer` (grouped by expert) on each worker but `skip_worker`."""
    placement = synthetic_placement()[layer]
    g = torch.Generator().manual_seed(layer)
    requests = {}
    for worker in range(NUM_WORKERS):
        experts = [e for e in range(len(placement)) if int(placement[e]) == worker]
        if worker == skip_worker or not experts:
            continue
        ids = torch.tensor(experts).repeat_interleave(rows_per_expert)
        requests[worker] = ForwardRequest(layer, ids, torch.randn(len(ids), HIDDEN, generator=g), key)
    return requests


def test_forward_equals_direct_shard(backend, reference):
    for layer in (0, 1):
        requests = _requests(layer, rows_per_expert=3, key=None)
        outputs = backend.transport.forward(requests)
        assert outputs.keys() == requests.keys()
        for worker, req in requests.items():
            expected = reference.forward_rows(layer, req.expert_ids, req.rows)
            torch.testing.assert_close(outputs[worker], expected, rtol=1e-6, atol=1e-6)


def test_backward_gives_same_row_and_lora_grads(backend, reference):
    requests = _requests(1, rows_per_expert=4, key=("step", 1))
    backend.transport.forward(requests)
    grads = {w: torch.randn_like(req.rows) for w, req in requests.items()}
    row_grads = backend.transport.backward(("step", 1), grads)

    for worker, req in requests.items():
        reference.forward_rows(1, req.expert_ids, req.rows, key=("ref", worker))
        expected = reference.backward_rows(("ref", worker), grads[worker])
        torch.testing.assert_close(row_grads[worker], expected, rtol=1e-6, atol=1e-6)
    lora_grads = backend.lora_grads()
    assert lora_grads.keys() == set(reference.keys)
    for key, by_name in lora_grads.items():
        for name, grad in by_name.items():
            expected = getattr(reference.expert(*key), name).grad
            if key[0] == 0:  # layer 0 saw no rows: zero grads (not None), as ShardTrainer promises
                expected = torch.zeros_like(grad)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")


def test_rows_answered_to_another_master_reach_it_and_its_gradients_finish_the_backward(backend, reference):
    """`RowRelay` (several masters' sequence migration): with `reply_to`, the sender gets back only its rows;
    master 2 collects the rest, deposits their gradients, and the sender's backward then gives every row's
    d(rows) and LoRA gradients as if all the rows had been its own. The collective plane refuses: a master's
    plane answers only that master."""
    from vela_ray.model.transport import RowRelay

    if backend.name.startswith("collective"):
        assert not isinstance(backend.transport, RowRelay)
        return
    plain = _requests(1, rows_per_expert=4, key=("step", 1))
    reply = {w: torch.where(torch.arange(len(r.rows)) % 3 == 1, 2, -1) for w, r in plain.items()}
    requests = {w: ForwardRequest(r.layer, r.expert_ids, r.rows, r.key, reply[w]) for w, r in plain.items()}
    kept = backend.transport.forward(requests)
    collected = backend.transport.collect(("step", 1), 2, sorted(requests))
    grads = {w: torch.randn_like(r.rows) for w, r in requests.items()}
    backend.transport.deposit(("step", 1), 2, {w: grads[w][reply[w] == 2] for w in requests})
    row_grads = backend.transport.backward(("step", 1), {w: grads[w][reply[w] < 0] for w in requests})

    for worker, req in requests.items():
        expected = reference.forward_rows(1, req.expert_ids, req.rows, key=("ref", worker))
        torch.testing.assert_close(kept[worker], expected[reply[worker] < 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(collected[worker], expected[reply[worker] == 2], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(row_grads[worker], reference.backward_rows(("ref", worker), grads[worker]),
                                   rtol=1e-6, atol=1e-6)
    for key, by_name in backend.lora_grads().items():
        if key[0] == 1:
            for name, grad in by_name.items():
                torch.testing.assert_close(grad, getattr(reference.expert(*key), name).grad, rtol=1e-5, atol=1e-6)


def test_worker_without_rows_gets_nothing_and_the_others_work(backend, reference):
    requests = _requests(0, rows_per_expert=2, key=("idle", 0), skip_worker=1)
    outputs = backend.transport.forward(requests)
    assert set(outputs) == set(requests) and 1 not in outputs
    row_grads = backend.transport.backward(("idle", 0), {w: torch.ones_like(r.rows) for w, r in requests.items()})
    assert set(row_grads) == set(requests)


def test_request_with_zero_rows_returns_an_empty_result(backend):
    empty = ForwardRequest(0, torch.zeros(0, dtype=torch.long), torch.zeros(0, HIDDEN), None)
    outputs = backend.transport.forward({2: empty})
    assert outputs[2].shape == (0, HIDDEN)


def test_unknown_expert_error_names_the_expert_and_the_transport_survives(backend):
    hosted_by_0 = [e for e in range(6) if int(synthetic_placement()[0][e]) == 0]
    foreign = next(e for e in range(6) if e not in hosted_by_0)
    bad = ForwardRequest(0, torch.tensor([foreign]), torch.randn(1, HIDDEN), ("bad", 0))
    with pytest.raises(ExpertWorkerError, match=rf"l0_e{foreign}|\(0, {foreign}\)") as caught:
        backend.transport.forward({0: bad})
    assert caught.value.worker == 0 and "expert worker 0" in str(caught.value)
    outputs = backend.transport.forward(_requests(0, rows_per_expert=1, key=None))
    assert len(outputs) == NUM_WORKERS


@pytest.mark.parametrize("row_format", ["float8", "bfloat16"])
def test_low_bit_rows_come_back_in_their_wire_form_close_to_the_exact_result(backend, reference, row_format):
    requests = _requests(1, rows_per_expert=4, key=("wire", 1))
    sent = {w: ForwardRequest(r.layer, r.expert_ids, wire.encode(r.rows, row_format), r.key)
            for w, r in requests.items()}
    outputs = backend.transport.forward(sent)
    grads = {w: torch.randn_like(req.rows) for w, req in requests.items()}
    row_grads = backend.transport.backward(("wire", 1), {w: wire.encode(g, row_format) for w, g in grads.items()})
    for worker, req in requests.items():
        assert outputs[worker].dtype == sent[worker].rows.dtype and outputs[worker].shape == sent[worker].rows.shape
        expected = reference.forward_rows(1, req.expert_ids, req.rows, key=("ref", worker))
        expected_grad = reference.backward_rows(("ref", worker), grads[worker])
        for got, want in ((outputs[worker], expected), (row_grads[worker], expected_grad)):
            torch.testing.assert_close(wire.decode(got, torch.float32), want, rtol=0,
                                       atol=0.15 * want.abs().max().item())


def test_collective_rows_travel_on_a_data_plane_of_their_own(synthetic_cluster):
    """The collective backend above runs split planes: headers over gloo, rows over a second group (gloo on
    these CPU actors, NCCL when every rank has a GPU of its own), which the suite exercises."""
    cluster = synthetic_cluster
    transport = collective_transport(cluster.handles, cluster.worker_tiers(), timeout_s=TIMEOUT_S)
    try:
        assert transport.data.group is not transport.group
        assert transport.data.backend == "gloo" and transport.data.device == torch.device("cpu")
    finally:
        transport.close()


def _ray_pair(family: str, kind: str, ray_pool):
    """build_pair with the experts in ExpertManager actors behind a Ray transport."""
    hf_config = debug_config(family)
    clusters = []

    def make_transport(shards):
        clusters.append(ray_pool.spawn(specs_from_shards(shards, hf_config)))
        cluster = clusters[0]
        return ray_pool.track(RAY_TRANSPORTS[kind](cluster.handles, cluster.worker_tiers(), timeout_s=TIMEOUT_S))

    pair = build_pair(family, make_transport)
    ray_workers = actor_workers(clusters[0].handles, timeout_s=TIMEOUT_S)
    ray_workers.load_lora_state(pair.workers.lora_state())  # build_pair imported the adapter in-process
    pair.workers = ray_workers
    return pair


@pytest.mark.parametrize("family, in_flight", [("mixtral", 1), ("qwen3_moe", 3)],
                         ids=["mixtral", "qwen3_moe-3-in-flight"])
@pytest.mark.parametrize("transport", BACKENDS)
def test_train_step_over_three_workers_matches_peft(transport, family, in_flight, request):
    """The serial step, and 3 of 4 micro-batches in flight at once (`training.overlap`) on every transport."""
    if transport == "in_process":
        pair = build_pair(family)
    else:
        pair = _ray_pair(family, transport, request.getfixturevalue("ray_pool"))
    ref_losses, vela_losses = run_both(pair, steps=5, count=2 if in_flight == 1 else 4, in_flight=in_flight)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert ref_losses[0] != ref_losses[-1]

    out = tempfile.mkdtemp()
    export(pair.master, pair.workers, out)
    exported = load_file(f"{out}/adapter_model.safetensors")
    for key, value in reference_adapter_state(pair).items():
        scale = float(value.abs().max())  # Adam amplifies float noise near zero grads: compare to scale
        assert float((exported[key] - value).abs().max()) <= 2e-3 * scale, key
