"""The collective transport's two planes, in one process: worker serving loops on threads, no Ray.

Control plane (gloo, tags) and data plane (one tag, posting order only: the protocol NCCL runs) are
formed as `actors.transports.collective_transport` forms them; on the CPU the data plane is gloo.
The GPU test at the end runs the data plane over real NCCL (two GPUs).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Hashable

import pytest
import torch

from vela_ray.errors import ExpertWorkerError
from vela_ray.model import collective
from vela_ray.model.collective import CollectiveTransport, PeerLostError, data_backend, form_data_plane
from vela_ray.model.traffic import LinkTier
from vela_ray.model.transport import ForwardRequest

JOIN_S = 30.0


@dataclass
class FakeServer:
    """A RowServer: forward scales rows by (worker + 1), backward doubles; layer 7 fails, layer 9 hangs."""

    worker: int
    device: torch.device = torch.device("cpu")
    hang_s: float = 5.0
    saved: set = field(default_factory=set)

    def forward_rows(self, layer: int, expert_ids: torch.Tensor, rows: torch.Tensor,
                     key: Hashable | None = None) -> torch.Tensor:
        if layer == 7:
            raise ExpertWorkerError(self.worker, f"forward of experts {expert_ids.tolist()} failed")
        if layer == 9:
            time.sleep(self.hang_s)
        if key is not None:
            self.saved.add(key)
        return rows * (self.worker + 1) + expert_ids[:, None].to(rows.dtype)

    def backward_rows(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        self.saved.remove(key)
        return 2 * grad


@dataclass
class Planes:
    transport: CollectiveTransport
    threads: list[threading.Thread]

    def close(self) -> None:
        self.transport.close()
        for thread in self.threads:
            thread.join(JOIN_S)
        assert not any(t.is_alive() for t in self.threads), "a serving loop outlived the transport"


def _serve_on_thread(server, port: int, world_size: int, cuda_index: int | None = None) -> threading.Thread:
    def run() -> None:
        if cuda_index is not None:
            torch.cuda.set_device(cuda_index)
        store = collective.make_store("127.0.0.1", port, world_size, is_master=False, timeout_s=JOIN_S)
        collective.serve(collective.make_group(store, server.worker + 1, world_size, JOIN_S), server)

    thread = threading.Thread(target=run, daemon=True, name=f"test-serve-{server.worker}")
    thread.start()
    return thread


def form(servers, timeout_s: float = JOIN_S, device="cpu", backend=None, cuda_indices=None) -> Planes:
    """The master's planes (this thread, rank 0) with `servers` serving on threads."""
    world_size = len(servers) + 1
    store = collective.make_store("127.0.0.1", 0, world_size, is_master=True, timeout_s=JOIN_S)
    threads = [_serve_on_thread(s, store.port, world_size, (cuda_indices or {}).get(s.worker)) for s in servers]
    group = collective.make_group(store, 0, world_size, JOIN_S)
    data = form_data_plane(group, store, len(servers), device, backend, timeout_s, JOIN_S)
    tiers: list[LinkTier] = ["same_node"] * len(servers)
    return Planes(CollectiveTransport(group, data, tiers, timeout_s), threads)


def _request(layer: int, rows: int, key=None, seed: int = 0) -> ForwardRequest:
    g = torch.Generator().manual_seed(seed)
    return ForwardRequest(layer, torch.randint(0, 4, (rows,), generator=g), torch.randn(rows, 8, generator=g), key)


# -- the backend choice ---------------------------------------------------------------------------

@pytest.mark.parametrize("devices, nccl, expected", [
    (["cpu", "cpu", "cpu"], True, "gloo"),
    (["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"], True, "nccl"),
    (["cuda:GPU-a", "cpu", "cuda:GPU-c"], True, "gloo"),  # one rank on the CPU
    (["cuda:GPU-a", "cuda:GPU-b"], False, "gloo"),  # a torch without NCCL
    (["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-a"], True, "gloo"),  # two ranks on one GPU: NCCL refuses
], ids=["cpu", "own-gpus", "mixed", "no-nccl", "shared-gpu"])
def test_nccl_only_when_every_rank_has_a_gpu_of_its_own(devices, nccl, expected):
    assert data_backend(devices, nccl_available=nccl) == expected


def test_two_ranks_on_one_gpu_say_why_in_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="vela_ray.model.collective"):
        assert data_backend(["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-a"], nccl_available=True) == "gloo"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ranks [0, 2] share a GPU" in lines[0] and "NCCL refuses" in lines[0]


