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
"""

from __future__ import annotations

import contextlib
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


class InProcessTransport:
    """Experts in the master's process: a direct call, no copies.

    `shards[n]` serves worker n: anything with ExpertShard's `forward_rows`/`backward_rows`
    (an ExpertShard, or an ExpertManager, which also counts what it receives).
    """

    def __init__(self, shards: list[ExpertShard], lock: threading.Lock | None = None,
                 tiers: list[LinkTier] | None = None):
        """`lock`: shared by the transports of masters in several threads of this process (data-parallel
        masters, `vela_ray.runtime.masters`): a shard's saved forwards and gradients are not thread-safe.
        `tiers`: the link tier each worker's traffic is counted under (an emulated cluster's; default: all
        same_process)."""
        self.shards = shards
        self.num_workers = len(shards)
        self.lock = lock or contextlib.nullcontext()
        self.tiers: list[LinkTier] = list(tiers) if tiers is not None else ["same_process"] * self.num_workers

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        with self.lock:
            return {
                worker: self.shards[worker].forward_rows(req.layer, req.expert_ids, req.rows, req.key)
                for worker, req in requests.items()
            }

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        with self.lock:
            return {worker: self.shards[worker].backward_rows(key, grad) for worker, grad in grads.items()}

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
