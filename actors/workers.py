"""The control plane (`vela_ray.training.expert_workers.ExpertWorkers`) over ExpertManager actors.

Every call fans out with one `.remote` per worker and waits with one `ray.get`, so the
workers step, zero and report their grad norms in parallel:

    workers = actor_workers(cluster.handles)
    train_step(master, workers, micro_batches, lr, max_grad_norm)

A call of one worker answers an ObjectRef (`ActorCalls.one`): passed as an argument of another worker's call,
Ray hands that worker the value, which the master never waits for nor deserializes (replicated experts' gradient
sums, live migration's expert states). A value above `data_plane.inline_bytes` goes from the object store of the
actor that made it to the receiver's; a smaller one rides inside Ray's own messages, by way of this process (Ray
returns small results to their caller and inlines them into the calls that take them).

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
    return ExpertWorkers(ActorCalls(list(handles), list(local), timeout_s), len(handles) + len(local))


@dataclass(frozen=True)
class ActorCalls:
    """`WorkerCalls` of ExpertManager actors (`handles[n]` is worker n) and, after them, ExpertManagers in this
    process (`local`). Every wait gives up after `timeout_s` (None: never)."""

    handles: list[Any]
    local: list[Any]
    timeout_s: float | None = None

    def all(self, method: str, *args: Any) -> list[Any]:
        # A dict argument (an adapter state) is stored once in the object store, not once per worker.
        stored = tuple(ray.put(a) if isinstance(a, dict) and self.handles else a for a in args)
        refs = [getattr(h, method).remote(*stored) for h in self.handles]
        here = [getattr(w, method)(*args) for w in self.local]
        return ray.get(refs, timeout=self.timeout_s) + here

    def one(self, worker: int, method: str, *args: Any) -> Any:
        """An actor's ObjectRef, or the value of a worker in this process, called now with the values of
        ObjectRef arguments (it is in this process: those bytes do come here)."""
        if worker < len(self.handles):
            return getattr(self.handles[worker], method).remote(*args)
        return getattr(self.local[worker - len(self.handles)], method)(*self.wait(list(args)))

    def wait(self, pending: list[Any]) -> list[Any]:
        refs = [p for p in pending if isinstance(p, ray.ObjectRef)]
        values = iter(ray.get(refs, timeout=self.timeout_s) if refs else [])
        return [next(values) if isinstance(p, ray.ObjectRef) else p for p in pending]


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