def test_a_cpu_rank_is_described_as_cpu():
    assert collective.device_descriptor("cpu") == "cpu"


# -- the protocol over two gloo planes -------------------------------------------------------------

def test_rows_travel_on_their_own_plane_and_come_back_in_the_requests_shape_and_dtype():
    planes = form([FakeServer(0), FakeServer(1)])
    try:
        assert planes.transport.data.backend == "gloo" and planes.transport.data.group is not planes.transport.group
        requests = {0: _request(0, 5, key="k", seed=1), 1: _request(0, 3, key="k", seed=2)}
        outputs = planes.transport.forward(requests)
        for worker, req in requests.items():
            expected = req.rows * (worker + 1) + req.expert_ids[:, None].float()
            torch.testing.assert_close(outputs[worker], expected)
        grads = planes.transport.backward("k", {w: torch.ones_like(r.rows) for w, r in requests.items()})
        assert all(torch.equal(g, 2 * torch.ones_like(requests[w].rows)) for w, g in grads.items())
        packed = {0: ForwardRequest(0, torch.zeros(2, dtype=torch.long), torch.ones(2, 12, dtype=torch.uint8))}
        assert planes.transport.forward(packed)[0].dtype == torch.uint8  # float8 wire rows: uint8 both ways
    finally:
        planes.close()


class CountingServer(FakeServer):
    """FakeServer that counts the calls it serves: a ping must reach none."""

    calls: int = 0

    def forward_rows(self, *args, **kwargs):
        self.calls += 1
        return super().forward_rows(*args, **kwargs)


def test_a_ping_goes_over_the_data_plane_and_the_link_probe_fits_it():
    """The placement's link probe over the collective plane: the payload's bytes are counted, the experts compute
    nothing, and rows still travel after it (the plane stays in step, its first row came back)."""
    from actors.placement_service import PlacementService, collective_ping

    servers = [CountingServer(0), CountingServer(1)]
    planes = form(servers)
    try:
        payload = torch.arange(12.0).reshape(3, 4)
        assert planes.transport.ping({0: payload, 1: payload}) == 2 * payload.numel() * 4
        links = PlacementService(collective_ping(planes.transport)).probe([0, 1], sizes=(16 << 10, 256 << 10))
        assert len(links) == 2 and all(link.bandwidth_bytes_per_s > 0 and link.latency_s > 0 for link in links)
        nics = PlacementService(collective_ping(planes.transport)).probe_shared({"nic": [0, 1]}, sizes=(16 << 10,
                                                                                                     256 << 10))
        assert nics["nic"] > 0
        assert [s.calls for s in servers] == [0, 0]
        request = _request(0, 4)
        torch.testing.assert_close(planes.transport.forward({1: request})[1],
                                   request.rows * 2 + request.expert_ids[:, None].float())
    finally:
        planes.close()


def test_expert_ids_ride_in_the_header_as_runs_and_follow_on_their_own_past_max_runs():
    """A broker's request (rows grouped by expert) costs one control message; ids with more runs than the
    header holds follow on TAG_IDS. Either way the worker sees the exact ids, and the streams stay in step."""
    grouped = torch.tensor([0, 0, 0, 3, 3, 5, 7, 7])
    widest = torch.arange(collective.MAX_RUNS).repeat_interleave(2)  # exactly MAX_RUNS runs
    too_many = torch.arange(collective.MAX_RUNS + 1) % 2  # alternating: MAX_RUNS + 1 runs
    for ids in (grouped, widest):
        header = collective._header(collective.OP_FORWARD, 0, 0, len(ids), 4, 0, ids)
        assert torch.equal(collective._expert_ids(header), ids)
    assert collective._expert_ids(collective._header(collective.OP_FORWARD, 0, 0, 65, 4, 0, too_many)) is None

    planes = form([FakeServer(0), FakeServer(1)])
    try:
        def request(ids: torch.Tensor) -> ForwardRequest:
            return ForwardRequest(0, ids, torch.randn(len(ids), 4))

        assert len(planes.transport._forward_message(0, request(grouped)).control) == 1
        assert len(planes.transport._forward_message(0, request(too_many)).control) == 2
        for first, second in ((grouped, too_many), (too_many, widest), (widest, grouped)):
            requests = {0: request(first), 1: request(second)}
            outputs = planes.transport.forward(requests)
            for worker, req in requests.items():
                torch.testing.assert_close(outputs[worker], req.rows * (worker + 1) + req.expert_ids[:, None].float())
    finally:
        planes.close()


