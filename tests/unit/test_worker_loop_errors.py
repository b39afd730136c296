"""Failures named, never hung (issue 33, items 4 and 5): the collective planes in one process, no Ray.

A worker that cannot allocate a request's buffer, whose error reply cannot allocate, or whose loop fails
outside the compute answers at once with an error naming itself and the layer; the master's own out of
memory is raised as itself, never blamed on a worker as a lost peer; and a result the host never saw
arrive (NCCL's case) is named by its deadline. The planes are gloo here: the protocol NCCL runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_collective_planes import JOIN_S, FakeServer, _request, form
from vela_ray.errors import ExpertWorkerError
from vela_ray.model import collective
from vela_ray.model.collective import PeerLostError, is_link_error
from vela_ray.model.transport import ForwardRequest

TIMEOUT_S = 10.0  # a test that waited for it would have hung on the old code: each answer must come well before
QUICK_S = 5.0


def _on_worker(worker: int) -> bool:
    return threading.current_thread().name == f"test-serve-{worker}"


def _check_in_step(planes, workers=(0, 1), seed: int = 5) -> None:
    requests = {w: _request(0, 4, seed=seed + w) for w in workers}
    outputs = planes.transport.forward(requests)
    for worker, req in requests.items():
        torch.testing.assert_close(outputs[worker], req.rows * (worker + 1) + req.expert_ids[:, None].float())


def _oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")


# -- the worker's side ----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_worker_that_cannot_allocate_the_rows_answers_at_once_naming_layer_and_mib(monkeypatch):
    """Worker 1 cannot allocate the receive buffer of a 13-row request: it answers out of step at once (the
    master's rows and result for it stay unmatched), the master names it, the layer and the memory, and
    refuses the data plane in one line from then on; the worker is no lost peer and its loop still serves."""
    empty = collective.DataPlane.empty

    def failing_empty(self, shape, dtype):
        if _on_worker(1) and shape[0] == 13:
            _oom()
        return empty(self, shape, dtype)

    monkeypatch.setattr(collective.DataPlane, "empty", failing_empty)
    planes = form([FakeServer(0), FakeServer(1)], timeout_s=TIMEOUT_S)
    try:
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError) as caught:
            wide = ForwardRequest(3, torch.zeros(13, dtype=torch.long), torch.randn(13, 20480))  # 1.0 MiB
            planes.transport.forward({0: _request(3, 5), 1: wide})
        assert time.monotonic() - start < QUICK_S
        message = str(caught.value)
        assert caught.value.worker == 1 and message.startswith("expert worker 1: layer 3: could not allocate")
        assert "[13, 20480] torch.float32 (1.0 MiB) on cpu" in message and "OutOfMemoryError" in message
        assert planes.transport._lost is None  # not a lost peer: nothing to replace
        refusal = r"data plane is out of step \(expert worker 1 posted nothing"
        with pytest.raises(RuntimeError, match=refusal) as refused:
            planes.transport.forward({0: _request(0, 2)})
        assert "\n" not in str(refused.value) and "layer 3" in str(refused.value)
        assert all(t.is_alive() for t in planes.threads)  # both loops serve on (the control plane is in step)
    finally:
        planes.close()  # the stop reaches both loops over the control plane: they end, joined


@pytest.mark.timeout(60)
def test_a_gradient_buffer_that_cannot_be_allocated_is_answered_too(monkeypatch):
    empty, calls = collective.DataPlane.empty, []

    def failing_empty(self, shape, dtype):  # the forward's rows come through; the backward's gradients do not
        if _on_worker(0) and shape[0] == 6:
            calls.append(shape)
            if len(calls) == 2:
                _oom()
        return empty(self, shape, dtype)

    monkeypatch.setattr(collective.DataPlane, "empty", failing_empty)
    planes = form([FakeServer(0)], timeout_s=TIMEOUT_S)
    try:
        assert planes.transport.forward({0: _request(2, 6, key="k")})[0].shape == (6, 8)
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError, match=r"expert worker 0: backward of key id 0: could not allocate the "
                                                    r"gradients' receive buffer \[6, 8\] torch.float32"):
            planes.transport.backward("k", {0: torch.ones(6, 8)})
        assert time.monotonic() - start < QUICK_S
        with pytest.raises(RuntimeError, match="out of step"):
            planes.transport.forward({0: _request(0, 2)})
    finally:
        planes.close()


@pytest.mark.timeout(60)
def test_a_compute_error_whose_reply_cannot_allocate_still_answers_in_step(monkeypatch):
    """Worker 1's compute runs out of memory, and so would any new tensor for its zeros: the reply zeroes
    the received rows in place, so it goes out at once and the data plane stays in step."""
    server = FakeServer(1)
    forward_rows = server.forward_rows

    def oom_on_layer_5(layer, expert_ids, rows, key=None):
        return _oom() if layer == 5 else forward_rows(layer, expert_ids, rows, key)

    server.forward_rows = oom_on_layer_5
    for name in ("zeros_like", "zeros", "empty_like"):  # what an error reply could have allocated with
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _f=original, **k: _oom() if _on_worker(1) else _f(*a, **k))
    planes = form([FakeServer(0), server], timeout_s=TIMEOUT_S)
    try:
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError, match=r"expert worker 1: OutOfMemoryError: CUDA out of memory") as caught:
            planes.transport.forward({0: _request(5, 3), 1: _request(5, 3)})
        assert caught.value.worker == 1 and time.monotonic() - start < QUICK_S
        _check_in_step(planes)  # answered with its zeros: the next results land where they belong
    finally:
        planes.close()


@pytest.mark.timeout(60)
def test_a_reply_whose_zeros_fail_too_answers_out_of_step(monkeypatch):
    """A CUDA error poisons even zeroing the buffer in place: the worker answers out of step, sending no
    result, and the master says so instead of waiting for zeros that never come."""
    zero_ = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda self: _oom() if _on_worker(1) else zero_(self))
    planes = form([FakeServer(0), FakeServer(1)], timeout_s=TIMEOUT_S)
    try:
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError, match=r"forward of experts") as caught:
            planes.transport.forward({0: _request(0, 2), 1: _request(7, 2)})  # layer 7: FakeServer fails
        assert "its zeros could not be sent either: OutOfMemoryError" in str(caught.value)
        assert time.monotonic() - start < QUICK_S and planes.transport._lost is None
        with pytest.raises(RuntimeError, match="out of step"):
            planes.transport.forward({0: _request(0, 2)})
    finally:
        planes.close()


@pytest.mark.timeout(60)
def test_a_non_link_error_in_the_loop_is_logged_and_answered_not_read_as_the_link_closing(monkeypatch, caplog):
    """A RuntimeError outside the compute (here: reading the expert ids, as a CUDA error would) used to end
    the loop as 'data plane closed', and the master waited out its timeout to replace a healthy worker."""
    expert_ids = collective._expert_ids

    def failing_ids(header):
        if _on_worker(1) and int(header[1]) == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return expert_ids(header)

    monkeypatch.setattr(collective, "_expert_ids", failing_ids)
    planes = form([FakeServer(0), FakeServer(1)], timeout_s=TIMEOUT_S)
    try:
        with caplog.at_level(logging.DEBUG, logger="vela_ray.model.collective"):
            start = time.monotonic()
            with pytest.raises(ExpertWorkerError, match=r"expert worker 1: layer 4: the serving loop failed") as caught:
                planes.transport.forward({0: _request(4, 2), 1: _request(4, 2)})
            assert time.monotonic() - start < QUICK_S
        assert "illegal memory access" in str(caught.value) and planes.transport._lost is None
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("expert worker 1: the serving loop failed on layer 4: RuntimeError: CUDA error")
                   for m in messages)
        assert not any("data plane closed" in m for m in messages)
        assert planes.threads[1].is_alive()
    finally:
        planes.close()  # a plain stop over the control plane, taken by the living loop


# -- the master's side ----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_the_masters_own_out_of_memory_is_raised_as_itself_never_as_a_lost_worker(monkeypatch):
    planes = form([FakeServer(0), FakeServer(1)], timeout_s=TIMEOUT_S)
    try:
        # allocating a result's buffer fails: before anything is posted, so the planes stay in step
        empty_like = torch.empty_like
        monkeypatch.setattr(torch, "empty_like",
                            lambda t, *a, **k: _oom() if t.shape[0] == 11 else empty_like(t, *a, **k))
        with pytest.raises(torch.OutOfMemoryError):
            planes.transport.forward({0: _request(0, 3), 1: _request(0, 11)})
        monkeypatch.setattr(torch, "empty_like", empty_like)
        _check_in_step(planes)

        # the master's own error once the layer was posted (a CUDA error in a wait): itself, then refused
        wait = planes.transport.data.wait
        monkeypatch.setattr(planes.transport.data, "wait", lambda work, block=False: _oom())
        with pytest.raises(torch.OutOfMemoryError):
            planes.transport.forward({0: _request(0, 2), 1: _request(0, 2)})
        monkeypatch.setattr(planes.transport.data, "wait", wait)
        assert planes.transport._lost is None
        with pytest.raises(RuntimeError, match=r"out of step \(the master failed mid-layer: OutOfMemoryError"):
            planes.transport.forward({0: _request(0, 2)})
    finally:
        planes.close()


def test_only_a_links_errors_read_as_a_lost_peer():
    def raising(err):
        def operation():
            raise err
        return operation

    closed = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:3761. This is typically caused by a remote worker crashing.")
    for err in (closed, RuntimeError("Application timeout caused pair closure"), dist.DistBackendError("NCCL error")):
        assert is_link_error(err)
        with pytest.raises(PeerLostError, match="expert worker 2"):
            collective._checked(2, raising(err))
    for err in (torch.OutOfMemoryError("CUDA out of memory (gloo/transport in the text is no link's)"),
                RuntimeError("CUDA error: an illegal memory access was encountered")):
        assert not is_link_error(err)
        with pytest.raises(type(err)) as caught:
            collective._checked(2, raising(err))
        assert caught.value is err


# -- results whose arrival the host has not seen (NCCL's case, on real gloo works) ------------------

def _pair() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    store = collective.make_store("127.0.0.1", 0, 2, is_master=True, timeout_s=JOIN_S)
    joined = {}

    def join() -> None:
        peer_store = collective.make_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=JOIN_S)
        joined["group"] = collective.make_group(peer_store, 1, 2, JOIN_S)

    thread = threading.Thread(target=join)
    thread.start()
    group = collective.make_group(store, 0, 2, JOIN_S)
    thread.join(JOIN_S)
    return group, joined["group"]


@dataclass
class _ArrivedWork:
    """An NCCL work whose transfer is done (gloo's works report completion only once waited for, so the
    arrived case cannot be a real gloo work): `wait` raises what it ended with, if anything."""

    error: Exception | None = None
    waited: int = 0

    def is_completed(self) -> bool:
        return True

    def wait(self, *_args) -> bool:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


@pytest.mark.timeout(60)
def test_a_result_past_its_deadline_names_its_worker_and_an_arrived_one_passes():
    master, peer = _pair()
    try:
        never_work = master.recv([torch.empty(3)], 1, 1)  # a real work nothing is ever sent for: a worker dead
        now = time.monotonic()                             # after its reply
        late = collective._InFlight(4, never_work, now + 0.5)
        arrived = collective._InFlight(0, _ArrivedWork(), now + JOIN_S)
        assert collective._unarrived([arrived, late], False, 0.5) == [late]  # not yet due: no waiting
        assert arrived.work.waited == 1  # its wait raises the error it ended with, if any
        with pytest.raises(PeerLostError, match=r"expert worker 4: .*did not arrive within 0.5 s of its reply"):
            collective._unarrived([late], True, 0.5)
        assert 0.5 <= time.monotonic() - now < QUICK_S
        aborted = collective._InFlight(2, _ArrivedWork(dist.DistBackendError("NCCL communicator was aborted")), now)
        with pytest.raises(PeerLostError, match="expert worker 2: .*NCCL communicator was aborted"):
            collective._unarrived([aborted], False, 0.5)  # what NCCL's watchdog leaves (async error handling 2)
    finally:
        master.abort()
        peer.abort()


@pytest.mark.timeout(60)
def test_settle_names_the_worker_whose_result_never_came_and_the_transport_is_lost():
    planes = form([FakeServer(0), FakeServer(1)], timeout_s=TIMEOUT_S)
    try:
        planes.transport.settle()  # gloo: every result was waited for on the host already
        _check_in_step(planes)
        never = planes.transport.data.recv(torch.empty(2), 2)  # worker 1 never sends it
        planes.transport._in_flight.append(collective._InFlight(1, never, time.monotonic() + 0.5))
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="expert worker 1") as caught:
            planes.transport.settle()
        assert caught.value.worker == 1 and time.monotonic() - start < QUICK_S
        with pytest.raises(RuntimeError, match="lost a worker"):
            planes.transport.forward({0: _request(0, 2)})
    finally:
        planes.transport.close()  # after a loss: both groups dropped, the loops end as their links close
        for thread in planes.threads:
            thread.join(JOIN_S)


# -- NCCL ------------------------------------------------------------------------------------------

def test_nccl_groups_are_made_with_a_watchdog_that_raises_not_one_that_ends_the_process(monkeypatch):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING is read as the group is made: 2 (abort the communicators, fail the
    work) unless the user chose otherwise; torch's default, 3, ends the process on a timeout."""
    seen = []

    class _FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, world_size, options):
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    collective.make_nccl_group(None, 0, 2, 10.0)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    collective.make_nccl_group(None, 0, 2, 10.0)
    assert seen == ["2", "1"]


