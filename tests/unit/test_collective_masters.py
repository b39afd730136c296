"""Several master processes on the collective plane, in one process with no Ray: each master (a thread here) forms
planes of its own with the same ExpertManagers, which serve one loop per master (issue 51, "the masters as one
group").

Each master gets exactly what a direct call gives for its rows while the other sends at the same time (their key
ids collide on purpose: both transports count from 0), the workers' LoRA gradients are the sum over both masters,
and a master's failures and its close stay on its own plane.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from tests.ray.helpers import HIDDEN, NUM_EXPERTS, NUM_LAYERS, random_lora_state, specs_for, synthetic_weights
from tests.equivalence import scattered_placement
from vela_ray.errors import ExpertWorkerError
from vela_ray.model import collective
from vela_ray.model.collective import CollectiveTransport, PlaneKey, form_data_plane
from vela_ray.model.transport import ForwardRequest, InProcessTransport
from vela_ray.training.expert_manager import ExpertManager

JOIN_S = 30.0
TIMEOUT_S = 30.0
WORKERS = 2
MASTERS = 2


def _placement() -> torch.Tensor:
    return scattered_placement(NUM_LAYERS, NUM_EXPERTS, WORKERS)


def _managers() -> list[ExpertManager]:
    weights, placement = synthetic_weights(), _placement()
    parts = [{k: w for k, w in weights.items() if int(placement[k]) == n} for n in range(WORKERS)]
    managers = [ExpertManager(spec) for spec in specs_for(parts)]
    for manager in managers:
        manager.load_lora_state(random_lora_state(manager.keys))
    return managers


def _requests(layer: int, key, seed: int, rows_per_expert: int = 3) -> dict[int, ForwardRequest]:
    placement = _placement()[layer]
    g = torch.Generator().manual_seed(seed)
    requests = {}
    for worker in range(WORKERS):
        ids = torch.tensor([e for e in range(NUM_EXPERTS) if int(placement[e]) == worker])
        ids = ids.repeat_interleave(rows_per_expert)
        requests[worker] = ForwardRequest(layer, ids, torch.randn(len(ids), HIDDEN, generator=g), key)
    return requests


def _grads_like(outputs: dict[int, torch.Tensor], seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {w: torch.randn(out.shape, generator=g) for w, out in outputs.items()}


@dataclass
class MasterPlane:
    """Master `master`'s transport to the managers, formed as `actors.transports.collective_transport` forms it."""

    master: int
    transport: CollectiveTransport


def form_plane(managers: list[ExpertManager], master: int, num_masters: int = MASTERS) -> MasterPlane:
    world_size = len(managers) + 1
    store = collective.make_store("127.0.0.1", 0, world_size, is_master=True, timeout_s=JOIN_S)
    for manager in managers:
        manager.join_collective("127.0.0.1", store.port, world_size, JOIN_S, master=master, num_masters=num_masters)
    group = collective.make_group(store, 0, world_size, JOIN_S)
    data = form_data_plane(group, store, len(managers), "cpu", None, TIMEOUT_S, JOIN_S)
    leave = lambda: [m.leave_collective(master=master) for m in managers]  # noqa: E731
    return MasterPlane(master, CollectiveTransport(group, data, ["same_node"] * len(managers), TIMEOUT_S,
                                                   on_close=leave))