def test_an_error_still_sends_its_zeros_so_the_data_plane_stays_in_step():
    """Worker 1 fails while worker 0 succeeds; had worker 1 sent no result, its next (good) result would
    land in the receive posted for the failed one and the answers would be off by one."""
    planes = form([FakeServer(0), FakeServer(1)])
    try:
        with pytest.raises(ExpertWorkerError, match=r"expert worker 1: forward of experts") as caught:
            planes.transport.forward({0: _request(0, 2), 1: _request(7, 2)})
        assert caught.value.worker == 1
        for seed in range(3):
            good = {w: _request(0, 4, seed=seed) for w in (0, 1)}
            outputs = planes.transport.forward(good)
            for worker, req in good.items():
                torch.testing.assert_close(outputs[worker], req.rows * (worker + 1) + req.expert_ids[:, None].float())
    finally:
        planes.close()


def test_a_request_that_cannot_be_sent_posts_nothing_and_the_transport_survives():
    planes = form([FakeServer(0), FakeServer(1)])
    try:
        bad = ForwardRequest(0, torch.zeros(1, dtype=torch.long), torch.ones(1, 8, dtype=torch.int32))
        with pytest.raises(ValueError):  # int32 rows are no wire dtype: refused before anything is posted
            planes.transport.forward({0: _request(0, 2), 1: bad})
        assert planes.transport.forward({0: _request(0, 2)})[0].shape == (2, 8)
    finally:
        planes.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hung_worker_is_named_lost_after_the_timeout_never_a_hang():
    planes = form([FakeServer(0), FakeServer(1, hang_s=8.0)], timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="expert worker 1") as caught:
        planes.transport.forward({0: _request(0, 2), 1: _request(9, 2)})
    assert caught.value.worker == 1 and time.monotonic() - start < 6.0
    planes.close()  # worker 0 is told to stop; both planes are dropped: the hung loop ends when it answers
    with pytest.raises(RuntimeError, match="closed or lost a worker"):
        planes.transport.forward({0: _request(0, 2)})


def test_nccl_asked_for_on_cpu_ranks_is_refused_in_one_line():
    world_size = 2
    store = collective.make_store("127.0.0.1", 0, world_size, is_master=True, timeout_s=JOIN_S)
    thread = _serve_on_thread(FakeServer(0), store.port, world_size)
    group = collective.make_group(store, 0, world_size, JOIN_S)
    with pytest.raises(ValueError, match=r"data_backend='nccl' needs every rank on a CUDA device of its own"):
        form_data_plane(group, store, 1, "cpu", "nccl", JOIN_S, JOIN_S)
    group.abort()  # what collective_transport does: the worker's loop ends
    thread.join(JOIN_S)
    assert not thread.is_alive()


# -- NCCL ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
@pytest.mark.timeout(300)
def test_rows_over_nccl_equal_rows_over_gloo():
    """A master on cuda:0 and one ExpertManager on cuda:1 (a serving thread of this process): forward and
    backward over an NCCL data plane equal the same over gloo, and the master's results stay on its GPU.
    It cannot run on a one-GPU machine: NCCL refuses two ranks on one GPU."""
    from tests.ray.helpers import NUM_WORKERS, specs_for, split_weights, synthetic_placement, synthetic_weights
    from vela_ray.training.expert_manager import ExpertManager

    spec = specs_for(split_weights(synthetic_weights(), synthetic_placement(), NUM_WORKERS))[0]
    with torch.cuda.device(1):
        manager = ExpertManager(spec.model_copy(update={"worker": 0, "device": "cuda"}))
    experts = [e for (layer, e) in spec.keys if layer == 1]
    ids = torch.tensor(experts).repeat_interleave(3)
    rows = torch.randn(len(ids), 16, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for backend in ("gloo", "nccl"):
        planes = form([manager], device="cuda:0", backend=backend, cuda_indices={0: 1})
        try:
            assert planes.transport.data.backend == backend
            out = planes.transport.forward({0: ForwardRequest(1, ids, rows.to("cuda:0"), key=backend)})[0]
            row_grad = planes.transport.backward(backend, {0: grad.to("cuda:0")})[0]
            if backend == "nccl":
                assert out.device == torch.device("cuda", 0) and row_grad.device == torch.device("cuda", 0)
            results[backend] = (out.cpu(), row_grad.cpu())
        finally:
            planes.close()
    for got, want in zip(results["nccl"], results["gloo"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
