"""How token rows travel between the broker (on the master) and expert shards.

The broker decides *what* goes *where*; a `Transport` only moves it. One call
carries the requests for all workers of one MoE layer, so a transport can
issue them concurrently (Ray: one remote call or channel write per worker,
then wait for all). Backends:

- `InProcessTransport` here: shards live in the master's process (tests, one-GPU runs);
- `SplitTransport` here: some workers in the master's process, the others behind a Ray transport;
- Ray object refs in `actors/transports.py`;
- torch.distributed point-to-point in `vela_ray.model.collective` (formed through Ray).

All backends pass the same conformance suite (tests/ray/test_transport_conformance.py).

Several masters share the workers, and with LUFFY's sequence migration (`vela_ray.training.sequence_migration`)
a worker answers some rows to a master other than the sender: the rows of a sequence that leaves its master
at this layer. A transport that can do it is also a `RowRelay`: `ForwardRequest.reply_to` names, per row, the
master its output is for (-1: the sender, who gets only those rows back); the worker holds the others until
that master `collect`s them, and in backward that master `deposit`s their gradients before the sender's
`backward` for the same key, which the worker completes with them. In-process and Ray object-ref transports
relay; the collective plane does not (each master process has planes of its own, which answer only it; sequence
migration then combines on the old master).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from dataclasses import dataclass
from typing import Hashable, Protocol, runtime_checkable

import torch

from vela_ray.model.experts import ExpertShard
from vela_ray.model.traffic import LinkTier


@dataclass(frozen=True)
class ForwardRequest:
    """Rows for one worker in one MoE layer; rows are grouped by expert.

    `key` names the saved graph for the matching backward; None in inference
    (no graph is kept).
    """

    layer: int
    expert_ids: torch.Tensor  # [R] int64, expert index within the layer
    rows: torch.Tensor  # [R, D]
    key: Hashable | None = None
    reply_to: torch.Tensor | None = None  # [R] int64: the master each row's output is for, -1 the sender (`RowRelay`)
    adapters: bool = True  # False: the base model's experts, LoRA off (a preference objective's reference pass)


@runtime_checkable
class Transport(Protocol):
    """Moves rows to expert shards and their results back, for one layer at a time."""

    num_workers: int

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        """{worker: request} -> {worker: expert outputs [R, D]}, same row order."""
        ...

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{worker: d(outputs) [R, D]} -> {worker: d(rows) [R, D]} for the forward saved under `key`."""
        ...

    def worker_tiers(self) -> list[LinkTier]:
        """Link tier of each worker as seen from the master."""
        ...

    def describe(self) -> str:
        """How rows travel, for the run's summary: e.g. "collective (nccl)"."""
        ...


@runtime_checkable
class RowRelay(Protocol):
    """A transport whose workers answer rows to a master other than the sender (see the module docstring)."""

    def collect(self, key: Hashable, master: int, workers: list[int]) -> dict[int, torch.Tensor]:
        """{worker: the outputs it holds for `master` from the forward saved under `key`}, in its row order."""
        ...

    def deposit(self, key: Hashable, master: int, grads: dict[int, torch.Tensor]) -> None:
        """Give each worker the d(outputs) of the rows it answered to `master` under `key`; returns once they
        are there, so the sender's `backward(key, ...)` that follows finds them."""
        ...


def request_kwargs(request: ForwardRequest) -> dict:
    """`forward_rows`'s keywords for what a request asks beyond its rows: `reply_to` for a relayed request (plain
    shards take none), `adapters=False` for the base model's outputs; none for a plain training request."""
    kwargs = {} if request.reply_to is None else {"reply_to": request.reply_to}
    return kwargs if request.adapters else {**kwargs, "adapters": False}


class ZeroAnswers:
    """Workers that answer zeros at once: each reply shaped as its request, as every worker's is (`wire`). What a
    broker call costs the master around the experts is timed with it (`ExpertDispatcher.answering_at_once`)."""

    def __init__(self, like: Transport):
        self.like = like
        self.num_workers = like.num_workers

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        return {worker: torch.zeros_like(req.rows) for worker, req in requests.items()}

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {worker: torch.zeros_like(grad) for worker, grad in grads.items()}

    def worker_tiers(self) -> list[LinkTier]:
        return self.like.worker_tiers()

    def describe(self) -> str:
        return f"zeros in place of {self.like.describe()}"


class InProcessTransport:
    """Experts in the master's process: a direct call, no copies.

    `shards[n]` serves worker n: anything with ExpertShard's `forward_rows`/`backward_rows`
    (an ExpertShard, or an ExpertManager, which also counts what it receives).
    """

    def __init__(self, shards: list[ExpertShard], lock: threading.Lock | None = None,
                 tiers: list[LinkTier] | None = None):
        """`lock`: shared by the transports of masters in several threads of this process (data-parallel
        masters, `vela_ray.runtime.masters`): a shard's saved forwards and gradients are not thread-safe; by
        default one of its own, for this master's micro-batches in flight (`training.overlap`).
        `tiers`: the link tier each worker's traffic is counted under (an emulated cluster's; default: all
        same_process)."""
        self.shards = shards
        self.num_workers = len(shards)
        self.lock = lock or threading.Lock()
        self.tiers: list[LinkTier] = list(tiers) if tiers is not None else ["same_process"] * self.num_workers

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        with self.lock:
            return {
                worker: self.shards[worker].forward_rows(req.layer, req.expert_ids, req.rows, req.key,
                                                         **request_kwargs(req))
                for worker, req in requests.items()
            }

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        with self.lock:
            return {worker: self.shards[worker].backward_rows(key, grad) for worker, grad in grads.items()}

    def collect(self, key: Hashable, master: int, workers: list[int]) -> dict[int, torch.Tensor]:
        with self.lock:
            return {worker: self.shards[worker].collect_rows(key, master) for worker in workers}

    def deposit(self, key: Hashable, master: int, grads: dict[int, torch.Tensor]) -> None:
        with self.lock:
            for worker, grad in grads.items():
                self.shards[worker].backward_rows(key, grad, master)

    def worker_tiers(self) -> list[LinkTier]:
        return self.tiers

    def close(self) -> None:
        """Nothing to release: the experts are this process's."""

    def describe(self) -> str:
        return "in-process"