@dataclass
class _CudaServer(FakeServer):
    """FakeServer's forward, its expert ids brought to the rows' GPU."""

    def forward_rows(self, layer, expert_ids, rows, key=None):
        return super().forward_rows(layer, expert_ids.to(rows.device), rows, key)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
@pytest.mark.timeout(300)
def test_a_result_that_never_comes_over_nccl_is_named_by_settle_not_hung(monkeypatch):
    """The worker replies, then its result's send never happens (as if it died right after its reply): the
    master's forward returns (its wait only ordered the stream), and the backward that ends the micro-batch
    settles: `PeerLostError` naming the worker within the timeout, and the process lives on."""
    send = collective.DataPlane.send

    class _Never:
        def wait(self, *_args):
            return True

    monkeypatch.setattr(collective.DataPlane, "send", lambda self, tensor, peer: _Never() if (
        _on_worker(0) and tensor.shape[0] == 11) else send(self, tensor, peer))
    planes = form([_CudaServer(0, device=torch.device("cuda", 1))], timeout_s=5.0, device="cuda:0",
                  backend="nccl", cuda_indices={0: 1})
    try:
        assert planes.transport.data.backend == "nccl"
        ok = _request(0, 3, key="a")
        out = planes.transport.forward({0: ForwardRequest(0, ok.expert_ids, ok.rows.cuda(0), "a")})[0]
        torch.testing.assert_close(out.cpu(), ok.rows + ok.expert_ids[:, None].float())
        planes.transport.backward("a", {0: torch.ones(3, 8, device="cuda:0")})  # settles: all arrived
        lost = _request(0, 11)
        planes.transport.forward({0: ForwardRequest(0, lost.expert_ids, lost.rows.cuda(0), None)})
        start = time.monotonic()
        with pytest.raises(PeerLostError, match=r"expert worker 0: .*did not arrive within 5 s"):
            planes.transport.settle()
        assert time.monotonic() - start < 15
    finally:
        planes.transport.close()  # lost: both groups aborted (NCCL's pending receive ends)
        for thread in planes.threads:
            thread.join(JOIN_S)
