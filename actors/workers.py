"""The control plane (`vela_ray.training.expert_workers.ExpertWorkers`) over ExpertManager actors.

Every call fans out with one `.remote` per worker and waits with one `ray.get`, so the
workers step, zero and report their grad norms in parallel:

    workers = actor_workers(cluster.handles)
    train_step(master, workers, micro_batches, lr, max_grad_norm)

The data plane (rows and gradients) goes through a transport (`actors.transports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import ray

from vela_ray.training.expert_workers import ExpertWorkers


def actor_workers(handles: Sequence[Any], timeout_s: float | None = None, local: Sequence[Any] = ()
                  ) -> ExpertWorkers:
    """ExpertWorkers over actor handles; `handles[n]` is worker n, and `local[i]` (ExpertManagers in this
    process, `cluster.workers_on_master`) worker len(handles) + i, called while the actors work."""
    handles, local = list(handles), list(local)

    def call_all(method: str, *args: Any) -> list[Any]:
        # A dict argument (an adapter state) is stored once in the object store, not once per worker.
        stored = tuple(ray.put(a) if isinstance(a, dict) and handles else a for a in args)
        refs = [getattr(h, method).remote(*stored) for h in handles]
        here = [getattr(w, method)(*args) for w in local]
        return ray.get(refs, timeout=timeout_s) + here

    return ExpertWorkers(call_all, len(handles) + len(local))


@dataclass(frozen=True)
class HomeWorker:
    """ExpertManager `worker`, one in master 0's process (`cluster.workers_on_master`), as another master process
    calls it: like an actor handle, each method has a `.remote` that returns an ObjectRef, here of the MasterActor
    `home`'s `call_local`. So the transports (object refs, the collective plane's joins) treat it as any worker."""

    home: Any
    worker: int

    def __getattr__(self, method: str) -> _HomeCall:
        if method.startswith("_"):  # pickling and copying probe dunder methods: not a worker's
            raise AttributeError(method)
        return _HomeCall(self.home, self.worker, method)


@dataclass(frozen=True)
class _HomeCall:
    home: Any
    worker: int
    method: str

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.home.call_local.remote(self.worker, self.method, *args, **kwargs)
