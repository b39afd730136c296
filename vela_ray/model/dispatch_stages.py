"""The broker's dispatch stages: the plan and the call they pass along, their protocol, and the relay and probe.

An `ExpertDispatcher` runs an ordered tuple of stages for every broker call (torchtitan's expert-parallel
`_token_dispatch` -> compute -> `_token_combine`, one pair per feature): each stage's `dispatch` in order, then
each stage's `combine` in reverse, so a stage that narrows or decides something on the way out undoes or uses
it on the way back. The order, and where each stage lives:

  1. `tensor_parallel.TensorParallelShare`: this TP rank's share of the tokens / the group's outputs gathered;
  2. `checkpoint_replay.CheckpointReplay`: a checkpointed layer's recompute takes the first forward's
     decisions and outputs / the first forward records them;
  3. `broker.PlanRows`: the (token, k) rows grouped by worker, a key, the routing weights / rows back to their
     tokens, weighted;
  4. `RelayRows` (here): where each row's output goes (sequence migration) / the relayed rows' weights told;
  5. `condensation.Condensation`: which rows travel (LOSSY, opt-in) / every row takes its representative's;
  6. `broker.SendRows`: the rows to their workers and back (`_RemoteExperts`); while they are away, the block's
     shared expert computes on the calling thread (`shared_expert.SharedExpert`, `training.overlap.shared_experts`).

`StandIn` (here) replaces them all while a probe runs (`ExpertDispatcher.probing`).

Legend: T = tokens, D = hidden, K = top-k, R = routed rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from vela_ray.model.shared_expert import SharedExpert


@dataclass(frozen=True)
class DispatchPlan:
    """Where each routed row of one layer goes; rows are ordered by (worker, expert)."""

    layer: int
    token_idx_R: torch.Tensor  # [R] token of each row
    k_pos_R: torch.Tensor  # [R] which of the token's top-k slots
    expert_ids_R: torch.Tensor  # [R] expert within the layer
    worker_rows: tuple[tuple[int, int, int], ...]  # (worker, start, end) for workers with rows
    # [R] the master each row's output goes to, -1 this one (sequence migration's `RelayRows`; None: all here)
    reply_to_R: torch.Tensor | None = None
    adapters: bool = True  # False: the base model's experts answer (`experts.without_adapters`)

    def subset(self, keep_R: torch.Tensor) -> DispatchPlan:
        """The plan of the rows where `keep_R` [R] bool, in the same (worker, expert) order."""
        ends = [0, *torch.cumsum(keep_R.long(), 0).tolist()]
        worker_rows = tuple((w, ends[s], ends[e]) for w, s, e in self.worker_rows if ends[e] > ends[s])
        return DispatchPlan(self.layer, self.token_idx_R[keep_R], self.k_pos_R[keep_R], self.expert_ids_R[keep_R],
                            worker_rows, None if self.reply_to_R is None else self.reply_to_R[keep_R], self.adapters)

    @property
    def worker_R(self) -> torch.Tensor:
        """[R] the worker of each row."""
        if not self.worker_rows:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.full((e - s,), w, dtype=torch.long) for w, s, e in self.worker_rows])

    @property
    def kept_R(self) -> torch.Tensor | None:
        """[R] bool: the rows whose outputs come back here (None: all of them)."""
        return None if self.reply_to_R is None else self.reply_to_R < 0

    def reply_to(self, start: int, end: int) -> torch.Tensor | None:
        """`ForwardRequest.reply_to` of rows start:end (None when all come back here)."""
        if self.reply_to_R is None or not bool((self.reply_to_R[start:end] >= 0).any()):
            return None
        return self.reply_to_R[start:end]


@dataclass(frozen=True)
class BrokerCall:
    """One broker call at one MoE layer: its inputs, then what the stages decided (None until a stage has)."""

    layer: int
    hidden_TD: torch.Tensor
    top_k_index_TK: torch.Tensor
    top_k_weights_TK: torch.Tensor
    whole_tokens: int  # tokens the broker was called with (a tensor-parallel share's call holds fewer)
    token_T: torch.Tensor | None = None  # the model's token of each row of hidden_TD when they differ (grouped calls)
    track_grad: bool = False  # a forward with a backward: its rows get a key and their gradients travel
    training: bool = False  # the broker's training mode (condensation leaves eval forwards exact)
    in_checkpoint: bool = False  # inside a checkpointed layer (`CheckpointReplay`)
    shared: SharedExpert | None = None  # the block's shared expert, computed while the rows are away (`SendRows`)
    plan: DispatchPlan | None = None  # every routed row
    sent: DispatchPlan | None = None  # the rows that travel (the plan's, or condensation's representatives)
    key: tuple[int, int] | None = None  # the forward the workers save for its backward
    selection: object | None = None  # `condensation.Selection`, or None
    weights_R: torch.Tensor | None = None  # [R] the plan rows' routing weights, in the graph
    token_idx_R: torch.Tensor | None = None  # [R] the plan rows' tokens on hidden_TD's device (copied there once)
    replayed_RD: torch.Tensor | None = None  # a recompute's copy of the first forward's outputs of `sent`
    shared_meanwhile: bool = False  # `SendRows` computed the shared expert (a recompute: its first forward did)
    expert_out_RD: torch.Tensor | None = None  # the outputs of `sent`'s rows, once sent

    @classmethod
    def of(cls, layer: int, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
           token_T: torch.Tensor | None, training: bool, shared: SharedExpert | None = None) -> BrokerCall:
        """A call as a broker makes it (grad tracking read here, once)."""
        return cls(layer, hidden_TD, top_k_index_TK, top_k_weights_TK, hidden_TD.shape[0], token_T,
                   torch.is_grad_enabled(), training, shared=shared)


class DispatchStage(Protocol):
    """One step of every broker call (module docstring)."""

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        """On the way out: the call, narrowed or with this stage's decisions added."""
        ...

    def combine(self, call: BrokerCall, out: torch.Tensor) -> torch.Tensor:
        """On the way back (`call` as the last stage left it): `out` as the stages before this one need it;
        [R, D] rows inside `PlanRows`, [T, D] tokens outside."""
        ...