class SplitTransport:
    """Workers 0..A-1 over `remote` (Ray actors), A..N-1 over `local` (ExpertManagers in this process,
    `cluster.workers_on_master`): one layer's remote rows are posted first and travel, on a thread of
    their own, while the local experts compute (the master overlaps its in-process experts with the
    rows in flight); then both answers are merged in worker order."""

    def __init__(self, remote: Transport, local: Transport):
        self.remote, self.local = remote, local
        self.split = remote.num_workers
        self.num_workers = remote.num_workers + local.num_workers
        self._remote_thread = ThreadPoolExecutor(1, thread_name_prefix="vela-remote-rows")

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        return self._both(self.remote.forward, self.local.forward, requests)

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return self._both(functools.partial(self.remote.backward, key), functools.partial(self.local.backward, key),
                          grads)

    def worker_tiers(self) -> list[LinkTier]:
        return [*self.remote.worker_tiers(), *self.local.worker_tiers()]

    def describe(self) -> str:
        return f"{self.remote.describe()} + {self.local.describe()}"

    def close(self) -> None:
        self._remote_thread.shutdown(wait=True)
        self.remote.close()

    def _both(self, remote_call, local_call, parts: dict) -> dict[int, torch.Tensor]:
        remote = {w: p for w, p in parts.items() if w < self.split}
        local = {w - self.split: p for w, p in parts.items() if w >= self.split}
        pending = self._remote_thread.submit(remote_call, remote) if remote else None
        try:
            out = {w + self.split: result for w, result in local_call(local).items()} if local else {}
        finally:  # the remote call ends before the next one starts, even when a local expert failed
            remote_out = pending.result() if pending is not None else {}
        return remote_out | out


class HeldRows:
    """A worker's side of `RowRelay`: the outputs it holds for masters other than the sender, and the
    gradients they deposit, per forward key. Rows stay in the format they travel in (`vela_ray.model.wire`)."""

    def __init__(self):
        self._reply_to: dict[Hashable, torch.Tensor] = {}  # key -> [R] the master of each row, -1 the sender
        self._held: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._deposited: dict[tuple[Hashable, int], torch.Tensor] = {}

    def hold(self, key: Hashable, reply_to_R: torch.Tensor, out_RD: torch.Tensor) -> torch.Tensor:
        """Keep the rows of `out_RD` meant for other masters; returns the sender's rows."""
        if key is None:
            raise ValueError("rows are relayed to another master only in a training forward (with a key)")
        reply_to_R = reply_to_R.to(torch.long).cpu()
        self._reply_to[key] = reply_to_R
        for master in reply_to_R.unique().tolist():
            if master >= 0:
                self._held[(key, master)] = out_RD[(reply_to_R == master).to(out_RD.device)]
        return out_RD[(reply_to_R < 0).to(out_RD.device)]

    def collect(self, key: Hashable, master: int) -> torch.Tensor:
        try:
            return self._held.pop((key, master))
        except KeyError:
            raise KeyError(f"no rows held for master {master} under key {key!r}: collected twice, or its sender's "
                           "forward did not relay any here") from None

    def deposit(self, key: Hashable, master: int, grad_RD: torch.Tensor) -> None:
        reply_to_R = self._reply_to.get(key)
        if reply_to_R is None or not bool((reply_to_R == master).any()):
            raise KeyError(f"master {master} deposited gradients for key {key!r}, whose forward relayed it no rows "
                           "here")
        self._deposited[(key, master)] = grad_RD

    def complete(self, key: Hashable, grad_RD: torch.Tensor, decode) -> torch.Tensor:
        """The d(outputs) of every row of `key`'s forward: the sender's `grad_RD` (its rows, decoded by
        `decode`) with the other masters' deposits in their rows. Unrelayed keys pass through."""
        grad_RD = decode(grad_RD)
        reply_to_R = self._reply_to.pop(key, None)
        if reply_to_R is None:
            return grad_RD
        full_RD = grad_RD.new_zeros((len(reply_to_R), *grad_RD.shape[1:]))
        full_RD[(reply_to_R < 0).to(full_RD.device)] = grad_RD
        for master in reply_to_R.unique().tolist():
            if master < 0:
                continue
            part = self._deposited.pop((key, master), None)
            if part is None:
                raise RuntimeError(f"backward of key {key!r} before master {master} deposited the gradients of "
                                   "the rows relayed to it")
            full_RD[(reply_to_R == master).to(full_RD.device)] = decode(part)
        return full_RD

    def release(self) -> None:
        """Drop everything held (between steps, after an eval pass or a failure)."""
        self._reply_to.clear()
        self._held.clear()
        self._deposited.clear()