def form_all(managers: list[ExpertManager]) -> list[MasterPlane]:
    """Every master forms its planes at the same time (threads), as master processes do."""
    planes: dict[int, MasterPlane] = {}
    threads = [threading.Thread(target=lambda m=m: planes.__setitem__(m, form_plane(managers, m)))
               for m in range(MASTERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * JOIN_S)
    assert sorted(planes) == list(range(MASTERS)), "a master's planes did not form"
    return [planes[m] for m in range(MASTERS)]


def _serving(manager: ExpertManager, master: int) -> bool:
    return not manager.leave_collective(timeout_s=0, master=master)


def _micro_batches(master: int, steps: int = 3):
    """Master `master`'s rows: per step a forward of both layers, then their backwards (seeds differ by master)."""
    for step in range(steps):
        seed = 100 * master + 10 * step
        yield step, {layer: _requests(layer, ("step", step, layer), seed + layer) for layer in range(NUM_LAYERS)}


def _run(transport, master: int, answers: dict, errors: list) -> None:
    """Forward both layers, then backward them, for each step; `answers[(step, layer)]` = (outputs, d(rows))."""
    try:
        for step, by_layer in _micro_batches(master):
            outputs = {layer: transport.forward(reqs) for layer, reqs in by_layer.items()}
            for layer in reversed(range(NUM_LAYERS)):
                grads = _grads_like(outputs[layer], 1000 * master + 10 * step + layer)
                answers[step, layer] = (outputs[layer], transport.backward(("step", step, layer), grads))
    except BaseException as err:  # noqa: BLE001 - raised in the test's thread
        errors.append(err)


@pytest.mark.timeout(180)
def test_two_masters_sending_at_once_each_get_a_direct_calls_answers_and_the_gradients_add_up():
    managers, reference = _managers(), _managers()
    planes = form_all(managers)
    try:
        assert all(_serving(m, p.master) for m in managers for p in planes)
        answers = {p.master: {} for p in planes}
        errors: list = []
        threads = [threading.Thread(target=_run, args=(p.transport, p.master, answers[p.master], errors))
                   for p in planes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        # the same rows by direct call, one master after the other, each under keys of its own
        direct = InProcessTransport(reference)
        for master in range(MASTERS):
            for step, by_layer in _micro_batches(master):
                outputs = {layer: direct.forward({w: ForwardRequest(r.layer, r.expert_ids, r.rows, (master, r.key))
                                                  for w, r in reqs.items()})
                           for layer, reqs in by_layer.items()}
                for layer in reversed(range(NUM_LAYERS)):
                    grads = _grads_like(outputs[layer], 1000 * master + 10 * step + layer)
                    row_grads = direct.backward((master, ("step", step, layer)), grads)
                    got_outputs, got_row_grads = answers[master][step, layer]
                    for worker in outputs[layer]:
                        torch.testing.assert_close(got_outputs[worker], outputs[layer][worker], rtol=0, atol=0)
                        torch.testing.assert_close(got_row_grads[worker], row_grads[worker], rtol=1e-6, atol=1e-7)
        for manager, ref in zip(managers, reference):
            got, want = manager.lora_grads(), ref.lora_grads()
            assert got.keys() == want.keys()
            for key, by_name in want.items():
                for name, grad in by_name.items():  # summed in another order: float noise only
                    torch.testing.assert_close(got[key][name], grad, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
            assert manager.received_bytes == ref.received_bytes  # every row and gradient, counted once
            assert not manager.shard._saved  # every master's saved forwards ended in its backward
    finally:
        for plane in planes:
            plane.transport.close()
    assert not any(_serving(m, p.master) for m in managers for p in planes)


@pytest.mark.timeout(120)
def test_closing_one_master_stops_only_its_loops_and_the_other_keeps_serving():
    managers = _managers()
    first, second = form_all(managers)
    try:
        second.transport.close()
        assert not any(_serving(m, second.master) for m in managers)
        assert all(_serving(m, first.master) for m in managers)
        requests = _requests(1, ("after", 0), seed=7)
        outputs = first.transport.forward(requests)
        assert {w: o.shape for w, o in outputs.items()} == {w: r.rows.shape for w, r in requests.items()}
        first.transport.backward(("after", 0), {w: torch.ones_like(o) for w, o in outputs.items()})
        again = form_plane(managers, second.master)  # a master re-forms its planes beside the other's
        try:
            assert again.transport.forward(requests)[0].shape == requests[0].rows.shape
        finally:
            again.transport.close()
        assert all(_serving(m, first.master) for m in managers)
    finally:
        first.transport.close()
    assert not any(_serving(m, p) for m in managers for p in range(MASTERS))


@pytest.mark.timeout(120)
def test_a_workers_failure_on_one_masters_plane_stays_on_that_plane(monkeypatch):
    """Master 1's request names an expert worker 0 does not host (answered ERROR, in step), then one whose buffer
    worker 0 cannot allocate (answered OUT_OF_STEP: master 1's data plane is refused from then on). Master 0's
    plane serves on throughout, and master 1's close still stops its loops."""
    managers = _managers()
    first, second = form_all(managers)
    try:
        hosted = {e for (layer, e) in managers[0].keys if layer == 0}
        foreign = next(e for e in range(NUM_EXPERTS) if e not in hosted)
        with pytest.raises(ExpertWorkerError, match="expert worker 0") as caught:
            second.transport.forward({0: ForwardRequest(0, torch.tensor([foreign]), torch.randn(1, HIDDEN))})
        assert caught.value.worker == 0
        assert len(second.transport.forward(_requests(0, None, seed=1))) == WORKERS  # in step

        empty = collective._ServingLoop._empty

        def fails_on_master_1(loop, shape, dtype):
            if loop.master == 1 and loop.server.worker == 0:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return empty(loop, shape, dtype)

        monkeypatch.setattr(collective._ServingLoop, "_empty", fails_on_master_1)
        with pytest.raises(ExpertWorkerError, match="could not allocate"):
            second.transport.forward(_requests(0, None, seed=2))
        with pytest.raises(RuntimeError, match="out of step"):
            second.transport.forward(_requests(0, None, seed=3))
        outputs = first.transport.forward(_requests(1, ("still", 0), seed=4))
        first.transport.backward(("still", 0), {w: torch.ones_like(o) for w, o in outputs.items()})
        second.transport.close()
        assert not any(_serving(m, second.master) for m in managers)
        assert len(first.transport.forward(_requests(0, None, seed=5))) == WORKERS
    finally:
        second.transport.close()
        first.transport.close()


def test_keys_of_several_planes_never_collide_with_each_other_or_a_ray_callers():
    assert PlaneKey(0, 3) != PlaneKey(1, 3) and PlaneKey(0, 3) == PlaneKey(0, 3)
    assert PlaneKey(0, 3) != (0, 3) and hash(PlaneKey(0, 3)) == hash(PlaneKey(0, 3))
