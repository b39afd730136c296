"""ExpertBroker: stands in for a MoE block's `experts` and sends tokens to wherever experts live.

Legend: T = tokens, D = hidden, K = top-k, R = routed rows (one per valid
(token, k) pair), E = experts per layer, N = workers.

Stages of `ExpertBroker.forward(hidden_TD, top_k_index_TK, top_k_weights_TK)`:
  1. plan: group the (token, k) pairs by owning worker, then by expert, using the
     placement table [L, E] -> worker (`ExpertDispatcher.plan`);
  2. dispatch + gather through the transport inside `_RemoteExperts`, a custom
     autograd Function: its backward sends d(outputs) to the owners and gathers
     d(rows), so LoRA gradients accumulate on the workers;
  3. combine on the master: out_TD = sum_k weight_TK * expert_out, in autograd, so
     the router's inputs get their gradient as in the original module.

With several masters' sequence migration (the dispatcher's `RowRouter`), a plan may send some rows'
outputs to another master (`DispatchPlan.reply_to_R`: a sequence leaving this master after the layer,
LUFFY's combine where it goes): those rows come back here as zeros, their gradients are that master's
to send, and the router takes their routing weights along (`RowRouter.relayed`).

The arithmetic equals the original experts module; only where it runs changes. Two
exceptions are opt-in and LOSSY: with a `condensation.Condenser` on the dispatcher, training
forwards send only a representative of each group of similar rows of one expert (stage 2)
and every row takes its representative's output (`ExpertBroker._condense`); with a low-bit
`row_format` (`vela_ray.model.wire`) rows, results and gradients travel in bf16 or fp8.
Traffic is counted here, once, for every transport, in the bytes that travel.

On a rank of a tensor-parallel master (`ExpertDispatcher.share_rows`) a broker runs these stages on its share of
the layer's tokens only and gathers the group's combined outputs (`tensor_parallel.routed_share`), so each row
leaves the group once.

Activation checkpointing (`recompute_contexts`, torch's non-reentrant checkpoint around decoder
layers): a checkpointed layer runs its forward twice, once in the forward pass and again in backward
to rebuild what it saved. The first broker call records its plan, key and the experts' output; the
recompute replays them, so no row crosses the data plane a second time, the routing is counted
once, and backward still goes through the first call's `_RemoteExperts` node and its key.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from vela_ray.model import wire
from vela_ray.model.tensor_parallel import routed_share
from vela_ray.model.traffic import TrafficCounter
from vela_ray.model.transport import ForwardRequest, RowRelay, Transport


@dataclass(frozen=True)
class DispatchPlan:
    """Where each routed row of one layer goes; rows are ordered by (worker, expert)."""

    layer: int
    token_idx_R: torch.Tensor  # [R] token of each row
    k_pos_R: torch.Tensor  # [R] which of the token's top-k slots
    expert_ids_R: torch.Tensor  # [R] expert within the layer
    worker_rows: tuple[tuple[int, int, int], ...]  # (worker, start, end) for workers with rows
    # [R] the master each row's output goes to, -1 this one (sequence migration's `RowRouter`; None: all here)
    reply_to_R: torch.Tensor | None = None

    def subset(self, keep_R: torch.Tensor) -> DispatchPlan:
        """The plan of the rows where `keep_R` [R] bool, in the same (worker, expert) order."""
        ends = [0, *torch.cumsum(keep_R.long(), 0).tolist()]
        worker_rows = tuple((w, ends[s], ends[e]) for w, s, e in self.worker_rows if ends[e] > ends[s])
        return DispatchPlan(self.layer, self.token_idx_R[keep_R], self.k_pos_R[keep_R], self.expert_ids_R[keep_R],
                            worker_rows, None if self.reply_to_R is None else self.reply_to_R[keep_R])

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


class RowRouter(Protocol):
    """Sees every plan a broker makes in a training forward and may send some rows' outputs to other
    masters (`vela_ray.training.sequence_migration.SequenceMigration`, LUFFY's combine where the sequence goes)."""

    def reply_to(self, plan: DispatchPlan, token_T: torch.Tensor | None, hidden_size: int) -> torch.Tensor | None:
        """[R] the master each row's output goes to (-1: this one), or None for all here."""
        ...

    def relayed(self, plan: DispatchPlan, key, weights_R: torch.Tensor) -> None:
        """The relayed forward went out under `key`; `weights_R` [R] are its rows' routing weights (autograd)."""
        ...


class ExpertDispatcher:
    """Shared by all brokers of a model: the placement table, the transport and the counters."""

    def __init__(self, expert_to_worker: torch.Tensor, transport: Transport, counter: TrafficCounter | None = None,
                 *, master: int = 0, num_masters: int = 1, row_format: wire.RowFormat = "exact",
                 latency=None, condenser=None):
        """`master` of `num_masters`: data-parallel masters share the workers, so each numbers the forwards
        it saves there (`new_key`) in its own residue class: master, master + M, ...
        `row_format`: how rows travel (`vela_ray.model.wire`; LOSSY unless exact).
        `latency`: anything with .observe(layer, seconds, phase), e.g. `metrics.MetricsSink.latency`.
        `condenser`: LOSSY, a `condensation.Condenser` (token condensation in training forwards)."""
        table = torch.as_tensor(expert_to_worker, dtype=torch.long)
        if table.dim() != 2:
            raise ValueError(f"expert_to_worker must be [layers, experts], got shape {tuple(table.shape)}")
        if table.numel() and (table.min() < 0 or table.max() >= transport.num_workers):
            raise ValueError(
                f"expert_to_worker names workers {table.min().item()}..{table.max().item()} "
                f"but the transport has {transport.num_workers}"
            )
        self.expert_to_worker = table
        self.transport = transport
        self.row_format = row_format
        num_layers = table.shape[0]
        self.counter = counter or TrafficCounter(num_layers, transport.num_workers, transport.worker_tiers(),
                                                 num_experts=table.shape[1])
        self.latency = latency
        self.condenser = condenser
        # optional `RowRouter`: sees every plan a broker makes (sequence migration)
        self.router: RowRouter | None = None
        self.master = master
        # a `tensor_parallel.TensorParallelPlan` when this master is one rank of a TP group (`cluster.master_tp`):
        # each broker then sends only this rank's share of its layer's rows (`tensor_parallel.routed_share`)
        self.tp = None
        # Seconds the master spent waiting on the transport, per phase: communication plus the
        # workers' expert compute, i.e. the part of a step that the placement can change.
        self.round_trip_s = {"forward": 0.0, "backward": 0.0}
        self._keys = itertools.count(master, num_masters)

    def share_rows(self, plan) -> None:
        """From now on every broker sends only this TP rank's share of its layer's rows (`plan`: this master's
        `tensor_parallel.TensorParallelPlan`) and gathers the group's combined outputs."""
        self.tp = plan

    def rebind(self, expert_to_worker, transport: Transport | None = None) -> None:
        """Point every broker at a new placement table (after a migration), and at a new transport if
        given (after lost workers were replaced). One assignment each, between steps; the traffic
        counts go on unless the worker count changed."""
        table = torch.as_tensor(expert_to_worker, dtype=torch.long)
        if table.shape != self.expert_to_worker.shape:
            raise ValueError(f"new placement is {tuple(table.shape)}, expected {tuple(self.expert_to_worker.shape)}")
        transport = transport or self.transport
        if transport.num_workers != self.transport.num_workers:
            self.counter = TrafficCounter(table.shape[0], transport.num_workers, transport.worker_tiers(),
                                          num_experts=table.shape[1])
        self.expert_to_worker, self.transport = table, transport

    @property
    def num_experts(self) -> int:
        return self.expert_to_worker.shape[1]

    def plan(self, layer: int, top_k_index_TK: torch.Tensor) -> DispatchPlan:
        """Where one forward's (token, k) pairs at `layer` go, grouped by worker; the pairs are counted
        in `counter.routed` (the one routing count: step records, drift and re-placement read it)."""
        top_k = top_k_index_TK.shape[1]
        expert_P = top_k_index_TK.reshape(-1).to(torch.long).cpu()
        pair_R = torch.nonzero(expert_P < self.num_experts).squeeze(1)  # ids >= E mark dropped slots
        expert_R = expert_P[pair_R]
        self.counter.route(layer, expert_R.numpy())
        worker_R = self.expert_to_worker[layer][expert_R]
        order = torch.argsort(worker_R * self.num_experts + expert_R, stable=True)
        pair_R, expert_R, worker_R = pair_R[order], expert_R[order], worker_R[order]
        counts = torch.bincount(worker_R, minlength=self.transport.num_workers).tolist()
        ends = list(itertools.accumulate(counts))
        worker_rows = tuple((w, ends[w] - c, ends[w]) for w, c in enumerate(counts) if c > 0)
        return DispatchPlan(layer, pair_R // top_k, pair_R % top_k, expert_R, worker_rows)

    def new_key(self, layer: int) -> tuple[int, int]:
        return (next(self._keys), layer)

    def _observe(self, layer: int, start: float, phase: str) -> None:
        seconds = time.perf_counter() - start
        self.round_trip_s[phase] += seconds
        if self.latency is not None:
            self.latency.observe(layer, seconds, phase)

    def _count(self, layer: int, direction, parts: dict[int, torch.Tensor]) -> None:
        for worker, tensor in parts.items():
            self.counter.record(layer, worker, direction, tensor.shape[0], tensor.numel() * tensor.element_size())

    def forward(self, plan: DispatchPlan, rows_RD: torch.Tensor, key) -> torch.Tensor:
        """The experts' outputs [R, D] of the plan's rows; zeros where a row's output went to another master."""
        if plan.reply_to_R is not None and not isinstance(self.transport, RowRelay):
            raise ValueError(f"the {self.transport.describe()} data plane cannot answer rows to another master")
        requests = {
            w: ForwardRequest(plan.layer, plan.expert_ids_R[s:e], wire.encode(rows_RD[s:e], self.row_format), key,
                              plan.reply_to(s, e))
            for w, s, e in plan.worker_rows
        }
        self._count(plan.layer, "dispatch", {w: r.rows for w, r in requests.items()})
        start = time.perf_counter()
        outputs = self.transport.forward(requests)
        self._observe(plan.layer, start, "forward")
        self._count(plan.layer, "gather", outputs)
        out_RD = _concat_in_plan_order(plan, outputs, rows_RD)
        kept_R = plan.kept_R
        if kept_R is None:
            return out_RD
        return rows_RD.new_zeros(rows_RD.shape).index_put_((kept_R.to(rows_RD.device),), out_RD)

    def backward(self, plan: DispatchPlan, grad_RD: torch.Tensor, key) -> torch.Tensor:
        """d(rows) [R, D]; the gradients of rows answered to other masters are theirs to send (`deposit`)."""
        kept_R = plan.kept_R
        if kept_R is not None:
            kept_R = kept_R.to(grad_RD.device)
        grads = {w: wire.encode((grad_RD[s:e] if kept_R is None else grad_RD[s:e][kept_R[s:e]]).contiguous(),
                                self.row_format)
                 for w, s, e in plan.worker_rows}
        self._count(plan.layer, "grad_dispatch", grads)
        start = time.perf_counter()
        grad_rows = self.transport.backward(key, grads)
        self._observe(plan.layer, start, "backward")
        self._count(plan.layer, "grad_gather", grad_rows)
        return _concat_in_plan_order(plan, grad_rows, grad_RD)

    def collect(self, layer: int, key, workers: list[int], like: torch.Tensor) -> torch.Tensor:
        """The outputs another master's relayed forward (`key`) left on `workers` for this master, in worker
        order, as `like`'s dtype and device; counted as this master's gather."""
        start = time.perf_counter()
        parts = self.transport.collect(key, self.master, workers)
        self._observe(layer, start, "forward")
        self._count(layer, "gather", parts)
        return torch.cat([like.new_zeros((0, like.shape[-1])),
                          *(wire.decode(parts[w].to(like.device), like.dtype) for w in workers)])

    def deposit(self, layer: int, key, grads: dict[int, torch.Tensor]) -> None:
        """Send each worker the d(outputs) of the rows it answered here under `key` (this master's grad dispatch)."""
        encoded = {w: wire.encode(g.contiguous(), self.row_format) for w, g in grads.items()}
        self._count(layer, "grad_dispatch", encoded)
        start = time.perf_counter()
        self.transport.deposit(key, self.master, encoded)
        self._observe(layer, start, "backward")


def _concat_in_plan_order(plan: DispatchPlan, parts: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not plan.worker_rows:
        return like.new_zeros((0, *like.shape[1:]))
    return torch.cat([wire.decode(parts[w].to(like.device), like.dtype) for w, _, _ in plan.worker_rows])


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _RemoteExperts(torch.autograd.Function):
    """rows -> expert outputs, computed wherever the experts live; backward goes there too.
    `replayed`: a checkpoint's recompute, which returns the first forward's output and sends nothing
    (its node's backward never runs: backward goes through the first forward's node)."""

    @staticmethod
    def forward(ctx, hidden_TD, grad_anchor, dispatcher: ExpertDispatcher, plan: DispatchPlan, key,
                replayed: torch.Tensor | None = None):
        ctx.dispatcher, ctx.plan, ctx.key, ctx.num_tokens = dispatcher, plan, key, hidden_TD.shape[0]
        if replayed is not None:
            return replayed.detach()
        rows_RD = hidden_TD.index_select(0, plan.token_idx_R.to(hidden_TD.device))
        return dispatcher.forward(plan, rows_RD, key)

    @staticmethod
    def backward(ctx, grad_out_RD):
        grad_rows_RD = ctx.dispatcher.backward(ctx.plan, grad_out_RD.contiguous(), ctx.key)
        grad_TD = grad_rows_RD.new_zeros(ctx.num_tokens, grad_rows_RD.shape[1])
        grad_TD.index_add_(0, ctx.plan.token_idx_R.to(grad_TD.device), grad_rows_RD)
        return grad_TD, None, None, None, None, None


@dataclass
class _BrokerCall:
    """What a broker call in a checkpointed layer's first forward decided and got back."""

    plan: DispatchPlan
    selection: object  # condensation's selection, or None
    sent: DispatchPlan
    key: tuple[int, int]
    expert_out_RD: torch.Tensor  # detached: the recompute's copy of the first forward's output


class _LayerCalls:
    """The broker calls of one checkpointed layer call: recorded in its forward, replayed in order
    in its recompute, each dropped once replayed."""

    def __init__(self):
        self.calls: list[_BrokerCall | None] = []
        self.replaying = False
        self.next = 0

    @contextlib.contextmanager
    def active(self, replaying: bool):
        self.replaying, self.next = replaying, 0
        token = _CHECKPOINTED_LAYER.set(self)
        try:
            yield
        finally:
            _CHECKPOINTED_LAYER.reset(token)

    def replay(self) -> _BrokerCall:
        if self.next >= len(self.calls) or self.calls[self.next] is None:
            raise RuntimeError("a checkpointed layer's recompute called the expert broker more often than its "
                               "forward did (its routing is not deterministic?)")
        call, self.calls[self.next] = self.calls[self.next], None
        self.next += 1
        return call


_CHECKPOINTED_LAYER: contextvars.ContextVar[_LayerCalls | None] = contextvars.ContextVar(
    "vela_checkpointed_layer", default=None)


def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` for decoder layers with brokers: the layer's forward records
    its broker calls, its recompute in backward replays them (see the module docstring)."""
    layer = _LayerCalls()
    return layer.active(replaying=False), layer.active(replaying=True)


def grouped_routing(grouped_XD: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their experts) that a grouped call `experts(x)` routes: x [E*T, D] holds expert e's inputs in
    rows e*T:(e+1)*T, pre-scaled by the routing score, so exactly the non-zero rows were routed."""
    rows_R = grouped_XD.detach().ne(0).any(dim=1).nonzero().squeeze(1)
    return rows_R, torch.div(rows_R, grouped_XD.shape[0] // num_experts, rounding_mode="floor")


class ExpertBroker(nn.Module):
    """Drop-in replacement for a MoE block's `experts`: same call, experts elsewhere."""

    def __init__(self, layer: int, dispatcher: ExpertDispatcher, layout=None):
        super().__init__()
        self.layer = layer
        self.dispatcher = dispatcher
        self.layout = layout  # modeling.ExpertsLayout of the experts this broker stands in for

    def forward(self, hidden_TD: torch.Tensor, *index_and_weights: torch.Tensor, **by_name: torch.Tensor):
        """`experts(hidden, top_k_index, top_k_weights)`, positional or under the family's names
        (e.g. gpt-oss's `router_indices=`, `routing_weights=`)."""
        if self.layout is not None and self.layout.call == "grouped":
            return self._grouped(hidden_TD)
        top_k_index_TK, top_k_weights_TK = [*index_and_weights, *by_name.values()]
        if self.dispatcher.tp is not None:
            return routed_share(self._routed, hidden_TD, top_k_index_TK, top_k_weights_TK, self.dispatcher.tp)
        return self._routed(hidden_TD, top_k_index_TK, top_k_weights_TK)

    def _grouped(self, grouped_XD: torch.Tensor) -> torch.Tensor:
        """Llama 4's call: `experts(x)`, x [E*T, D] with expert e's input (pre-scaled by its routing score)
        in rows e*T:(e+1)*T, zero where e was not routed. Only the non-zero rows are sent, each as a token
        routed to its one expert with weight 1; a zero row's output is zero, as in the original."""
        rows, expert_R = grouped_routing(grouped_XD, self.layout.num_experts)
        token_R = torch.remainder(rows, grouped_XD.shape[0] // self.layout.num_experts)
        out_RD = self._routed(grouped_XD.index_select(0, rows), expert_R[:, None], grouped_XD.new_ones(len(rows), 1),
                              token_R)
        return torch.zeros_like(grouped_XD).index_add(0, rows, out_RD)

    def _routed(self, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
                token_T: torch.Tensor | None = None):
        """`token_T`: the model's token of each row of hidden_TD when they differ (grouped calls)."""
        track_grad = torch.is_grad_enabled()
        checkpointed = _CHECKPOINTED_LAYER.get() if track_grad else None
        if checkpointed is not None and checkpointed.replaying:
            call = checkpointed.replay()
            plan, selection, sent, key, replayed = call.plan, call.selection, call.sent, call.key, call.expert_out_RD
        else:
            plan, selection, sent, key = self._dispatch(hidden_TD, top_k_index_TK, token_T, track_grad)
            replayed = None
        # The anchor makes the Function's output require grad even when no input does
        # (no backbone adapter upstream), so expert LoRA still gets its backward.
        anchor = torch.zeros((), requires_grad=track_grad)
        if checkpointed is None:
            expert_out_RD = _RemoteExperts.apply(hidden_TD, anchor, self.dispatcher, sent, key, replayed)
        else:
            # In-process workers build their graphs in this thread: keep them out of the checkpoint's saved-tensor
            # hooks, which would drop them (its recompute never rebuilds them)
            with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
                expert_out_RD = _RemoteExperts.apply(hidden_TD, anchor, self.dispatcher, sent, key, replayed)
            if not checkpointed.replaying:
                checkpointed.calls.append(_BrokerCall(plan, selection, sent, key, expert_out_RD.detach()))
        if selection is not None:
            expert_out_RD = self.dispatcher.condenser.expand(selection, expert_out_RD)
        token_idx_R = plan.token_idx_R.to(hidden_TD.device)
        weights_R = top_k_weights_TK[token_idx_R, plan.k_pos_R.to(hidden_TD.device)]
        if replayed is None and sent.reply_to_R is not None:
            self.dispatcher.router.relayed(sent, key, weights_R)
        weighted_RD = (expert_out_RD * weights_R[:, None]).to(hidden_TD.dtype)
        return torch.zeros_like(hidden_TD).index_add(0, token_idx_R, weighted_RD)

    def _dispatch(self, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor, token_T: torch.Tensor | None,
                  track_grad: bool):
        """A first forward's decisions: the plan (routing counted), its key and which rows travel."""
        plan = self.dispatcher.plan(self.layer, top_k_index_TK)
        if self.dispatcher.router is not None and track_grad:
            plan = replace(plan, reply_to_R=self.dispatcher.router.reply_to(plan, token_T, hidden_TD.shape[-1]))
        key = self.dispatcher.new_key(self.layer) if track_grad else None
        selection = self._condense(hidden_TD, plan, token_T) if track_grad and self.training else None
        sent = plan if selection is None else plan.subset(selection.kept_R)
        return plan, selection, sent, key

    def _condense(self, hidden_TD: torch.Tensor, plan: DispatchPlan, token_T: torch.Tensor | None):
        """Token condensation (LOSSY, opt-in; `vela_ray.model.condensation`): which rows travel, or None
        without a condenser. Eval and no-grad forwards never get here, so they stay exact."""
        condenser = self.dispatcher.condenser
        if condenser is None:
            return None
        rows_RD = hidden_TD.detach().index_select(0, plan.token_idx_R.to(hidden_TD.device))
        token_R = plan.token_idx_R if token_T is None else token_T.cpu()[plan.token_idx_R]
        return condenser.select(self.layer, rows_RD, plan.expert_ids_R, token_R)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, workers={self.dispatcher.transport.num_workers}"
