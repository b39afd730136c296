"""Gradient norms and sums over the TP group: clipping reads the norm of the whole (unsharded) set of trainable
parameters, as a single master's, with sharded parameters' squares summed over the group and replicated ones
counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vela_ray.model.tensor_parallel.group import collective_device
from vela_ray.model.tensor_parallel.plan import TensorParallelPlan


def grad_sq_norm(model: nn.Module, plan: TensorParallelPlan) -> float:
    """The squared gradient norm of the whole (unsharded) set of `model`'s trainable parameters, on every rank:
    sharded ones' squares summed over the group (one all-reduce), replicated ones' counted once, each part in
    torch's fused kernels (`get_total_norm`, as a single master's `optim.grad_sq_norm`) with one host sync. Also a
    barrier: it returns only when every rank's backward has (so their brokers' backward calls have) ended."""
    from torch.nn.utils import get_total_norm

    sharded, replicated = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            (sharded if name in plan.sharded else replicated).append(p.grad.detach())
    sq = [float(get_total_norm(grads, 2.0)) ** 2 if grads else 0.0 for grads in (sharded, replicated)]
    return all_sum(sq[0], plan) + sq[1]


def all_sum(value: float, plan: TensorParallelPlan) -> float:
    """`value` summed over the TP group (every rank gets the sum): e.g. the experts' squared gradient norm, which
    only the group's first rank reads from the workers, the others adding 0."""
    buf = torch.tensor([value], dtype=torch.float64, device=collective_device(plan.group))
    dist.all_reduce(buf, group=plan.group)
    return float(buf.item())


def clip_grad_norm_(model: nn.Module, plan: TensorParallelPlan, max_norm: float | None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the whole (unsharded) set of trainable parameters (`grad_sq_norm`).
    Returns the norm."""
    total = torch.tensor(grad_sq_norm(model, plan)).sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in model.parameters():
            if p.requires_grad and p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
