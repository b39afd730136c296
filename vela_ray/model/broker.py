"""ExpertBroker: stands in for a MoE block's `experts` and sends tokens to wherever experts live.

Legend: T = tokens, D = hidden, K = top-k, R = routed rows (one per valid
(token, k) pair), E = experts per layer, N = workers.

A broker call `ExpertBroker.forward(hidden_TD, top_k_index_TK, top_k_weights_TK)` runs the dispatcher's stages
(`dispatch_stages` lists them and where each lives), every feature one stage: `dispatch` in order, `combine` in
reverse. Its own two:
  * `PlanRows`: group the (token, k) pairs by owning worker, then by expert, using the placement table
    [L, E] -> worker (`ExpertDispatcher.plan`, which counts the routing); combine on the master:
    out_TD = sum_k weight_TK * expert_out, in autograd, so the router's inputs get their gradient as in the
    original module;
  * `SendRows`: dispatch + gather through the transport inside `_RemoteExperts`, a custom autograd Function:
    its backward sends d(outputs) to the owners and gathers d(rows), so LoRA gradients accumulate on the workers.
    A block with a shared expert (`shared_expert`) sends its rows on a thread of its own and computes the shared
    expert on the calling thread while they are away.

The arithmetic equals the original experts module; only where it runs changes. Two exceptions are opt-in and
LOSSY: condensation (`condensation.Condensation`: training forwards send one representative of each group of
similar rows of one expert) and a low-bit `row_format` (`vela_ray.model.wire`: rows, results and gradients
travel in bf16 or fp8). Traffic is counted here, once, for every transport, in the bytes that travel, and read
through `ExpertDispatcher.traffic()`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent import futures
from dataclasses import replace
from typing import Callable, Iterator

import torch
from torch import nn

from vela_ray.model import wire
from vela_ray.model.activity import MasterActivity
from vela_ray.model.checkpoint_replay import CheckpointReplay
from vela_ray.model.condensation import Condensation, Condenser
from vela_ray.model.dispatch_stages import BrokerCall, DispatchPlan, DispatchStage, RelayRows, RowRouter, StandIn
from vela_ray.model.experts import adapters_on
from vela_ray.model.shared_expert import SharedExpert
from vela_ray.model.tensor_parallel import TensorParallelPlan, TensorParallelShare
from vela_ray.model.traffic import TrafficCounter, TrafficSnapshot
from vela_ray.model.transport import ForwardRequest, RowRelay, Transport, ZeroAnswers


class ExpertDispatcher:
    """Shared by all brokers of a model: the placement table, the transport, the traffic counts and the stages
    every broker call runs (`dispatch_stages`), in order: the tensor-parallel share (after `share_rows`),
    checkpoint replay, the plan, the relay (after `relay_rows`), condensation (with a `condenser`), the send."""

    def __init__(self, expert_to_worker: torch.Tensor, transport: Transport, *, master: int = 0,
                 num_masters: int = 1, row_format: wire.RowFormat = "exact", latency=None,
                 condenser: Condenser | None = None):
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
        self._traffic = self._new_traffic(table, transport)
        self.latency = latency
        self.master = master
        # Seconds the master spent waiting on the transport, per phase: communication plus the
        # workers' expert compute, i.e. the part of a step that the placement can change.
        self.round_trip_s = {"forward": 0.0, "backward": 0.0}
        self.activity = MasterActivity()  # the seconds every micro-batch in flight waited: the master idle
        self._keys = itertools.count(master, num_masters)
        # several micro-batches in flight (`training.overlap`) count from threads of their own
        self._counting = threading.Lock()
        # the features' stages, None where a feature is off; `_in_order` puts them with the dispatcher's own
        self._share: TensorParallelShare | None = None
        self._relay: RelayRows | None = None
        self._condensation = None if condenser is None else Condensation(condenser)
        self._own = (CheckpointReplay(), PlanRows(self), SendRows(self))
        self.stages: tuple[DispatchStage, ...] = self._in_order()

    def _in_order(self) -> tuple[DispatchStage, ...]:
        """The stages every broker call runs, in their order (`dispatch_stages`): the one place that orders them."""
        replay, plan, send = self._own
        return tuple(s for s in (self._share, replay, plan, self._relay, self._condensation, send) if s is not None)

    def share_rows(self, plan: TensorParallelPlan) -> None:
        """From now on every broker sends only this TP rank's share of its layer's rows (`plan`: this master's
        `tensor_parallel.TensorParallelPlan`) and gathers the group's combined outputs."""
        self._share = TensorParallelShare(plan)
        self.stages = self._in_order()

    def relay_rows(self, router: RowRouter) -> None:
        """From now on every training forward's plan asks `router` (sequence migration) where each row's
        output goes, and the workers answer rows bound elsewhere to that master."""
        self._relay = RelayRows(router)
        self.stages = self._in_order()

    @contextlib.contextmanager
    def probing(self, answer: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """Within the block every broker answers `answer(hidden_TD)` for its experts and sends, counts and keys
        nothing: a probe of the model around the brokers (sequence migration's)."""
        stages, self.stages = self.stages, (StandIn(answer),)
        try:
            yield
        finally:
            self.stages = stages

    @contextlib.contextmanager
    def answering_at_once(self) -> Iterator[None]:
        """Within the block every broker call runs as in a step (the tensor-parallel share, checkpoint replay, the
        plan and the send: grouping, packing, encoding, combining) but the workers' answers are zeros, at once
        (`ZeroAnswers`), and nothing is counted, timed or keyed where a step would see it: the master's own
        compute around the experts, which the step prediction times (`step.master_compute_seconds`). The relay
        and condensation stages are left out: the one waits on masters that take no part, the other counts
        what it merges."""
        saved = self.stages, self.transport, self._traffic, self._keys, self.round_trip_s, self.latency, self.activity
        self.transport, self._keys = ZeroAnswers(self.transport), itertools.count()  # keys: no worker sees them
        self._traffic = self._new_traffic(self.expert_to_worker, self.transport)
        self.round_trip_s, self.latency, self.activity = {"forward": 0.0, "backward": 0.0}, None, MasterActivity()
        _, plan, send = self._own
        self.stages = tuple(s for s in (self._share, CheckpointReplay(), plan, send) if s is not None)
        try:
            yield
        finally:
            (self.stages, self.transport, self._traffic, self._keys, self.round_trip_s, self.latency,
             self.activity) = saved

    @staticmethod
    def _new_traffic(table: torch.Tensor, transport: Transport) -> TrafficCounter:
        return TrafficCounter(table.shape[0], transport.num_workers, transport.worker_tiers(),
                              num_experts=table.shape[1])

    @property
    def tp(self) -> TensorParallelPlan | None:
        """This master's TP plan when its brokers send a TP rank's share of the rows (`share_rows`), else None."""
        return None if self._share is None else self._share.plan

    @property
    def condenser(self) -> Condenser | None:
        """The condensation stage's `Condenser` (its counters and threshold), None without condensation."""
        return None if self._condensation is None else self._condensation.condenser

    def route(self, call: BrokerCall) -> torch.Tensor:
        """A broker call's output [T, D]: every stage's `dispatch` in order, then every `combine` in reverse."""
        for stage in self.stages:
            call = stage.dispatch(call)
        out = call.expert_out_RD
        for stage in reversed(self.stages):
            out = stage.combine(call, out)
        return out

    def traffic(self) -> TrafficSnapshot:
        """What crossed the data plane and what was routed since the last `reset_traffic` (the one routing count:
        step records, drift and re-placement read it)."""
        return self._traffic.snapshot()

    def reset_traffic(self) -> None:
        self._traffic.reset()

    def rebind(self, expert_to_worker, transport: Transport | None = None) -> None:
        """Point every broker at a new placement table (after a migration), and at a new transport if
        given (after lost workers were replaced). One assignment each, between steps; the traffic
        counts go on unless the worker count changed."""
        table = torch.as_tensor(expert_to_worker, dtype=torch.long)
        if table.shape != self.expert_to_worker.shape:
            raise ValueError(f"new placement is {tuple(table.shape)}, expected {tuple(self.expert_to_worker.shape)}")
        transport = transport or self.transport
        if transport.num_workers != self.transport.num_workers:
            self._traffic = self._new_traffic(table, transport)
        self.expert_to_worker, self.transport = table, transport

    @property
    def num_experts(self) -> int:
        return self.expert_to_worker.shape[1]

    def plan(self, layer: int, top_k_index_TK: torch.Tensor) -> DispatchPlan:
        """Where one forward's (token, k) pairs at `layer` go, grouped by worker; the pairs are counted
        in `traffic().routed`. Within `experts.without_adapters` on the calling thread the plan asks the workers
        for the base model's outputs."""
        top_k = top_k_index_TK.shape[1]
        expert_P = top_k_index_TK.reshape(-1).to(torch.long).cpu()
        pair_R = torch.nonzero(expert_P < self.num_experts).squeeze(1)  # ids >= E mark dropped slots
        expert_R = expert_P[pair_R]
        with self._counting:
            self._traffic.route(layer, expert_R.numpy())
        worker_R = self.expert_to_worker[layer][expert_R]
        order = torch.argsort(worker_R * self.num_experts + expert_R, stable=True)
        pair_R, expert_R, worker_R = pair_R[order], expert_R[order], worker_R[order]
        counts = torch.bincount(worker_R, minlength=self.transport.num_workers).tolist()
        ends = list(itertools.accumulate(counts))
        worker_rows = tuple((w, ends[w] - c, ends[w]) for w, c in enumerate(counts) if c > 0)
        return DispatchPlan(layer, pair_R // top_k, pair_R % top_k, expert_R, worker_rows, adapters=adapters_on())

    def new_key(self, layer: int) -> tuple[int, int]:
        with self._counting:
            return (next(self._keys), layer)

    @contextlib.contextmanager
    def _round_trip(self, layer: int, phase: str, master_waits: bool = True) -> Iterator[None]:
        """A transport call of `layer`'s `phase`: timed into `round_trip_s` and the latency metrics, and, unless the
        calling micro-batch computes meanwhile (`master_waits` False), a wait of it on the experts (`activity`)."""
        start = time.perf_counter()
        with self.activity.waiting() if master_waits else contextlib.nullcontext():
            yield
        seconds = time.perf_counter() - start
        with self._counting:
            self.round_trip_s[phase] += seconds
            if self.latency is not None:
                self.latency.observe(layer, seconds, phase)

    def _count(self, layer: int, direction, parts: dict[int, torch.Tensor]) -> None:
        with self._counting:
            for worker, tensor in parts.items():
                self._traffic.record(layer, worker, direction, tensor.shape[0],
                                     tensor.numel() * tensor.element_size())

    def forward(self, plan: DispatchPlan, rows_RD: torch.Tensor, key, master_waits: bool = True) -> torch.Tensor:
        """The experts' outputs [R, D] of the plan's rows; zeros where a row's output went to another master.
        `master_waits` False: called on another thread while the micro-batch computes (`SendRows`), which counts
        its own wait."""
        if plan.reply_to_R is not None and not isinstance(self.transport, RowRelay):
            raise ValueError(f"the {self.transport.describe()} data plane cannot answer rows to another master")
        requests = {
            w: ForwardRequest(plan.layer, plan.expert_ids_R[s:e], wire.encode(rows_RD[s:e], self.row_format), key,
                              plan.reply_to(s, e), plan.adapters)
            for w, s, e in plan.worker_rows
        }
        self._count(plan.layer, "dispatch", {w: r.rows for w, r in requests.items()})
        with self._round_trip(plan.layer, "forward", master_waits):
            outputs = self.transport.forward(requests)
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
        with self._round_trip(plan.layer, "backward"):
            grad_rows = self.transport.backward(key, grads)
        self._count(plan.layer, "grad_gather", grad_rows)
        return _concat_in_plan_order(plan, grad_rows, grad_RD)

    def collect(self, layer: int, key, workers: list[int], like: torch.Tensor) -> torch.Tensor:
        """The outputs another master's relayed forward (`key`) left on `workers` for this master, in worker
        order, as `like`'s dtype and device; counted as this master's gather."""
        with self._round_trip(layer, "forward"):
            parts = self.transport.collect(key, self.master, workers)
        self._count(layer, "gather", parts)
        return torch.cat([like.new_zeros((0, like.shape[-1])),
                          *(wire.decode(parts[w].to(like.device), like.dtype) for w in workers)])

    def deposit(self, layer: int, key, grads: dict[int, torch.Tensor]) -> None:
        """Send each worker the d(outputs) of the rows it answered here under `key` (this master's grad dispatch)."""
        encoded = {w: wire.encode(g.contiguous(), self.row_format) for w, g in grads.items()}
        self._count(layer, "grad_dispatch", encoded)
        with self._round_trip(layer, "backward"):
            self.transport.deposit(key, self.master, encoded)


def _concat_in_plan_order(plan: DispatchPlan, parts: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not plan.worker_rows:
        return like.new_zeros((0, *like.shape[1:]))
    return torch.cat([wire.decode(parts[w].to(like.device), like.dtype) for w, _, _ in plan.worker_rows])


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _RemoteExperts(torch.autograd.Function):
    """rows -> expert outputs, computed wherever the experts live; backward goes there too.
    `answered`: the outputs, fetched already, so forward sends nothing: a checkpoint recompute's replay of the first
    forward's (its node's backward never runs: backward goes through the first forward's node), or the round trip
    that ran while the block's shared expert computed (`SendRows`)."""

    @staticmethod
    def forward(ctx, hidden_TD, grad_anchor, dispatcher: ExpertDispatcher, plan: DispatchPlan, key,
                answered: torch.Tensor | None = None):
        ctx.dispatcher, ctx.plan, ctx.key, ctx.num_tokens = dispatcher, plan, key, hidden_TD.shape[0]
        if answered is not None:
            return answered.detach()
        rows_RD = hidden_TD.index_select(0, plan.token_idx_R.to(hidden_TD.device))
        return dispatcher.forward(plan, rows_RD, key)

    @staticmethod
    def backward(ctx, grad_out_RD):
        grad_rows_RD = ctx.dispatcher.backward(ctx.plan, grad_out_RD.contiguous(), ctx.key)
        grad_TD = grad_rows_RD.new_zeros(ctx.num_tokens, grad_rows_RD.shape[1])
        grad_TD.index_add_(0, ctx.plan.token_idx_R.to(grad_TD.device), grad_rows_RD)
        return grad_TD, None, None, None, None, None


class PlanRows:
    """The dispatcher's own stage that plans (`dispatch_stages`): a call's (token, k) rows grouped by worker
    (routing counted), the key its workers save the forward under (with grad) and the rows' routing weights;
    combine puts the rows' outputs back into their tokens, weighted. A recompute keeps its replayed plan."""

    def __init__(self, dispatcher: ExpertDispatcher):
        self.dispatcher = dispatcher

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        if call.replayed_RD is None:
            plan = self.dispatcher.plan(call.layer, call.top_k_index_TK)
            key = self.dispatcher.new_key(call.layer) if call.track_grad else None
            call = replace(call, plan=plan, sent=plan, key=key)
        device = call.hidden_TD.device
        token_idx_R = call.plan.token_idx_R.to(device)
        weights_R = call.top_k_weights_TK[token_idx_R, call.plan.k_pos_R.to(device)]
        return replace(call, weights_R=weights_R, token_idx_R=token_idx_R)

    def combine(self, call: BrokerCall, out_RD: torch.Tensor) -> torch.Tensor:
        hidden_TD = call.hidden_TD
        weighted_RD = (out_RD * call.weights_R[:, None]).to(hidden_TD.dtype)
        return torch.zeros_like(hidden_TD).index_add(0, call.token_idx_R, weighted_RD)


class SendRows:
    """The dispatcher's own stage that sends (`dispatch_stages`): the call's `sent` rows to their workers and
    their outputs back, through `_RemoteExperts` (or a recompute's replayed outputs, nothing sent).

    A call whose block has a shared expert due (`SharedExpert.due`) sends its rows on a thread of its own and
    computes the shared expert on this one while they are away: only the round trip, pure tensors, leaves this
    thread; the shared expert's graph and `_RemoteExperts`' node are built here. A recompute does as its first
    forward did, at the same point, with nothing away: the checkpoint finds the tensors it saves in the same order."""

    def __init__(self, dispatcher: ExpertDispatcher):
        self.dispatcher = dispatcher
        # a thread per calling thread with rows away (micro-batches in flight), started when first needed
        self._away = futures.ThreadPoolExecutor(32, thread_name_prefix="vela-rows-away")

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        # The anchor makes the Function's output require grad even when no input does
        # (no backbone adapter upstream), so expert LoRA still gets its backward.
        anchor = torch.zeros((), requires_grad=call.track_grad)
        tokens = _shared_tokens(call)
        answered = call.replayed_RD if tokens is None else self._beside_shared_expert(call, tokens)
        # In-process workers build their graphs in this thread: keep them out of a checkpoint's saved-tensor
        # hooks, which would drop them (its recompute never rebuilds them)
        kept = torch.autograd.graph.saved_tensors_hooks(_kept, _kept) if call.in_checkpoint \
            else contextlib.nullcontext()
        with kept:
            out_RD = _RemoteExperts.apply(call.hidden_TD, anchor, self.dispatcher, call.sent, call.key, answered)
        return replace(call, expert_out_RD=out_RD, shared_meanwhile=tokens is not None)

    def _beside_shared_expert(self, call: BrokerCall, tokens: torch.Tensor) -> torch.Tensor:
        """The sent rows' outputs, fetched on a thread of their own while this thread computes the block's shared
        expert on `tokens` (a recompute's replayed outputs, with the shared expert computed all the same)."""
        if call.replayed_RD is not None:
            call.shared.compute(tokens)
            return call.replayed_RD
        hidden_TD = call.hidden_TD.detach()
        rows_RD = hidden_TD.index_select(0, call.sent.token_idx_R.to(hidden_TD.device))
        away = self._away.submit(_on_this_streams(hidden_TD.device, self.dispatcher.forward), call.sent, rows_RD,
                                 call.key, False)
        try:
            call.shared.compute(tokens)
        finally:
            with self.dispatcher.activity.waiting():  # the master idles from here, not while it computes
                futures.wait([away])  # the rows are back before the call goes on, whatever happened here
        return away.result()

    def combine(self, call: BrokerCall, out_RD: torch.Tensor) -> torch.Tensor:
        return out_RD


def _shared_tokens(call: BrokerCall) -> torch.Tensor | None:
    """The tokens whose shared expert `call` computes (`SharedExpert.due`), None if it computes none; a recompute
    does as its first forward did (`CheckpointReplay`)."""
    if call.shared is None:
        return None
    return call.shared.due(decided=call.shared_meanwhile if call.replayed_RD is not None else None)


def _on_this_streams(device: torch.device, run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`run` for another thread, on this thread's current CUDA stream (where the rows were made, and where their
    outputs are used next, so no event is needed); on the CPU, `run` itself."""
    if device.type != "cuda":
        return run
    stream = torch.cuda.current_stream(device)

    def on_stream(*args) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return run(*args)
    return on_stream


def grouped_routing(grouped_XD: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their experts) that a grouped call `experts(x)` routes: x [E*T, D] holds expert e's inputs in
    rows e*T:(e+1)*T, pre-scaled by the routing score, so exactly the non-zero rows were routed."""
    rows_R = grouped_XD.detach().ne(0).any(dim=1).nonzero().squeeze(1)
    return rows_R, torch.div(rows_R, grouped_XD.shape[0] // num_experts, rounding_mode="floor")


class ExpertBroker(nn.Module):
    """Drop-in replacement for a MoE block's `experts`: same call, experts elsewhere (its dispatcher's stages)."""

    def __init__(self, layer: int, dispatcher: ExpertDispatcher, layout=None, shared: SharedExpert | None = None):
        super().__init__()
        self.layer = layer
        self.dispatcher = dispatcher
        self.layout = layout  # modeling.ExpertsLayout of the experts this broker stands in for
        self.shared = shared  # the block's shared expert, computed while the rows are away (`SendRows`)

    def forward(self, hidden_TD: torch.Tensor, *index_and_weights: torch.Tensor, **by_name: torch.Tensor):
        """`experts(hidden, top_k_index, top_k_weights)`, positional or under the family's names
        (e.g. gpt-oss's `router_indices=`, `routing_weights=`)."""
        if self.layout is not None and self.layout.call == "grouped":
            return self._grouped(hidden_TD)
        top_k_index_TK, top_k_weights_TK = [*index_and_weights, *by_name.values()]
        return self.dispatcher.route(BrokerCall.of(self.layer, hidden_TD, top_k_index_TK, top_k_weights_TK, None,
                                                   self.training, self.shared))

    def _grouped(self, grouped_XD: torch.Tensor) -> torch.Tensor:
        """Llama 4's call: `experts(x)`, x [E*T, D] with expert e's input (pre-scaled by its routing score)
        in rows e*T:(e+1)*T, zero where e was not routed. Only the non-zero rows are sent, each as a token
        routed to its one expert with weight 1; a zero row's output is zero, as in the original."""
        rows, expert_R = grouped_routing(grouped_XD, self.layout.num_experts)
        token_R = torch.remainder(rows, grouped_XD.shape[0] // self.layout.num_experts)
        out_RD = self.dispatcher.route(BrokerCall.of(self.layer, grouped_XD.index_select(0, rows), expert_R[:, None],
                                                     grouped_XD.new_ones(len(rows), 1), token_R, self.training,
                                                     self.shared))
        return torch.zeros_like(grouped_XD).index_add(0, rows, out_RD)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, workers={self.dispatcher.transport.num_workers}"
