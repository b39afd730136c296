"""CollectiveTransport: rows over torch.distributed point-to-point, one serving loop per worker.

The master is rank 0 of two groups it forms once with the ExpertManagers (worker n is rank
n + 1; forming them through Ray is `actors.transports.collective_transport`). After that a MoE
layer costs no Ray task: the master posts, for every worker of the layer at once, a header, the
rows' expert ids and the rows, and each worker's serving loop (`serve`, a thread in the
ExpertManager) receives them, computes, and sends back a reply and the result.

Two planes. The control plane is a gloo group of small CPU tensors told apart by tags; a dead
peer closes its TCP connection, so a wait on it fails at once (`PeerLostError`), a hung one after
`timeout_s`. Only a link's errors (`is_link_error`: torch.distributed's `DistError` family, gloo's
transport errors) read as a lost peer, on either side: the master's own out of memory or CUDA error
is raised as itself, and a worker's is answered (below), never taken for its link closing. The
data plane is a second group that carries only the [R, D] payloads, on each rank's device: NCCL
when every rank has a CUDA device of its own (`data_backend`; NCCL refuses two ranks on one GPU),
gloo otherwise. NCCL ignores tags, so the data plane uses one tag and relies on posting order
alone: for each worker both sides post its sends and receives in the same order, whatever the
outcome (a failed request still sends its zeros; one that cannot, below, drops the plane). The CPU
tests, on a gloo data plane, run the very protocol NCCL runs.

    control plane (gloo, CPU tensors, tags)
    master -> worker   header int64 [op, layer, key id, rows R, width D, dtype,     TAG_HEADER
                                     runs n, (expert, count) x MAX_RUNS]
                       forward with n = -1: expert ids int64 [R]                   TAG_IDS
                       OP_DATA_PLANE: JSON text uint8 [R]                          TAG_TEXT
    worker -> master   reply int64 [status, text length]                          TAG_REPLY
                       status ERROR / OUT_OF_STEP: the error; setup: the answer;   TAG_TEXT
                       uint8 [length]
    data plane (nccl or gloo, tensors on the rank's device, TAG_DATA, posting order)
    master -> worker   forward: rows [R, D]; backward: d(outputs) [R, D]; OP_PING: any [R, D]
    worker -> master   result [R, D] in the request's dtype (zeros on error; none when OUT_OF_STEP;
                       OP_PING: the payload's first row [1, D], for the link probes, `CollectiveTransport.ping`)

A forward's expert ids ride in its header as (expert, count) runs: the broker groups a worker's
rows by expert, so a layer's request has one run per expert it reaches, and the ids cost no message
of their own (a message whose receive the worker can only post after the header, as for the rows).
Past MAX_RUNS runs they follow on TAG_IDS.

The result has the request's shape and dtype, so the master allocates every buffer of a layer
first (an allocation that fails posts nothing) and posts every receive at once, before any worker
has answered. It waits for a worker's reply on the control plane before it waits for that
worker's payload send and result: the reply proves the worker alive and past its compute (on a
GPU: launched), and it posts the result's send right after. With NCCL a data-plane wait does
not block the host (it orders the current CUDA stream after the transfer), so time is bounded by
the control plane, and the results whose arrival the host has not seen are kept with a deadline
(`timeout_s` after the reply): each layer checks them without waiting, and `settle` polls them
(`backward` calls it once no saved forward is left, the end of a micro-batch, before the host reads
its loss; a forward-only caller may call it before reading its own), so a worker that dies between
its reply and its result is named `PeerLostError`, not a CUDA synchronization blocked forever.
Behind that, NCCL's watchdog (twice `timeout_s`) runs with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 unless
set otherwise: it aborts the communicators and fails the work instead of ending the process.
After a lost peer `close` tells the other workers to stop and drops both groups (NCCL's are
aborted; gloo's sockets close as the group goes).

Failures that are no link's. A worker's compute error is answered ERROR with its zeros: the
request's own payload buffer zeroed in place, so the reply allocates nothing. If a worker cannot
allocate a request's receive buffer (after emptying CUDA's cache once), it cannot take the payload
the master already posted, so it answers OUT_OF_STEP, posting nothing on the data plane, with a
text naming the layer, the buffer's shape, dtype, MiB and device; as it does when zeroing fails
(a CUDA error) or the loop fails outside the compute (logged with its cause, then answered). The
master raises the `ExpertWorkerError` naming the worker, aborts the data plane (its send and
receive for that worker stay unmatched) and refuses it from then on in one line; the control plane
still reaches every worker, so `close` stops their loops as usual. The job stops on that error, or
a new transport forms new planes. A failure of the master's own once a layer's posting began does
the same, raised as itself.

Setup, once, on the control plane (`form_data_plane`): OP_DESCRIBE asks each worker for its
device (`device_descriptor`), the master picks the backend, OP_DATA_PLANE sends the rendezvous
(store address, backend, timeout); every rank forms the data group and echoes one tensor over
it, so NCCL's communicators exist before the first layer.

Keys of the saved graphs (any hashable on the master) travel as small integers the master
assigns; the worker's loop hands them to the server as `PlaneKey(master, key id)`. A worker's
exception is sent back as text and raised on the master as the `ExpertWorkerError` naming the
worker, and the loop goes on serving. Results come back on the
master's data-plane device: its GPU with NCCL (hidden states never cross to the host), the CPU
with gloo.

Several masters (data-parallel masters, tensor-parallel ranks: every master process sends rows to
the same ExpertManagers). Each master process forms planes of its own, both groups on its own
rendezvous store, so an ExpertManager runs one serving loop per master process, each a thread
(`serve(..., master=m, shared=True)`), and everything above holds per plane: a dead worker is named
by each master whose plane it was on, OUT_OF_STEP drops only that master's data plane, and a
master's `close` stops only its own loops. With NCCL each master's data group holds that master's
GPU and each worker's, so no group has two ranks on one GPU. The loops call the same server; the
server runs one call at a time (ExpertManager: a lock, and on a GPU each call's kernels queued after
the previous call's, whichever stream), so the LoRA gradients of several masters' rows add up in
the worker as they do through Ray's calls. A shared loop over NCCL runs on a CUDA stream of its own
and waits on the host until a request's rows have arrived before the server computes: a compute
queued behind a wait on one master's transfer could otherwise hold up another master's layer,
whose results that master needs before it sends the transfer (a cycle across the workers'
devices). Forming is safe in any order: an ExpertManager joins a master's control group on a thread
of its own, so two masters forming their planes at once never wait for each other's workers.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Hashable, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist

from vela_ray.errors import ExpertWorkerError, first_line
from vela_ray.model.traffic import LinkTier
from vela_ray.model.transport import ForwardRequest

logger = logging.getLogger(__name__)

OP_STOP, OP_FORWARD, OP_BACKWARD, OP_DESCRIBE, OP_DATA_PLANE, OP_PING, OP_BASE_FORWARD = range(7)
STATUS_OK, STATUS_ERROR, STATUS_OUT_OF_STEP = 0, 1, 2  # out of step: the worker posted nothing on the data plane
TAG_HEADER, TAG_IDS, TAG_REPLY, TAG_TEXT = range(4)  # control plane
HEADER_FIELDS = 7  # op, layer, key id, rows, width, dtype, runs (-1: the ids follow on TAG_IDS)
MAX_RUNS = 64  # (expert, count) runs a header holds: a worker's experts in one layer, usually far fewer
HEADER_LEN = HEADER_FIELDS + 2 * MAX_RUNS
IDS_FOLLOW = -1
TAG_DATA = 0  # data plane: the only tag (NCCL ignores tags; messages match in posting order)
NO_KEY = -1
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8]  # uint8: float8 rows (model.wire)
SERVE_TIMEOUT_S = 7 * 24 * 3600.0  # a worker waits this long for its next message (idle is normal)
DATA_PREFIX = "vela-data-plane/"  # the data group's keys in the rendezvous store
NCCL_TIMEOUT_FACTOR = 2  # NCCL's watchdog: a backstop behind the control plane's timeout
STOP_AFTER_LOSS_S = 5.0  # after a lost worker, how long close() waits for each other worker to take its stop
SETTLE_POLL_S = 0.0005  # how often `settle` polls the NCCL results still in flight
# what gloo's errors say when the link itself failed (gloo raises plain RuntimeErrors: torch 2.13 wraps only
# the store's and NCCL's errors in the DistError family)
GLOO_LINK_MARKERS = ("gloo/transport", "Connection closed by peer", "pair closure", "Timed out waiting",
                     "Connection reset by peer", "Broken pipe")

Backend = Literal["nccl", "gloo"]


class PeerLostError(RuntimeError):
    """A worker's link broke (its process died) or it did not answer within the timeout."""

    def __init__(self, worker: int, cause: str):
        super().__init__(f"expert worker {worker}: the collective data plane lost it ({cause})")
        self.worker, self.cause = worker, cause

    def __reduce__(self):
        return (type(self), (self.worker, self.cause))


