"""Two master processes on the collective plane with the same ExpertManager actors (issue 51, "the masters as one
group"): the test driver is master 0, a small Ray actor master 1; each forms planes of its own
(`collective_transport(master=, num_masters=)`, as `actors.transports.master_transport` does for every master
process), at the same time, and both send forward and backward rows at once.

Each master gets exactly what the Ray object-ref transport gives for the same rows (outputs and d(rows)), the
workers' accumulated LoRA gradients equal the object-ref run's over both masters' rows, the workers receive the
same bytes, and closing master 1's transport leaves master 0's loops serving.

(The same in one process, with failures kept on their plane: tests/unit/test_collective_masters.py.)
"""

from __future__ import annotations

import pytest
import ray
import torch

from vela_ray.runtime.masters import MasterMesh
from actors.transports import RayObjectRefTransport, collective_transport, master_transport
from actors.workers import actor_workers
from tests.equivalence import scattered_placement
from tests.ray.helpers import (
    HIDDEN, NUM_EXPERTS, NUM_LAYERS, TIMEOUT_S, random_lora_state, spawn, specs_for, synthetic_weights,
)
from vela_ray.model.collective import CollectiveTransport
from vela_ray.model.transport import ForwardRequest

WORKERS, MASTERS, STEPS = 2, 2, 3


def _placement() -> torch.Tensor:
    return scattered_placement(NUM_LAYERS, NUM_EXPERTS, WORKERS)


def _requests(layer: int, key, seed: int, rows_per_expert: int = 3) -> dict[int, ForwardRequest]:
    placement, g = _placement()[layer], torch.Generator().manual_seed(seed)
    requests = {}
    for worker in range(WORKERS):
        ids = torch.tensor([e for e in range(NUM_EXPERTS) if int(placement[e]) == worker])
        ids = ids.repeat_interleave(rows_per_expert + worker)
        requests[worker] = ForwardRequest(layer, ids, torch.randn(len(ids), HIDDEN, generator=g), key)
    return requests


def run_master(transport, master: int) -> dict:
    """Master `master`'s rows (its own seeds; both masters use the same keys): per step a forward of every layer,
    then their backwards in reverse. Returns {(step, layer): (outputs, d(rows))}."""
    answers = {}
    for step in range(STEPS):
        seed = 100 * master + 10 * step
        outputs = {layer: transport.forward(_requests(layer, ("step", step, layer), seed + layer))
                   for layer in range(NUM_LAYERS)}
        for layer in reversed(range(NUM_LAYERS)):
            g = torch.Generator().manual_seed(1000 * master + 10 * step + layer)
            grads = {w: torch.randn(out.shape, generator=g) for w, out in outputs[layer].items()}
            answers[step, layer] = (outputs[layer], transport.backward(("step", step, layer), grads))
    return answers


@ray.remote(num_cpus=0)
class SecondMaster:
    """Master process 1 of 2: its own collective planes with the workers, and its own rows."""

    def __init__(self, handles: list, worker_tiers: list):
        self.handles, self.worker_tiers = handles, worker_tiers
        self.transport: CollectiveTransport | None = None

    def form(self) -> str:
        self.transport = collective_transport(self.handles, self.worker_tiers, timeout_s=TIMEOUT_S, master=1,
                                              num_masters=MASTERS)
        return self.transport.describe()

    def run(self) -> dict:
        return run_master(self.transport, 1)

    def close(self) -> None:
        self.transport.close()


def _lora_grads(handles) -> dict:
    merged = {}
    for part in ray.get([h.lora_grads.remote() for h in handles], timeout=TIMEOUT_S):
        merged.update(part)
    return merged


def _received(handles) -> list[int]:
    return [r.received_bytes for r in ray.get([h.report.remote() for h in handles], timeout=TIMEOUT_S)]


def _serving(handles, master: int) -> list[bool]:
    return [not done for done in ray.get([h.leave_collective.remote(0, master) for h in handles], timeout=TIMEOUT_S)]


@pytest.fixture(scope="module")
def two_workers(ray_session):
    """2 ExpertManager actors hosting the synthetic experts, shared by both masters (and both tests)."""
    weights, placement = synthetic_weights(), _placement()
    cluster = spawn(specs_for([{k: w for k, w in weights.items() if int(placement[k]) == n} for n in range(WORKERS)]))
    yield cluster
    cluster.shutdown()


