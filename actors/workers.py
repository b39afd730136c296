"""The control plane (`vela_ray.training.step.ExpertWorkers`) over ExpertManager actors.

Every call fans out with one `.remote` per worker and waits with one `ray.get`, so the
workers step, zero and report their grad norms in parallel:

    workers = actor_workers(cluster.handles)
    train_step(master, workers, micro_batches, lr, max_grad_norm)

The data plane (rows and gradients) goes through a transport (`actors.transports`).
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

from vela_ray.training.step import ExpertWorkers


def actor_workers(handles: Sequence[Any], timeout_s: float | None = None) -> ExpertWorkers:
    """ExpertWorkers over actor handles; `handles[n]` is worker n."""
    handles = list(handles)

    def call_all(method: str, *args: Any) -> list[Any]:
        # A dict argument (an adapter state) is stored once in the object store, not once per worker.
        args = tuple(ray.put(a) if isinstance(a, dict) else a for a in args)
        return ray.get([getattr(h, method).remote(*args) for h in handles], timeout=timeout_s)

    return ExpertWorkers(call_all, len(handles))