def is_link_error(err: BaseException) -> bool:
    """Whether `err` says the link to a peer failed (closed, reset, timed out, aborted): torch.distributed's
    `DistError` family (NCCL, the store, the network) or one of gloo's plain RuntimeErrors from its
    transport. Anything else (out of memory, a CUDA error, a bug) is the raising process's own failure."""
    if isinstance(err, dist.DistError):
        return True
    if type(err) is not RuntimeError:  # torch.OutOfMemoryError, torch.AcceleratorError, ...: subclasses
        return False
    text = str(err)
    return any(marker in text for marker in GLOO_LINK_MARKERS)


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


def make_nccl_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """An NCCL group of its own; its communicators are created at each pair's first operation. Its
    watchdog, on a timeout or a peer's error, aborts the communicators and fails the work (mode 2,
    CleanUpOnly), unless the environment says otherwise: torch's default (3) ends the process, so that
    `fault_tolerance.on_worker_loss: recover` never got to run."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # read as the group is made
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def node_address() -> str:
    """This process's address as other nodes reach it: its Ray node's IP (loopback outside Ray)."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is outside it (unit tests, a bare GPU node)
    return ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"


# -- where payloads live, and over what -------------------------------------------------------

def resolve_device(device: str | torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" is this thread's current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_descriptor(device: str | torch.device) -> str:
    """"cpu", or "cuda:<the GPU's UUID>": the same on every process that sees that physical GPU,
    whatever its index there (Ray gives each actor its own CUDA_VISIBLE_DEVICES)."""
    device = resolve_device(device)
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device.index).uuid}"


def data_backend(devices: list[str], nccl_available: bool | None = None) -> Backend:
    """The data plane's backend for ranks on `devices` (`device_descriptor`s, master first):
    "nccl" when every rank has a CUDA device of its own and NCCL is built in, else "gloo"."""
    if any(not d.startswith("cuda:") for d in devices):
        return "gloo"  # a rank on the CPU: rows cross host memory anyway
    if not (dist.is_nccl_available() if nccl_available is None else nccl_available):
        logger.warning("collective data plane: every rank has a GPU but this torch has no NCCL; rows "
                       "travel over gloo through host memory")
        return "gloo"
    shared = sorted({rank for rank, d in enumerate(devices) if devices.count(d) > 1})
    if shared:
        logger.warning("collective data plane: ranks %s share a GPU and NCCL refuses two ranks on one GPU; "
                       "rows travel over gloo through host memory (or serve those experts in the master's "
                       "process: cluster.workers_on_master)", shared)
        return "gloo"
    return "nccl"


