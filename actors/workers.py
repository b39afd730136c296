"""The control plane (`vela_ray.training.expert_workers.ExpertWorkers`) over ExpertManager actors.

Every call fans out with one `.remote` per worker and waits with one `ray.get`, so the
workers step, zero and report their grad norms in parallel:

    workers = actor_workers(cluster.handles)
    train_step(master, workers, micro_batches, lr, max_grad_norm)

A call of one worker (`ActorCalls.one`) runs through the actor's `pass_on`: its answer is put in that worker's
object store and only a reference (`Stored`) comes back; passed as an argument of another worker's call, the
receiver fetches the value from the sender's object store. So replicated experts' gradient sums and live
migration's expert states go worker to worker, never through the master's process, however small (Ray would
return a small answer to its caller and inline it into the calls that take it, by way of this process).

The data plane (rows and gradients) goes through a transport (`actors.transports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import ray

from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.expert_workers import ExpertWorkers


def actor_workers(handles: Sequence[Any], timeout_s: float | None = None, local: Sequence[Any] = ()
                  ) -> ExpertWorkers:
    """ExpertWorkers over actor handles; `handles[n]` is worker n, and `local[i]` (ExpertManagers in this
    process, `cluster.workers_on_master`) worker len(handles) + i, called while the actors work."""
    return ExpertWorkers(ActorCalls(list(handles), list(local), timeout_s), len(handles) + len(local))


@dataclass(frozen=True)
class Stored:
    """A worker's answer kept in its own object store (`ExpertManagerActor.pass_on`): what its caller holds."""

    ref: ray.ObjectRef


class ExpertManagerActor(ExpertManager):
    """The ExpertManager as a Ray actor (`actors.cluster`): the plain class, plus calls whose answers stay on it."""

    def pass_on(self, method: str, *args: Any) -> Stored:
        """`method(*args)`, each `Stored` argument (another worker's answer) fetched from its worker's object store,
        the answer put in this worker's: the caller gets a reference, never the bytes, however small."""
        values = [ray.get(a.ref) if isinstance(a, Stored) else a for a in args]
        return Stored(ray.put(getattr(self, method)(*values)))


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
        """An actor's pending answer (the ObjectRef of its `pass_on`: a `Stored` reference, the bytes left on the
        actor), or the value of a worker in this process, called now with the values of pending arguments (it is
        in this process: those bytes do come here)."""
        if worker < len(self.handles):
            return self.handles[worker].pass_on.remote(method, *args)
        return getattr(self.local[worker - len(self.handles)], method)(*self.wait(list(args)))

    def wait(self, pending: list[Any]) -> list[Any]:
        refs = [p for p in pending if isinstance(p, ray.ObjectRef)]
        stored = ray.get(refs, timeout=self.timeout_s) if refs else []
        values = iter(ray.get([s.ref for s in stored], timeout=self.timeout_s) if stored else [])
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
