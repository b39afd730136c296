"""The routed experts over a TP group: each rank sends a disjoint share of a MoE layer's rows.

A TP group's MoE blocks see replicated inputs; if every rank dispatched all of them, each row (and its expert
gradients) would reach the ExpertManagers once per rank. On a TP rank each broker sends only its share of the
layer's tokens (`TensorParallelShare`: `_ShareRows` in, `_GatherRows` out, an all-gather each way), so the
group's rows leave once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vela_ray.model.tensor_parallel.plan import TensorParallelPlan

if TYPE_CHECKING:
    from vela_ray.model.dispatch_stages import BrokerCall


def row_bounds(num_rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [lo, hi) of `num_rows` rows: sizes differ by at most one, the first
    `num_rows % size` ranks taking one more."""
    base, extra = divmod(num_rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _all_gather_rows(part: torch.Tensor, num_rows: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The ranks' row shares (`row_bounds`) of a [num_rows, ...] tensor, concatenated in rank order: one all-gather,
    of shares padded to the largest."""
    longest = -(-num_rows // size)
    padded = part.new_zeros((longest, *part.shape[1:]))
    padded[: len(part)] = part
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[: hi - lo] for piece, (lo, hi) in
                      zip(pieces, (row_bounds(num_rows, r, size) for r in range(size)))])


class _ShareRows(torch.autograd.Function):
    """This rank's rows of a replicated tensor; backward all-gathers the shares' gradients, so the replicated
    tensor's gradient is whole, and equal, on every rank."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, rank: int, size: int, x: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.size, ctx.num_rows = group, size, x.shape[0]
        lo, hi = row_bounds(x.shape[0], rank, size)
        return x[lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return None, None, None, _all_gather_rows(grad.contiguous(), ctx.num_rows, ctx.group, ctx.size)


class _GatherRows(torch.autograd.Function):
    """Every rank's share of the rows, concatenated (one all-gather); backward keeps this rank's rows of the
    (replicated, equal on every rank) gradient."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, rank: int, size: int, num_rows: int,  # type: ignore[override]
                part: torch.Tensor):
        ctx.bounds = row_bounds(num_rows, rank, size)
        return _all_gather_rows(part.contiguous(), num_rows, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        lo, hi = ctx.bounds
        return None, None, None, None, grad[lo:hi]


class TensorParallelShare:
    """The broker's first stage on a rank of a tensor-parallel master (`ExpertDispatcher.share_rows`), for MoE
    blocks whose inputs are replicated over the TP group: this rank dispatches its share of the tokens
    (`row_bounds`), so the group's rows leave through all its ranks, each row once, and the combined outputs are
    gathered (one all-gather forward; one for the hidden states' and routing weights' gradients backward).
    Exact: every token's output is computed once, by one rank, as it would be whole; the experts' LoRA gradients
    reach the workers once. Experts called on grouped rows are refused beforehand (`refuse_grouped_experts`)."""

    def __init__(self, plan: TensorParallelPlan):
        self.plan = plan

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        if self.plan.size == 1:
            return call
        group, rank, size = self.plan.group, self.plan.rank, self.plan.size
        lo, hi = row_bounds(call.whole_tokens, rank, size)
        token_T = torch.arange(lo, hi) if call.token_T is None else call.token_T[lo:hi]  # the model's tokens
        return replace(call, hidden_TD=_ShareRows.apply(group, rank, size, call.hidden_TD), token_T=token_T,
                       top_k_index_TK=call.top_k_index_TK[lo:hi],
                       top_k_weights_TK=_ShareRows.apply(group, rank, size, call.top_k_weights_TK))

    def combine(self, call: BrokerCall, out_TD: torch.Tensor) -> torch.Tensor:
        if self.plan.size == 1:
            return out_TD
        return _GatherRows.apply(self.plan.group, self.plan.rank, self.plan.size, call.whole_tokens, out_TD)


def refuse_grouped_experts(layouts: list, size: int) -> None:
    """A master split over `size` ranks shares each MoE layer's rows among them (`TensorParallelShare`), which needs
    experts called on routed rows: ValueError (one line) for a model whose experts are called on rows grouped by
    expert (`modeling.ExpertsLayout.call`, e.g. Llama 4)."""
    grouped = [layout for layout in layouts if layout.call != "routed"]
    if grouped:
        raise ValueError(f"cluster.master_tp: {size} needs experts called on routed rows; "
                         f"{grouped[0].experts_class} is called on rows grouped by expert: use master_tp: 1")