@pytest.mark.timeout(300)
def test_two_masters_on_the_collective_plane_equal_the_object_ref_run(two_workers, ray_pool):
    weights = synthetic_weights()
    handles, tiers = two_workers.handles, two_workers.worker_tiers()
    workers = actor_workers(handles, timeout_s=TIMEOUT_S)
    lora = random_lora_state(sorted(weights))
    workers.load_lora_state(lora)
    second = SecondMaster.remote(handles, tiers)
    try:
        # both masters form their planes at once: the workers join each on a thread, so neither waits on the other
        formed = second.form.remote()
        first = ray_pool.track(collective_transport(handles, tiers, timeout_s=TIMEOUT_S, master=0,
                                                    num_masters=MASTERS))
        assert ray.get(formed, timeout=TIMEOUT_S) == first.describe() == "collective (gloo)"
        assert _serving(handles, 0) == _serving(handles, 1) == [True] * WORKERS

        before = _received(handles)
        running = second.run.remote()  # master 1 sends while master 0 does
        collective = {0: run_master(first, 0), 1: ray.get(running, timeout=120)}
        collective_grads = _lora_grads(handles)
        collective_bytes = [b - a for a, b in zip(before, _received(handles))]

        ray.get(second.close.remote(), timeout=TIMEOUT_S)  # master 1's loops end; master 0's serve on
        assert _serving(handles, 1) == [False] * WORKERS and _serving(handles, 0) == [True] * WORKERS
        after = _requests(0, ("after", 0), seed=5)
        outputs = first.forward(after)
        first.backward(("after", 0), {w: torch.ones_like(o) for w, o in outputs.items()})

        workers.load_lora_state(lora)  # the same adapters, no gradients: the object-ref run from the same start
        object_refs = RayObjectRefTransport(handles, tiers, timeout_s=TIMEOUT_S)
        before = _received(handles)
        reference = {m: run_master(object_refs, m) for m in range(MASTERS)}
        reference_grads = _lora_grads(handles)
        assert collective_bytes == [b - a for a, b in zip(before, _received(handles))]
        assert collective_bytes[0] > 0

        for master in range(MASTERS):
            for (step, layer), (want_out, want_grad) in reference[master].items():
                got_out, got_grad = collective[master][step, layer]
                for worker in want_out:
                    torch.testing.assert_close(got_out[worker], want_out[worker], rtol=0, atol=0)
                    torch.testing.assert_close(got_grad[worker], want_grad[worker], rtol=0, atol=0)
        assert collective_grads.keys() == reference_grads.keys() == set(weights)
        for key, by_name in reference_grads.items():
            for name, grad in by_name.items():  # both masters' rows, summed in the workers in another order
                assert grad.abs().max() > 0, (key, name)
                torch.testing.assert_close(collective_grads[key][name], grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{key} {name}")
    finally:
        ray.kill(second)


@pytest.mark.timeout(180)
def test_master_transport_gives_each_master_process_the_configured_plane(two_workers, ray_pool, tmp_path):
    """`master_transport` (what master 0's pool and every MasterReplica call): the collective plane formed as
    master `master` of masters.count x cluster.master_tp, or Ray object refs."""
    from tests.fixtures import job_dict
    from vela_ray.config import JobConfig

    handles, tiers = two_workers.handles, two_workers.worker_tiers()

    def config(transport: str):
        return JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", masters={"count": 2},
                                            data_plane={"transport": transport}))

    collective_config = config("collective")
    assert MasterMesh.of(collective_config).size == 2
    planes = [ray_pool.track(master_transport(collective_config, handles, tiers, master=m)) for m in range(2)]
    assert all(isinstance(p, CollectiveTransport) for p in planes)
    assert _serving(handles, 0) == _serving(handles, 1) == [True] * WORKERS
    for plane in planes:
        assert len(plane.forward(_requests(1, None, seed=3))) == WORKERS
    planes[1].close()
    assert _serving(handles, 1) == [False] * WORKERS and _serving(handles, 0) == [True] * WORKERS
    planes[0].close()
    object_refs = master_transport(config("object_ref"), handles, tiers, master=1)
    assert isinstance(object_refs, RayObjectRefTransport) and object_refs.describe() == "object_ref"


@pytest.mark.timeout(900)
def test_two_data_parallel_masters_with_the_collective_plane_train_as_in_one_process(ray_session, tmp_path):
    """The job: masters.count 2 with data_plane.transport: collective trains as the same job in one process and as
    transformers + peft: equal losses, the same bytes to every worker and the same routed tokens. (Master 0's
    rows travel its collective plane; each other master's travel the plane `MasterReplica` builds with
    `master_transport`.) The reference runs in one process (what the brokers send each worker does not depend on
    the pool or plane); several masters over Ray object refs train as peft in tests/ray/test_multinode.py."""
    from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
    from vela_ray.api import VelaJob
    from vela_ray.config import JobConfig

    model_dir = make_checkpoint(tmp_path / "model", "mixtral")
    lora = {"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))}
    config, in_process = (JobConfig.from_dict(job_dict(model_dir, tmp_path / out, steps=3, lora=lora,
                                                       masters={"count": 2}, data_plane={"transport": "collective"}))
                          for out in ("collective", "in-process"))
    collective, one_process = VelaJob(config).run(), run_in_process(in_process)
    assert collective.data_plane == "collective (gloo)" and len(collective.master_nodes) == 2
    torch.testing.assert_close(torch.tensor(collective.losses), torch.tensor(one_process.losses), rtol=1e-5, atol=0)
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(collective.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert collective.traffic_bytes_by_worker == one_process.traffic_bytes_by_worker
    assert collective.tokens_routed == one_process.tokens_routed
