"""CollectiveTransport: rows over torch.distributed point-to-point, one serving loop per worker.

The master is rank 0 of a process group it forms once with the ExpertManagers (worker n is
rank n + 1; forming it through Ray is `actors.transports.collective_transport`). After that a
MoE layer costs no Ray task: the master posts, for every worker of the layer at once, a
header, the rows' expert ids and the rows, and each worker's serving loop (`serve`, a thread
in the ExpertManager) receives them, computes, and sends back a reply header and the result.
Messages (tags keep the streams apart):

    master -> worker   header int64 [op, layer, key id, rows R, width D, dtype]   TAG_HEADER
                       forward: expert ids int64 [R], rows [R, D]; backward: d(outputs) [R, D]
    worker -> master   reply int64 [status, message length]                       TAG_REPLY
                       result [R, D] in the request's dtype (zeros on error)      TAG_RESULT
                       status ERROR: the message, uint8 [length]                  TAG_ERROR

The result has the request's shape and dtype, so the master posts every receive of a layer
at once, before any worker has answered.

Keys of the saved graphs (any hashable on the master) travel as small integers the master
assigns. A worker's exception is sent back as text and raised on the master as the
`ExpertWorkerError` naming the worker, and the loop goes on serving. A dead worker closes its
TCP connection, so the master's wait fails at once with `PeerLostError`; a hung one fails
after `timeout_s`. Gloo moves CPU tensors; results come back on the CPU.
"""

from __future__ import annotations

import datetime
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Hashable, Protocol

import torch
import torch.distributed as dist

from vela_ray.errors import ExpertWorkerError
from vela_ray.model.traffic import LinkTier
from vela_ray.model.transport import ForwardRequest

logger = logging.getLogger(__name__)

OP_STOP, OP_FORWARD, OP_BACKWARD = 0, 1, 2
STATUS_OK, STATUS_ERROR = 0, 1
TAG_HEADER, TAG_IDS, TAG_ROWS, TAG_REPLY, TAG_RESULT, TAG_ERROR = range(6)
NO_KEY = -1
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8]  # uint8: float8 rows (model.wire)
SERVE_TIMEOUT_S = 7 * 24 * 3600.0  # a worker waits this long for its next message (idle is normal)


