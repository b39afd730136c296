"""Data-parallel replicas of the master: the one hook `train_step` and `eval_loss` take for them.

A step may run on several replicas of the master's backbone at once, each on its own
shard of the batch and each with its own, disjoint expert workers: today the
expert-parallel baseline's ranks (`vela_ray.baselines.expert_parallel`), later
data-parallel masters. The step itself is the same; the replicas only have to agree
on two things, and `Replicas` is exactly those two:

    sync_grads(params)  sum the backbone LoRA gradients over replicas (after backward,
                        before clipping), so every replica takes the same optimizer step;
    sum(value)          sum a scalar over replicas: the experts' squared gradient norms
                        (for global clipping) and the replicas' shares of the loss.

A lone master is `SINGLE` (identity), the default of `train_step`; `ProcessGroupReplicas`
all-reduces over a torch.distributed group (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn


class Replicas(Protocol):
    """What `train_step`/`eval_loss` need from the other replicas (every call is collective)."""

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None: ...

    def sum(self, value: float) -> float: ...


class SingleReplica:
    """One master, no other replicas: nothing to sync, a sum is the value itself."""

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        pass

    def sum(self, value: float) -> float:
        return value


SINGLE = SingleReplica()


class ProcessGroupReplicas:
    """Replicas as the ranks of a torch.distributed process group; counts the gradient all-reduce bytes."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.grad_bytes = 0  # backbone LoRA gradients all-reduced so far, as this rank sent them

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Sum the gradients over ranks in one flat buffer (one collective, not one per tensor)."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        self.grad_bytes += flat.numel() * flat.element_size()
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()

    def sum(self, value: float) -> float:
        """The float64 sum over ranks (NCCL reduces only device tensors)."""
        tensor = torch.tensor([value], dtype=torch.float64)
        if dist.get_backend(self.group) == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor, group=self.group)
        return float(tensor.item())