@dataclass
class DataPlane:
    """The group the [R, D] payloads travel on, and the device they live on at this rank."""

    group: dist.ProcessGroup
    backend: Backend
    device: torch.device
    timeout: datetime.timedelta  # how long a gloo wait may block (an NCCL wait never blocks the host)

    @classmethod
    def form(cls, store: dist.Store, rank: int, world_size: int, backend: Backend, device: torch.device,
             timeout_s: float, address: str) -> "DataPlane":
        """Join the data group (gloo: blocks until every rank has joined; NCCL: at once)."""
        prefixed = dist.PrefixStore(DATA_PREFIX, store)
        if backend == "nccl":
            torch.cuda.set_device(device)  # NCCL's streams and this thread's current stream: this GPU
            group = make_nccl_group(prefixed, rank, world_size, NCCL_TIMEOUT_FACTOR * timeout_s)
        else:
            group, device = make_group(prefixed, rank, world_size, timeout_s, address), torch.device("cpu")
        return cls(group, backend, device, datetime.timedelta(seconds=timeout_s))

    def send(self, tensor: torch.Tensor, peer: int):
        return self.group.send([tensor], peer, TAG_DATA)

    def recv(self, tensor: torch.Tensor, peer: int):
        return self.group.recv([tensor], peer, TAG_DATA)

    def wait(self, work, block: bool = False) -> None:
        """gloo (or `block`): block until done or the timeout; NCCL: order the current CUDA stream
        after it, and the host goes on."""
        if self.backend == "nccl" and not block:
            work.wait()
        else:
            work.wait(self.timeout)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def release(self) -> None:
        """Free NCCL's communicators (an abort: never blocks on a peer); a gloo group just goes."""
        if self.backend == "nccl":
            self.group.abort()


# -- control-plane messages -------------------------------------------------------------------