class PeerLostError(RuntimeError):
    """A worker's link broke (its process died) or it did not answer within the timeout."""

    def __init__(self, worker: int, cause: str):
        super().__init__(f"expert worker {worker}: the collective data plane lost it ({cause})")
        self.worker, self.cause = worker, cause

    def __reduce__(self):
        return (type(self), (self.worker, self.cause))


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store; the master listens (port 0: any free port, read back from `.port`)."""
    return dist.TCPStore(host, port, world_size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def make_group(store: dist.Store, rank: int, world_size: int, timeout_s: float,
               address: str = "127.0.0.1") -> dist.ProcessGroup:
    """A gloo group of its own (not torch's default group): blocks until every rank has joined.

    `address` is this process's own address as the others reach it (its Ray node's IP): gloo's
    default resolves the hostname, which is the loopback on many machines and containers, and
    peers on other nodes would dial their own loopback."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _header(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class RowServer(Protocol):
    """What a worker's serving loop calls: an ExpertManager's data plane."""

    worker: int

    def _forward(self, request: ForwardRequest) -> torch.Tensor: ...

    def _backward(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor: ...


def serve(group: dist.ProcessGroup, server: RowServer) -> None:
    """Answer the master (rank 0) until it says stop or its link closes: the worker's serving loop."""
    try:
        while _serve_one(group, server):
            pass
    except RuntimeError as err:  # the link to the master closed: it is gone or dropped the group
        logger.warning("expert worker %d: data plane closed (%s)", server.worker, str(err).splitlines()[0])


def _serve_one(group: dist.ProcessGroup, server: RowServer) -> bool:
    """Receive one request and answer it; False on the master's stop."""
    timeout = datetime.timedelta(seconds=SERVE_TIMEOUT_S)
    header = torch.empty(6, dtype=torch.int64)
    group.recv([header], 0, TAG_HEADER).wait(timeout)
    op, layer, key_id, num_rows, width, dtype = header.tolist()
    if op == OP_STOP:
        return False
    shape, dtype = (num_rows, width), DTYPES[dtype]
    if op == OP_FORWARD:
        ids = torch.empty(num_rows, dtype=torch.int64)
        rows = torch.empty(shape, dtype=dtype)
        _recv_all(group, [(ids, TAG_IDS), (rows, TAG_ROWS)], timeout)
        key = None if key_id == NO_KEY else key_id
        _reply(group, lambda: server._forward(ForwardRequest(layer, ids, rows, key)), rows)
    else:
        grad = torch.empty(shape, dtype=dtype)
        _recv_all(group, [(grad, TAG_ROWS)], timeout)
        _reply(group, lambda: server._backward(key_id, grad), grad)
    return True


def _recv_all(group: dist.ProcessGroup, parts: list[tuple[torch.Tensor, int]], timeout) -> None:
    for work in [group.recv([tensor], 0, tag) for tensor, tag in parts]:
        work.wait(timeout)


def _reply(group: dist.ProcessGroup, compute, like: torch.Tensor) -> None:
    """Send the result in `like`'s shape and dtype, or zeros and the error's text (the loop survives a
    bad request)."""
    try:
        result = compute().detach().to("cpu", like.dtype).contiguous()
        if result.shape != like.shape:
            raise RuntimeError(f"result has shape {tuple(result.shape)}, the request {tuple(like.shape)}")
        message = None
    except Exception as exc:  # sent to the master, raised there as ExpertWorkerError, traceback included
        text = exc.message if isinstance(exc, ExpertWorkerError) else f"{type(exc).__name__}: {exc}"
        text += "\n" + "".join(traceback.format_exception(exc.__cause__ or exc))
        result, message = torch.zeros_like(like), torch.tensor(list(text.encode()), dtype=torch.uint8)
    status = STATUS_OK if message is None else STATUS_ERROR
    group.send([_header(status, 0 if message is None else len(message))], 0, TAG_REPLY).wait()
    group.send([result], 0, TAG_RESULT).wait()
    if message is not None:
        group.send([message], 0, TAG_ERROR).wait()


@dataclass
class _Pending:
    """One worker's outstanding answer: its reply header and its result, both receives posted."""

    worker: int
    reply: torch.Tensor
    result: torch.Tensor
    works: list


class CollectiveTransport:
    """The master's side (rank 0): `Transport` over a formed group whose rank n + 1 is worker n."""

    def __init__(self, group: dist.ProcessGroup, worker_tiers: list[LinkTier], timeout_s: float = 300.0,
                 on_close=None):
        """`timeout_s`: how long the master waits for one layer's answer before naming the worker lost.
        `on_close`: called after the workers were told to stop (e.g. to join their serving loops)."""
        self.group = group
        self.tiers = list(worker_tiers)
        self.num_workers = len(self.tiers)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._on_close = on_close
        self._keys: dict[Hashable, int] = {}
        self._next_key = 0
        self._closed = False
        self._broken = False  # a peer was lost: the group's message streams are out of step

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        results = {w: r.rows.new_zeros(r.rows.shape) for w, r in requests.items() if r.rows.shape[0] == 0}
        sends = []
        for worker, req in requests.items():
            if worker in results:
                continue
            key_id = NO_KEY if req.key is None else self._key_id(req.key)
            rows = req.rows.cpu().contiguous()  # gloo moves host tensors
            header = _header(OP_FORWARD, req.layer, key_id, rows.shape[0], rows.shape[1], DTYPES.index(rows.dtype))
            sends.append((worker, rows, [self._send(header, worker, TAG_HEADER),
                                         self._send(req.expert_ids.to("cpu", torch.int64).contiguous(), worker,
                                                    TAG_IDS),
                                         self._send(rows, worker, TAG_ROWS)]))
        results.update(self._gather(sends))
        return results

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        key_id = self._keys.pop(key, None)
        if key_id is None and not grads:  # the forward sent no rows anywhere: nothing was saved
            return {}
        if key_id is None:
            raise ExpertWorkerError(min(grads), f"backward of key {key!r}: no forward was saved under it "
                                                "(backward called twice or without forward)")
        sends = []
        for worker, grad in grads.items():
            grad = grad.cpu().contiguous()
            header = _header(OP_BACKWARD, 0, key_id, grad.shape[0], grad.shape[1], DTYPES.index(grad.dtype))
            sends.append((worker, grad, [self._send(header, worker, TAG_HEADER), self._send(grad, worker, TAG_ROWS)]))
        return self._gather(sends)

    def worker_tiers(self) -> list[LinkTier]:
        return self.tiers

    def close(self) -> None:
        """Tell every worker's loop to stop and wait for them; idempotent. After a lost peer the
        others may be blocked mid-reply, so the group is dropped instead: its closed sockets end
        their loops."""
        if self._closed:
            return
        if self._broken:
            group, self._closed, self.group = self.group, True, None
            group.abort()  # closes its sockets: the others' loops end
            return
        for worker in range(self.num_workers):
            try:
                self._send(_header(OP_STOP, 0, 0, 0, 0, 0), worker, TAG_HEADER).wait(self.timeout)
            except (RuntimeError, PeerLostError):
                pass
        self._closed = True
        if self._on_close is not None:
            self._on_close()

    # -- internals ---------------------------------------------------------------------------

    def _key_id(self, key: Hashable) -> int:
        if key not in self._keys:
            self._keys[key] = self._next_key
            self._next_key += 1
        return self._keys[key]

    def _send(self, tensor: torch.Tensor, worker: int, tag: int):
        return self._link(worker, lambda: self.group.send([tensor], worker + 1, tag))

    def _recv(self, tensor: torch.Tensor, worker: int, tag: int):
        return self._link(worker, lambda: self.group.recv([tensor], worker + 1, tag))

    def _wait(self, worker: int, work) -> None:
        self._link(worker, lambda: work.wait(self.timeout))

    def _link(self, worker: int, operation):
        """Run one point-to-point operation with `worker`; a broken link or a timeout is its loss."""
        if self._closed or self._broken:
            raise RuntimeError("CollectiveTransport is closed or lost a worker; form a new group to send rows")
        try:
            return operation()
        except RuntimeError as err:
            self._broken = True
            raise PeerLostError(worker, str(err).splitlines()[0]) from None

    def _gather(self, sends: list[tuple[int, torch.Tensor, list]]) -> dict[int, torch.Tensor]:
        """Post every worker's receives at once (header and result), then wait for sends and answers."""
        pending = []
        for worker, like, _ in sends:
            reply, result = torch.empty(2, dtype=torch.int64), torch.empty_like(like)
            pending.append(_Pending(worker, reply, result, [self._recv(reply, worker, TAG_REPLY),
                                                             self._recv(result, worker, TAG_RESULT)]))
        for worker, _, works in sends:
            for work in works:
                self._wait(worker, work)
        errors = []
        for p in pending:
            for work in p.works:
                self._wait(p.worker, work)
            status, length = p.reply.tolist()
            if status == STATUS_ERROR:
                message = torch.empty(length, dtype=torch.uint8)
                self._wait(p.worker, self._recv(message, p.worker, TAG_ERROR))
                errors.append(ExpertWorkerError(p.worker, bytes(message.tolist()).decode(errors="replace")))
        if errors:
            raise errors[0]
        return {p.worker: p.result for p in pending}
