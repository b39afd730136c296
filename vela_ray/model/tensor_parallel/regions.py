"""The TP regions' operators: why regions instead of per-module collectives (and instead of DTensor for the
linear layers).

Each sharded block (attention; dense or shared-expert MLP) is a *TP region*: it is entered through an operator
that is the identity forward and one all-reduce backward (Megatron's `f`), and left through one that is one
all-reduce forward and the identity backward (`g`). Between the two, rank i computes a partial y_i = F_i(x) with
sum_i y_i the block's output, so the gradient of *anything replicated that the region uses* is the sum over
ranks of what each rank's backward computes: the block input's gradient, but equally the gradient of a
replicated LoRA factor (colwise lora_A: grad = x^T sum_i g_i B_i; rowwise lora_B: grad = sum_i u_i^T g) and of
the replicated low-rank projections of MLA. `f` takes those factors as inputs too (the region computes with
aliases `f` returns), so its single backward all-reduce carries [grad x, grad of every replicated trainable
factor] in one buffer: per layer, LoRA adds *no* collective to the base TP's two forward and two backward
all-reduces, only r*(d_in or d_out) elements per factor to the backward one, and every replicated factor ends
with the same, exact gradient on every rank (no per-parameter reduction afterwards).

torch's `ColwiseParallel`/`RowwiseParallel` cannot express this: each styled module owns its redistributes, so
a LoRA-wrapped colwise module all-reduces its input gradient itself (once for the base, once more for lora_B's
input, or a Partial gradient left on lora_A that needs its own all-reduce), and a rowwise one either all-reduces
lora_A's output or leaves lora_B's gradient Partial. Hence the small explicit `_EnterRegion`/`_ExitRegion`
operators (plain `torch.distributed` collectives, which `CommDebugMode` counts like DTensor's, and which run on
a group torch.distributed does not know as well as on one it does). The embedding and LM head, which LoRA does
not adapt, are sharded with torch's own plans (`vocab`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn


def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Sum `tensors` over `group` with one all-reduce per dtype (one in an fp32 or uniformly cast model)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]


class _EnterRegion(torch.autograd.Function):
    """Megatron's `f`: identity forward on the region's input and replicated trainable factors; backward sums
    all their gradients (each rank's is its heads'/columns' share) over the group in one all-reduce."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, x: torch.Tensor, *params: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (x, *params)]
        return (x.view_as(x), *(p.view_as(p) for p in params))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        wanted = [i for i, g in enumerate(grads) if ctx.needs_input_grad[i + 1]]
        dense = [grads[i] if grads[i] is not None else torch.zeros(ctx.shapes[i][0], dtype=ctx.shapes[i][1],
                                                                    device=ctx.shapes[i][2]) for i in wanted]
        summed = _all_reduce_flat([g.contiguous() for g in dense], ctx.group) if dense else []
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(wanted, summed):
            out[i] = g
        return (None, *out)


class _ExitRegion(torch.autograd.Function):
    """Megatron's `g`: sums the ranks' partial outputs forward (one all-reduce); identity backward (the full
    output gradient is what every rank's partial output receives)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, y: torch.Tensor):  # type: ignore[override]
        out = y.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return None, grad


@contextlib.contextmanager
def _aliased(module: nn.Module, names: list[str], tensors: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, `module`'s parameters `names` read as `tensors` (the aliases `_EnterRegion` returned,
    so their gradients pass through its all-reduce); the parameters are put back afterwards, whatever happens."""
    saved = []
    try:
        for name, tensor in zip(names, tensors):
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = tensor  # type: ignore[assignment]  # a non-leaf alias, for this call only
        yield
    finally:
        for owner, leaf, param in reversed(saved):
            owner._parameters[leaf] = param


class Region:
    """The forward of one TP region: `f` on the hidden states and replicated factors, the block's own forward
    on local shards, `g` on its (first) output."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, replicated: list[str]):
        self.module = module
        self.group = group
        self.inner = module.forward  # the block's own (bound) forward
        self.input_name = list(inspect.signature(type(module).forward).parameters)[1]  # after self
        self.replicated = replicated  # the block's replicated trainable parameters (names relative to it)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args_l = list(args)
        if args_l:
            hidden = args_l[0]
        else:
            hidden = kwargs[self.input_name]
        params = [self.module.get_parameter(n) for n in self.replicated]
        hidden, *aliases = _EnterRegion.apply(self.group, hidden, *params)
        if args_l:
            args_l[0] = hidden
        else:
            kwargs[self.input_name] = hidden
        with _aliased(self.module, self.replicated, aliases):
            out = self.inner(*args_l, **kwargs)
        if isinstance(out, tuple):
            return (_ExitRegion.apply(self.group, out[0]), *out[1:])
        return _ExitRegion.apply(self.group, out)