def _header(op: int, layer: int = 0, key_id: int = 0, rows: int = 0, width: int = 0, dtype: int = 0,
            expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A request's header [HEADER_LEN]; a forward's `expert_ids` [R] go in as runs when they fit
    (`IDS_FOLLOW` when they do not: the caller sends them on TAG_IDS). Built in numpy: a layer builds one
    per worker, and torch's per-op overhead made this cost three times a send."""
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[:HEADER_FIELDS - 1] = (op, layer, key_id, rows, width, dtype)
    if expert_ids is not None and len(expert_ids):
        ids = expert_ids.numpy()
        bounds = np.concatenate(([0], np.flatnonzero(ids[1:] != ids[:-1]) + 1, [len(ids)]))  # runs' starts, end
        num_runs = len(bounds) - 1
        header[HEADER_FIELDS - 1] = IDS_FOLLOW if num_runs > MAX_RUNS else num_runs
        if num_runs <= MAX_RUNS:
            runs = header[HEADER_FIELDS:HEADER_FIELDS + 2 * num_runs].reshape(-1, 2)
            runs[:, 0], runs[:, 1] = ids[bounds[:-1]], bounds[1:] - bounds[:-1]
    return torch.from_numpy(header)


def _expert_ids(header: torch.Tensor) -> torch.Tensor | None:
    """The expert ids [R] a forward's header carries as runs; None when they follow on TAG_IDS."""
    num_runs = int(header[HEADER_FIELDS - 1])
    if num_runs == IDS_FOLLOW:
        return None
    runs = header.numpy()[HEADER_FIELDS:HEADER_FIELDS + 2 * num_runs].reshape(-1, 2)
    return torch.from_numpy(np.repeat(runs[:, 0], runs[:, 1]))


def _reply(status: int, text_length: int) -> torch.Tensor:
    return torch.tensor([status, text_length], dtype=torch.int64)


def _text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _error_text(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, ExpertWorkerError) else f"{type(exc).__name__}: {exc}"
    return text + "\n" + "".join(traceback.format_exception(exc.__cause__ or exc))


@dataclass(frozen=True)
class PlaneKey:
    """A saved forward's key as a worker's serving loop hands it to the server: the key id master process
    `master`'s transport assigned. Its own type, so it equals no key of another master's plane, nor any key
    a Ray caller sends (the dispatchers' (number, layer) tuples)."""

    master: int
    key: int


class RowServer(Protocol):
    """What a worker's serving loop calls: an ExpertManager's data plane (ExpertShard's two calls).
    Results may come back on any device: the loop sends them from its data plane's."""

    worker: int
    device: torch.device  # where it computes: its data plane's device when that is NCCL

    def forward_rows(self, layer: int, expert_ids: torch.Tensor, rows: torch.Tensor,
                     key: Hashable | None = None, adapters: bool = True) -> torch.Tensor: ...

    def backward_rows(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor: ...


# -- the worker's side ------------------------------------------------------------------------

def serve(group: dist.ProcessGroup, server: RowServer, master: int = 0, shared: bool = False) -> None:
    """Answer the master (rank 0) until it says stop or its link closes: the worker's serving loop.

    `master`: which master process the plane belongs to; the keys of its saved forwards reach `server`
    as `PlaneKey(master, key id)`, so the key ids several masters' transports assign never collide.
    `shared`: the server has one such loop per master process, on threads of its own (see "Several
    masters" above): over NCCL the loop runs on a CUDA stream of its own and waits on the host for each
    request's rows before computing. The server serialises its own calls (ExpertManager does).

    Only a link error (`is_link_error`) means the master is gone or dropped the groups. Any other
    failure is logged with its cause and, if the request it broke is still unanswered, answered
    STATUS_OUT_OF_STEP, and the loop goes on; one outside any request ends the loop, logged."""
    loop = _ServingLoop(group, server, master, shared)
    try:
        while loop.step():
            pass
    except Exception as err:
        if not is_link_error(err):  # answering a failure failed: the thread's traceback says why
            raise
        # the link to the master closed: it is gone or dropped the groups
        logger.warning("expert worker %d: data plane closed (%s)", server.worker, first_line(err))
    finally:
        if loop.data is not None:
            loop.data.release()


class _ServingLoop:
    """One worker's end of both planes: `group` (control) and, once set up, `data`."""

    def __init__(self, group: dist.ProcessGroup, server: RowServer, master: int = 0, shared: bool = False):
        self.group, self.server, self.master, self.shared = group, server, master, shared
        self.data: DataPlane | None = None
        self.timeout = datetime.timedelta(seconds=SERVE_TIMEOUT_S)
        self._next_header: tuple[torch.Tensor, object] | None = None  # posted before the last reply went out
        self._unanswered: str | None = None  # the request being served, until its reply is posted

    def _post_header_recv(self) -> tuple[torch.Tensor, object]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        return header, self.group.recv([header], 0, TAG_HEADER)

    def step(self) -> bool:
        """`serve_one`, a failure that is no link's answered (`fail`): False when the loop ends."""
        try:
            return self.serve_one()
        except Exception as err:
            if is_link_error(err):
                raise
            return self.fail(err)

    def serve_one(self) -> bool:
        """Receive one request and answer it; False on the master's stop."""
        header, work = self._next_header or self._post_header_recv()
        self._next_header = None
        work.wait(self.timeout)
        op, layer, key_id, num_rows, width, dtype = header[:HEADER_FIELDS - 1].tolist()
        if op == OP_STOP:
            return False
        self._unanswered = {OP_FORWARD: f"layer {layer}", OP_BASE_FORWARD: f"layer {layer} (adapters off)",
                            OP_BACKWARD: f"backward of key id {key_id}",
                            OP_DESCRIBE: "describing its device", OP_PING: "a ping",
                            OP_DATA_PLANE: "joining the data plane"}.get(op, f"op {op}")
        if op == OP_DESCRIBE:
            self._answer(STATUS_OK, device_descriptor(self.server.device))
        elif op == OP_DATA_PLANE:
            self._join_data_plane(self._recv_text(num_rows))
        elif op in (OP_FORWARD, OP_BASE_FORWARD):
            self._forward(layer, key_id, (num_rows, width), DTYPES[dtype], _expert_ids(header), op == OP_FORWARD)
        elif op == OP_PING:
            payload = self._recv_rows((num_rows, width), DTYPES[dtype], "a ping", "payload")
            if payload is not None:
                self._reply(lambda: payload[:1], payload[:1])
        else:
            self._backward(key_id, (num_rows, width), DTYPES[dtype])
        return True

    def fail(self, err: Exception) -> bool:
        """A failure outside `_reply`'s: log it and answer the request it broke, if any, STATUS_OUT_OF_STEP
        (where the data plane stands is unknown). False when no request was in progress: the loop ends."""
        request, worker = self._unanswered, self.server.worker
        logger.error("expert worker %d: the serving loop failed %s: %s: %s", worker,
                     f"on {request}" if request else "outside any request", type(err).__name__, first_line(err))
        logger.debug("expert worker %d: the serving loop's failure", worker, exc_info=err)
        if request is None:
            return False
        self._answer(STATUS_OUT_OF_STEP, f"{request}: the serving loop failed and may be out of step on the data "
                                         f"plane: {_error_text(err)}")
        return True

    def _forward(self, layer: int, key_id: int, shape: tuple[int, int], dtype: torch.dtype,
                 ids: torch.Tensor | None, adapters: bool = True) -> None:
        ids_work = None
        if ids is None:  # too many runs for the header: the ids follow
            ids = torch.empty(shape[0], dtype=torch.int64)
            ids_work = self.group.recv([ids], 0, TAG_IDS)
        rows = self._recv_rows(shape, dtype, f"layer {layer}", "rows")
        if ids_work is not None:
            ids_work.wait(self.timeout)
        if rows is None:  # answered: out of step
            return
        key = None if key_id == NO_KEY else PlaneKey(self.master, key_id)
        base = {} if adapters else {"adapters": False}  # asked only of a base-model pass (`ForwardRequest`)
        self._reply(lambda: self.server.forward_rows(layer, ids, rows, key, **base), rows)

    def _backward(self, key_id: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        grad = self._recv_rows(shape, dtype, f"backward of key id {key_id}", "gradients")
        if grad is not None:
            self._reply(lambda: self.server.backward_rows(PlaneKey(self.master, key_id), grad), grad)

    def _recv_rows(self, shape: tuple[int, int], dtype: torch.dtype, request: str, what: str) -> torch.Tensor | None:
        """The request's [R, D] payload, received; None when its buffer could not be allocated: then the
        request is answered STATUS_OUT_OF_STEP (the master's send and receive for it stay unmatched)."""
        try:
            rows = self._empty(shape, dtype)
        except Exception as exc:
            device = self.data.device if self.data is not None else self.server.device
            mib = shape[0] * shape[1] * dtype.itemsize / 2 ** 20
            text = (f"{request}: could not allocate the {what}' receive buffer {list(shape)} {dtype} ({mib:.1f} MiB) "
                    f"on {device}: {type(exc).__name__}: {first_line(exc)}")
            logger.error("expert worker %d: %s", self.server.worker, text)
            self._answer(STATUS_OUT_OF_STEP, text)
            return None
        # shared (several masters' loops, one device): the rows have arrived before any compute is launched, so
        # no compute queued on the device waits on another master's transfer (see "Several masters")
        self.data.wait(self.data.recv(rows, 0), block=self.shared)
        return rows

    def _empty(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        if self.data is None:
            raise RuntimeError("rows arrived before the data plane was set up (OP_DATA_PLANE)")
        try:
            return self.data.empty(shape, dtype)
        except torch.OutOfMemoryError:
            if self.data.device.type != "cuda":
                raise
        torch.cuda.empty_cache()  # blocks cached for other sizes: freed, then one more try
        return self.data.empty(shape, dtype)

    def _reply(self, compute: Callable[[], torch.Tensor], like: torch.Tensor) -> None:
        """Send the result in `like`'s shape, dtype and device, or zeros and the error's text: the
        data plane gets its message either way, so it stays in step (the loop survives a bad request).
        The zeros are `like` itself, zeroed in place: an error reply allocates nothing (after an out of
        memory it would fail again); if even that fails (a CUDA error), it is answered out of step."""
        try:
            result = compute().detach().to(like.device, like.dtype).contiguous()
            if result.shape != like.shape:
                raise RuntimeError(f"result has shape {tuple(result.shape)}, the request {tuple(like.shape)}")
            status, text = STATUS_OK, ""
        except Exception as exc:  # sent to the master, raised there as ExpertWorkerError, traceback included
            result, status, text = None, STATUS_ERROR, _error_text(exc)
            try:
                result = like.zero_()
            except Exception as again:
                status = STATUS_OUT_OF_STEP
                text += f"\n(and its zeros could not be sent either: {type(again).__name__}: {first_line(again)})"
                logger.error("expert worker %d: %s: %s, and zeroing its reply failed too (%s: %s): answered "
                             "out of step", self.server.worker, self._unanswered, first_line(exc),
                             type(again).__name__, first_line(again))
        message = _text(text)
        # the next header's receive goes up before the answer: gloo sends a message only once its receive
        # is posted, so the master's next header need not wait for this loop to come round
        self._next_header = self._post_header_recv()
        self._unanswered = None
        reply = self.group.send([_reply(status, len(message))], 0, TAG_REPLY)
        if result is not None:
            self.data.wait(self.data.send(result, 0))  # posted with the reply in flight: they overlap
        reply.wait()
        if len(message):
            self.group.send([message], 0, TAG_TEXT).wait()

    def _answer(self, status: int, text: str) -> None:
        message = _text(text)
        self._unanswered = None
        self.group.send([_reply(status, len(message))], 0, TAG_REPLY).wait()
        if len(message):
            self.group.send([message], 0, TAG_TEXT).wait()

    def _recv_text(self, length: int) -> str:
        message = torch.empty(length, dtype=torch.uint8)
        self.group.recv([message], 0, TAG_TEXT).wait(self.timeout)
        return bytes(message.tolist()).decode()

    def _join_data_plane(self, setup_json: str) -> None:
        """Form the data group the master described, answer, then echo the master's probe over it."""
        setup = json.loads(setup_json)
        try:
            if self.data is not None:
                self.data.release()
            store = make_store(setup["host"], setup["port"], setup["world_size"], False, setup["join_timeout_s"])
            device = resolve_device(self.server.device)
            self.data = DataPlane.form(store, self.server.worker + 1, setup["world_size"], setup["backend"],
                                       device, setup["timeout_s"], node_address())
            if self.shared and self.data.backend == "nccl":  # this thread's waits stay off the other loops' stream
                torch.cuda.set_stream(torch.cuda.Stream(self.data.device))
        except Exception as exc:
            self.data = None
            self._answer(STATUS_ERROR, _error_text(exc))
            return
        self._answer(STATUS_OK, "")
        probe = self.data.empty((1,), torch.float32)
        self.data.wait(self.data.recv(probe, 0))
        self.data.wait(self.data.send(probe + 1, 0))


# -- the master's side ------------------------------------------------------------------------

def _checked(worker: int, operation: Callable):
    """Run one point-to-point operation with `worker`; a broken link or a timeout is its loss. Any other
    error (the master's own out of memory or CUDA error) is raised as itself: no worker's fault."""
    try:
        return operation()
    except PeerLostError:
        raise
    except RuntimeError as err:
        if not is_link_error(err):
            raise
        raise PeerLostError(worker, first_line(err)) from None


@dataclass
class _InFlight:
    """An NCCL result whose wait only ordered the master's CUDA stream: the host has not seen it arrive."""

    worker: int
    work: object
    deadline: float  # time.monotonic()


def _unarrived(in_flight: list[_InFlight], block: bool, timeout_s: float,
               poll_s: float = SETTLE_POLL_S) -> list[_InFlight]:
    """The results of `in_flight` not yet arrived (`block`: none, polled until they are). One past its
    deadline raises the `PeerLostError` naming its worker (it answered, then its result never came: it died
    in between), as does one that ended in an error (NCCL's watchdog aborted its communicator)."""
    while True:
        now, left = time.monotonic(), []
        for result in in_flight:
            if result.work.is_completed():
                _checked(result.worker, result.work.wait)  # raises the error it ended with, if any
            elif now >= result.deadline:
                raise PeerLostError(result.worker, f"its result did not arrive within {timeout_s:g} s of its reply")
            else:
                left.append(result)
        if not block or not left:
            return left
        in_flight = left
        time.sleep(poll_s)


def _recv_answer(group: dist.ProcessGroup, worker: int, timeout: datetime.timedelta) -> tuple[int, str]:
    """One worker's reply on the control plane: (status, text)."""
    reply = torch.empty(2, dtype=torch.int64)
    _checked(worker, lambda: group.recv([reply], worker + 1, TAG_REPLY).wait(timeout))
    status, length = reply.tolist()
    return status, _recv_worker_text(group, worker, length, timeout)


def _recv_worker_text(group: dist.ProcessGroup, worker: int, length: int, timeout: datetime.timedelta) -> str:
    if not length:
        return ""
    message = torch.empty(length, dtype=torch.uint8)
    _checked(worker, lambda: group.recv([message], worker + 1, TAG_TEXT).wait(timeout))
    return bytes(message.tolist()).decode(errors="replace")


def _tell_all(group: dist.ProcessGroup, num_workers: int, header: torch.Tensor, text: str,
              timeout: datetime.timedelta) -> None:
    """Send every worker `header`, and `text` after it if any."""
    message = _text(text)
    for worker in range(num_workers):
        _checked(worker, lambda: group.send([header], worker + 1, TAG_HEADER).wait(timeout))
        if len(message):
            _checked(worker, lambda: group.send([message], worker + 1, TAG_TEXT).wait(timeout))


def _answers(group: dist.ProcessGroup, num_workers: int, timeout: datetime.timedelta) -> list[tuple[int, str]]:
    """Every worker's answer to the last request: (status, text)."""
    return [_recv_answer(group, worker, timeout) for worker in range(num_workers)]


def _raise_first_error(answers: list[tuple[int, str]]) -> list[str]:
    """The answers' texts, or the first error answer raised as the `ExpertWorkerError` naming its worker."""
    for worker, (status, answer) in enumerate(answers):
        if status != STATUS_OK:
            raise ExpertWorkerError(worker, f"joining the collective data plane failed: {answer}")
    return [answer for _, answer in answers]


def _stop_all(group: dist.ProcessGroup, workers: list[int], timeout: datetime.timedelta) -> list[int]:
    """Best effort: tell `workers`' loops to stop (posted to all first); returns those it did not reach."""
    posted, unreached = [], []
    for worker in workers:
        try:
            posted.append((worker, group.send([_header(OP_STOP)], worker + 1, TAG_HEADER)))
        except RuntimeError:
            unreached.append(worker)
    for worker, work in posted:
        try:
            work.wait(timeout)
        except RuntimeError:
            unreached.append(worker)
    return unreached


def form_data_plane(group: dist.ProcessGroup, store: dist.TCPStore, num_workers: int,
                    device: str | torch.device = "cpu", backend: Backend | None = None, timeout_s: float = 300.0,
                    join_timeout_s: float = 120.0, address: str = "127.0.0.1") -> DataPlane:
    """The master's side of the setup over the control plane `group`, whose rendezvous `store` the
    master listens on: ask the workers' devices, pick the backend (`data_backend`; `backend` overrides
    it), have every rank form the data group, and probe each worker's link over it. If it fails, the
    workers' loops are told to stop before the error is raised."""
    join = datetime.timedelta(seconds=join_timeout_s)
    try:
        return _form_data_plane(group, store, num_workers, resolve_device(device), backend, timeout_s, join, address)
    except BaseException:
        _stop_all(group, list(range(num_workers)), join)
        raise


def _form_data_plane(group: dist.ProcessGroup, store: dist.TCPStore, num_workers: int, device: torch.device,
                     backend: Backend | None, timeout_s: float, join: datetime.timedelta, address: str) -> DataPlane:
    _tell_all(group, num_workers, _header(OP_DESCRIBE), "", join)
    devices = [device_descriptor(device)] + _raise_first_error(_answers(group, num_workers, join))
    chosen = data_backend(devices)
    if backend == "nccl" and chosen != "nccl":
        raise ValueError(f"data_backend='nccl' needs every rank on a CUDA device of its own; the ranks' devices "
                         f"are {devices} (master first): leave data_backend unset to use gloo")
    backend = backend or chosen
    setup = json.dumps({"backend": backend, "host": store.host, "port": store.port, "world_size": num_workers + 1,
                        "timeout_s": timeout_s, "join_timeout_s": join.total_seconds()})
    _tell_all(group, num_workers, _header(OP_DATA_PLANE, rows=len(setup.encode())), setup, join)
    data = DataPlane.form(store, 0, num_workers + 1, backend, device, timeout_s, address)
    try:
        answers = _answers(group, num_workers, join)
        for worker, (status, _) in enumerate(answers):
            if status == STATUS_OK:  # it waits for the probe: even if another worker failed
                _probe(data, worker)
        _raise_first_error(answers)
    except BaseException:
        data.release()
        raise
    return data


def _probe(data: DataPlane, worker: int) -> None:
    """One tensor to `worker` and back over the data plane, waited for on the host (bounded by the
    timeout): NCCL creates the pair's communicator now, not in the first layer."""
    probe = torch.full((1,), float(worker), device=data.device)
    echo = data.empty((1,), torch.float32)
    _checked(worker, lambda: data.wait(data.send(probe, worker + 1), block=True))
    _checked(worker, lambda: data.wait(data.recv(echo, worker + 1), block=True))
    if echo.item() != worker + 1:
        raise PeerLostError(worker, f"the data plane's probe came back as {echo.item()}, not {worker + 1}")


@dataclass
class _Outgoing:
    """One worker's request, ready to post: control-plane messages and the data-plane payload."""

    worker: int
    control: list[tuple[torch.Tensor, int]]  # (tensor, tag)
    payload: torch.Tensor
    result_rows: int | None = None  # the answer's rows, where not the payload's (a ping's: 1)


@dataclass
class _Pending:
    """One worker's outstanding answer: its reply (control plane) and its result (data plane), both posted,
    and the send of its payload."""

    worker: int
    reply: torch.Tensor
    result: torch.Tensor
    reply_work: object = None
    result_work: object = None
    payload_work: object = None


class CollectiveTransport:
    """The master's side (rank 0): `Transport` over formed groups whose rank n + 1 is worker n."""

    def __init__(self, group: dist.ProcessGroup, data: DataPlane, worker_tiers: list[LinkTier],
                 timeout_s: float = 300.0, on_close=None):
        """`group`: the control plane; `data`: the data plane (`form_data_plane`). `timeout_s`: how long
        the master waits for one layer's answer before naming the worker lost. `on_close`: called after
        the workers were told to stop (e.g. to join their serving loops)."""
        self.group, self.data = group, data
        self.tiers = list(worker_tiers)
        self.num_workers = len(self.tiers)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._on_close = on_close
        self._keys: dict[Hashable, int] = {}
        self._next_key = 0
        self._closed = False
        self._lost: int | None = None  # the worker whose link broke: the message streams are out of step
        self._out_of_step: str | None = None  # why the data plane is out of step (its peers all alive)
        self._in_flight: list[_InFlight] = []  # NCCL results the host has not seen arrive (`settle`)
        # one exchange at a time: the message streams to each worker are ordered (micro-batches in flight,
        # `training.overlap`, call from threads of their own; one waits while the other's rows travel)
        self._exchanging = threading.RLock()

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        """Results on the data plane's device (the master's GPU with NCCL, the CPU with gloo)."""
        with self._exchanging:
            return self._forward(requests)

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        with self._exchanging:
            return self._backward(key, grads)

    def _forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        self._check_usable()
        results = {w: r.rows.new_zeros(r.rows.shape) for w, r in requests.items() if r.rows.shape[0] == 0}
        outgoing = [self._forward_message(w, r) for w, r in requests.items() if w not in results]
        results.update(self._exchange(outgoing))
        return results

    def _backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        self._check_usable()
        key_id = self._keys.pop(key, None)
        if key_id is None and not grads:  # the forward sent no rows anywhere: nothing was saved
            return {}
        if key_id is None:
            raise ExpertWorkerError(min(grads), f"backward of key {key!r}: no forward was saved under it "
                                                "(backward called twice or without forward)")
        outgoing = []
        for worker, grad in grads.items():
            grad = grad.to(self.data.device).contiguous()
            header = _header(OP_BACKWARD, 0, key_id, grad.shape[0], grad.shape[1], DTYPES.index(grad.dtype))
            outgoing.append(_Outgoing(worker, [(header, TAG_HEADER)], grad))
        results = self._exchange(outgoing)
        if not self._keys:  # no saved forward left: a micro-batch's backward ends, its loss is read next
            self.settle()
        return results

    def ping(self, payloads: dict[int, torch.Tensor]) -> int:
        """Each worker's [R, D] payload sent over the data plane, its first row sent back; the bytes sent. The link
        probes time it (`actors.placement_service.collective_ping`): the rows take this plane, not Ray's objects
        (on one node, gloo's TCP through the loopback where Ray's objects go through shared memory). One way,
        as Ray's ping: a shared link (a NIC) probed through several workers at once is then timed in the
        direction the payloads take, as the cost model counts it."""
        with self._exchanging:
            self._check_usable()
            outgoing = []
            for worker, payload in payloads.items():
                payload = payload.to(self.data.device).contiguous()
                header = _header(OP_PING, 0, NO_KEY, payload.shape[0], payload.shape[1], DTYPES.index(payload.dtype))
                outgoing.append(_Outgoing(worker, [(header, TAG_HEADER)], payload, result_rows=1))
            self._exchange(outgoing)
            self.settle()  # NCCL: arrived, not only ordered on the stream
        return sum(p.numel() * p.element_size() for p in payloads.values())

    def worker_tiers(self) -> list[LinkTier]:
        return self.tiers

    def describe(self) -> str:
        return f"collective ({self.data.backend})"

    def settle(self) -> None:
        """Block until every result received so far has arrived, or raise the `PeerLostError` naming the
        worker whose result is `timeout_s` late. With NCCL a result's wait only orders the CUDA stream;
        call this before the host reads what depends on one (a step's loss): a worker that died between
        its reply and its result is then named, where a CUDA synchronization would block until NCCL's
        watchdog. `backward` calls it once no saved forward is left. With gloo every result was waited
        for on the host already: nothing to do."""
        self._check_usable()
        self._check_arrivals(block=True)

    def _check_arrivals(self, block: bool) -> None:
        """Drop the NCCL results that arrived (`block`: wait for all); one that is late names its worker lost."""
        try:
            self._in_flight = _unarrived(self._in_flight, block, self.timeout.total_seconds())
        except PeerLostError as lost:
            self._lost = lost.worker
            raise

    def close(self) -> None:
        """Tell every worker's loop to stop and wait for them; idempotent. After a lost peer the others
        are told to stop too (briefly, best effort) and both groups are dropped: a loop still blocked
        ends when their sockets close (gloo closes them when the group goes, not on abort)."""
        if self._closed:
            return
        self._in_flight = []
        others = [w for w in range(self.num_workers) if w != self._lost]
        unreached = _stop_all(self.group, others, self.timeout if self._lost is None
                              else datetime.timedelta(seconds=STOP_AFTER_LOSS_S))
        if self._lost is not None or unreached:
            self._abort()
            return
        self._closed = True
        if self._out_of_step is None:  # else aborted already
            self.data.release()
        if self._on_close is not None:
            self._on_close()

    # -- internals ---------------------------------------------------------------------------

    def _abort(self) -> None:
        group, data, self._closed, self.group, self.data = self.group, self.data, True, None, None
        data.group.abort()  # NCCL: ops in flight end; gloo closes the sockets only as the groups go (here)
        group.abort()

    def _key_id(self, key: Hashable) -> int:
        if key not in self._keys:
            self._keys[key] = self._next_key
            self._next_key += 1
        return self._keys[key]

    def _forward_message(self, worker: int, req: ForwardRequest) -> _Outgoing:
        key_id = NO_KEY if req.key is None else self._key_id(req.key)
        rows = req.rows.to(self.data.device).contiguous()
        ids = req.expert_ids.to("cpu", torch.int64).contiguous()  # the broker's ids are on the CPU already
        op = OP_FORWARD if req.adapters else OP_BASE_FORWARD  # the base model's rows: LoRA left out
        header = _header(op, req.layer, key_id, rows.shape[0], rows.shape[1], DTYPES.index(rows.dtype), ids)
        control = [(header, TAG_HEADER)] + ([(ids, TAG_IDS)] if header[HEADER_FIELDS - 1] == IDS_FOLLOW else [])
        return _Outgoing(worker, control, rows)

    def _send(self, tensor: torch.Tensor, worker: int, tag: int):
        return self._link(worker, lambda: self.group.send([tensor], worker + 1, tag))

    def _recv(self, tensor: torch.Tensor, worker: int, tag: int):
        return self._link(worker, lambda: self.group.recv([tensor], worker + 1, tag))

    def _wait(self, worker: int, work) -> None:
        self._link(worker, lambda: work.wait(self.timeout))

    def _check_usable(self) -> None:
        if self._closed or self._lost is not None:
            raise RuntimeError("CollectiveTransport is closed or lost a worker; form a new group to send rows")
        if self._out_of_step is not None:
            raise RuntimeError(f"CollectiveTransport: the data plane is out of step ({self._out_of_step}); "
                               "close it and form a new group to send rows")

    def _fall_out_of_step(self, reason: str) -> None:
        """The data plane has sends or receives no peer will match: abort it (NCCL's would otherwise hang
        until its watchdog) and refuse it from now on; the control plane still reaches every worker. The
        other workers' results in flight (NCCL) are let arrive first, within their deadline: the abort
        would cut their sends off and leave those workers' streams waiting on them."""
        self._out_of_step = reason
        try:
            _unarrived(self._in_flight, True, self.timeout.total_seconds())
        except Exception as err:  # noqa: BLE001 - the plane is dropped either way
            logger.warning("collective data plane out of step; a result in flight did not arrive: %s", first_line(err))
        self._in_flight = []
        self.data.group.abort()

    def _link(self, worker: int, operation):
        """Run one operation with `worker`; a broken link or a timeout is its loss."""
        self._check_usable()
        try:
            return _checked(worker, operation)
        except PeerLostError:
            self._lost = worker
            raise

    def _exchange(self, outgoing: list[_Outgoing]) -> dict[int, torch.Tensor]:
        """Post every worker's messages and receives at once, then wait for replies and results. All
        of a layer's messages and receive buffers are made before any is posted, so a bad request or
        an allocation that fails posts nothing. A failure of the master's own once posting began (not a
        link's) leaves the data plane out of step: raised as itself, and the plane refused from then on."""
        self._check_usable()
        self._check_arrivals(block=False)  # results from earlier layers already late (NCCL): named now
        pending = [_Pending(o.worker, torch.empty(2, dtype=torch.int64),
                            torch.empty_like(o.payload if o.result_rows is None else o.payload[:o.result_rows]))
                   for o in outgoing]
        try:
            controls = [self._post(o, p) for o, p in zip(outgoing, pending)]
            for p, control in zip(pending, controls):
                for work in control:
                    self._wait(p.worker, work)
            results, errors, out_of_step = self._collect(pending)
        except PeerLostError:
            raise
        except BaseException as err:
            if self._lost is None and not self._closed:
                self._fall_out_of_step(f"the master failed mid-layer: {type(err).__name__}: {first_line(err)}")
            raise
        if out_of_step:
            worker, text = out_of_step[0]
            self._fall_out_of_step(f"expert worker {worker} posted nothing on it for its last request: "
                                   f"{(text.strip().splitlines() or ['no reason given'])[0]}")
        if errors:
            raise errors[0]
        return results

    def _post(self, o: _Outgoing, p: _Pending) -> list:
        """Post one worker's request (control messages, payload) and its answer's receives; returns the
        control messages' works."""
        control = [self._send(tensor, o.worker, tag) for tensor, tag in o.control]
        p.payload_work = self._link(o.worker, lambda: self.data.send(o.payload, o.worker + 1))
        p.reply_work = self._recv(p.reply, o.worker, TAG_REPLY)
        p.result_work = self._link(o.worker, lambda: self.data.recv(p.result, o.worker + 1))
        return control

    def _collect(self, pending: list[_Pending]) -> tuple[dict[int, torch.Tensor], list[ExpertWorkerError],
                                                         list[tuple[int, str]]]:
        """Each worker's reply (control plane, bounded by the timeout), then its payload's send and its
        result (data plane); a worker that answered out of step posted neither, so they are not waited
        for. Returns the results, the workers' errors, and the (worker, text) of those out of step."""
        errors, out_of_step = [], []
        for p in pending:
            self._wait(p.worker, p.reply_work)
            status, length = p.reply.tolist()
            if status != STATUS_OUT_OF_STEP:
                self._link(p.worker, lambda: self.data.wait(p.payload_work))
                self._link(p.worker, lambda: self.data.wait(p.result_work))
                if self.data.backend == "nccl":  # the host has not seen it arrive: `settle`
                    self._in_flight.append(_InFlight(p.worker, p.result_work,
                                                     time.monotonic() + self.timeout.total_seconds()))
            text = self._link(p.worker, lambda: _recv_worker_text(self.group, p.worker, length, self.timeout))
            if status != STATUS_OK:
                errors.append(ExpertWorkerError(p.worker, text))
            if status == STATUS_OUT_OF_STEP:
                out_of_step.append((p.worker, text))
        return {p.worker: p.result for p in pending}, errors, out_of_step
