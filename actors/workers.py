"""RayWorkers: the control plane (`vela_ray.training.step.ExpertWorkers`) over ExpertManager actors.

Every call fans out with one `.remote` per worker and waits with one `ray.get`,
so the workers step, zero and report their grad norms in parallel:

    workers = RayWorkers(cluster.handles)
    train_step(master, workers, micro_batches, lr, max_grad_norm)

The data plane (rows and gradients) goes through a transport (`actors.transports`).
"""

from __future__ import annotations

from typing import Any, Sequence

import ray
import torch

from vela_ray.model.experts import ExpertKey

LoraState = dict[ExpertKey, dict[str, torch.Tensor]]


class RayWorkers:
    """ExpertWorkers over actor handles; `handles[n]` is worker n."""

    def __init__(self, handles: Sequence[Any], timeout_s: float | None = None):
        self.handles = list(handles)
        self.timeout_s = timeout_s

    def grad_sq_norm(self) -> float:
        """Sum over workers of their experts' squared gradient norms."""
        return float(sum(self._all("grad_sq_norm")))

    def step(self, lr: float, clip_coef: float) -> None:
        self._all("step", lr, clip_coef)

    def zero_grad(self) -> None:
        self._all("zero_grad")

    def lora_state(self) -> LoraState:
        """All experts' adapters, keyed by logical (layer, expert)."""
        state: LoraState = {}
        for part in self._all("lora_state"):
            state.update(part)
        return state

    def load_lora_state(self, state: LoraState) -> None:
        """Each worker takes its own experts from `state`, stored once in the object store."""
        self._all("load_lora_state", ray.put(state))

    def ping(self) -> list[int]:
        return self._all("ping")

    def _all(self, method: str, *args: Any) -> list[Any]:
        refs = [getattr(handle, method).remote(*args) for handle in self.handles]
        return ray.get(refs, timeout=self.timeout_s)