class RowRouter(Protocol):
    """Sees every plan a broker makes in a training forward and may send some rows' outputs to other
    masters (`vela_ray.training.sequence_migration.SequenceMigration`, LUFFY's combine where the sequence goes)."""

    def reply_to(self, plan: DispatchPlan, token_T: torch.Tensor | None, hidden_size: int) -> torch.Tensor | None:
        """[R] the master each row's output goes to (-1: this one), or None for all here."""
        ...

    def relayed(self, plan: DispatchPlan, key, weights_R: torch.Tensor) -> None:
        """The relayed forward went out under `key`; `weights_R` [R] are its rows' routing weights (autograd)."""
        ...


class RelayRows:
    """Sequence migration's stage (`ExpertDispatcher.relay_rows`): a training forward's plan asks `router` where
    each row's output goes; the workers answer rows bound elsewhere to that master (`DispatchPlan.reply_to_R`),
    they come back here as zeros, and the router takes their routing weights along. A recompute relays nothing:
    its first forward did."""

    def __init__(self, router: RowRouter):
        self.router = router

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        if call.replayed_RD is not None or not call.track_grad:
            return call
        reply_to_R = self.router.reply_to(call.plan, call.token_T, call.hidden_TD.shape[-1])
        plan = replace(call.plan, reply_to_R=reply_to_R)
        return replace(call, plan=plan, sent=plan)

    def combine(self, call: BrokerCall, out: torch.Tensor) -> torch.Tensor:
        if call.replayed_RD is None and call.sent.reply_to_R is not None:
            self.router.relayed(call.sent, call.key, call.weights_R)
        return out


class StandIn:
    """The only stage while a probe runs (`ExpertDispatcher.probing`): the broker answers `answer(hidden_TD)`
    for its experts; nothing is planned, keyed, sent or counted."""

    def __init__(self, answer: Callable[[torch.Tensor], torch.Tensor]):
        self.answer = answer

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        return call

    def combine(self, call: BrokerCall, out: torch.Tensor | None) -> torch.Tensor:
        return self.answer(call.hidden_TD)

