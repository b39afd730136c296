"""Sequence migration among data-parallel masters (LUFFY, Chen et al., Sec. IV), exact.

With M masters (`masters.count`) each master runs its share of every micro-batch's sequences
through the backbone, and sends their rows to the shared ExpertManagers. With
`masters.sequence_migration` on, at every decoder layer that holds a MoE block the masters
decide together where each sequence continues: on the master whose node served most of that
layer's rows of it (`placement.migrate_sequences`, LUFFY's Algorithm 1). After the last decoder layer
every sequence goes back to the master it started on, which has its labels. Every layer sees the
very rows it would have seen without migration, so losses and gradients are unchanged: the math is
the same, only bytes move differently.

Where the layer's expert outputs are combined (`masters.sequence_migration_combine`):
  * "new_master" (LUFFY's, the default): the decision is taken from the layer's plan, before its rows
    leave (`reply_to`, the dispatcher's `RelayRows` stage); the workers answer the rows of a sequence that leaves
    this master to its new master (`transport.RowRelay`), and the old master combines the others. After
    the layer the sequence's hidden state moves without the relayed rows' share, with each relayed row's
    place and routing weight; the new master collects the outputs from the workers and adds them in
    (`_Exchange.combine_arrivals`). Backward follows in reverse: the new master sends the workers the
    outputs' gradients (`deposit`, before the old master's backward of that forward, which the workers
    finish with them) and the old master the weights' gradients (`_Exchange.weights_grad`). It needs a
    relaying data plane and layers that add their experts' combined output to their output as it is
    (checked on the model: `adds_expert_outputs`); where that fails (`combine_refusal`, e.g. experts called
    on grouped rows) the migration logs why and combines
  * "home": the outputs return to the old master, and the combined hidden state moves after the layer
    (one row per token), the decision taken then from the same numbers.
Either way the hidden states move in `_Move`, an autograd Function whose backward moves the gradients back.

    migration = SequenceMigration(peft_model, dispatcher, rank, num_masters, NodeMap.of(master_nodes, worker_nodes))
    loss_fn = migration.loss_fn(master_share(rank, ...), replicas)      # replicas: an `Exchanger`
    train_step(..., loss_fn=loss_fn, replicas=replicas); migration.take_stats()

Padded micro-batches (sequences of unequal lengths) migrate too: before the forward every master runs the
model up to its decoder layers on the whole micro-batch, which it has (`_probe`), and keeps what each layer is
given per row (the attention mask, per-row positions); a decoder layer then gets, for each of this master's
slots, the rows of the sequence in it (`_carry`), so a moved sequence attends exactly as at home and no mask
crosses the network. The real lengths are Eq. 1's: `migrate_sequences` gathers sequences of similar lengths
where that costs no traffic (q > 1).

Where this runtime differs from LUFFY (`placement.simulate_sequences` is LUFFY's own accounting), and why:
  * a moving sequence's hidden state (one row per token) crosses to the new master at the layer's boundary,
    as the residual stream the relayed outputs add to; LUFFY counts moves the same way. The stats'
    `combine_*` rows measure the most a combine where the experts ran could keep on the node: the gathered
    rows that crossed nodes, and those that would have crossed had each sequence combined on the node serving
    most of its rows (free moves, no capacity);
  * each master keeps its number of sequences (the model's forward has one batch shape per master),
    so a master takes exactly as many as it gives (`capacity_sequences`); every slot is as long as the
    micro-batch's longest sequence, so Eq. 1 decides where sequences go but the attention still runs padded;
  * packed rows (`position_ids`, several documents per row) do not move (`skipped`);
  * training forwards only: evaluation runs on master 0 alone.

Every master decides from the same numbers (the served rows of every sequence, summed over the
masters), so all of them compute the same moves without a coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from placement.sequences import contiguous_masters, migrate_sequences
from vela_ray.model.broker import ExpertBroker, ExpertDispatcher
from vela_ray.model.dispatch_stages import DispatchPlan
from vela_ray.model.transport import RowRelay
from vela_ray.training.replicas import Batch, Exchanger, ReplicaShare

logger = logging.getLogger(__name__)
Combine = Literal["new_master", "home"]
_DECODER_LAYER_RE = re.compile(r"^(.*(?:^|\.)layers)\.(\d+)\.")
Slots = list[list[int]]  # per master: the sequence (row of the micro-batch) in each of its batch rows


@dataclass(frozen=True)
class NodeMap:
    """Which node each master and each worker runs on, as indices into the job's distinct nodes."""

    master_node_M: list[int]
    worker_node_W: list[int]
    num_nodes: int

    @classmethod
    def of(cls, master_nodes: list[str], worker_nodes: list[str]) -> "NodeMap":
        names = list(dict.fromkeys([*master_nodes, *worker_nodes]))
        return cls([names.index(n) for n in master_nodes], [names.index(n) for n in worker_nodes], len(names))


@dataclass
class SequenceMoveStats:
    """What one master's migrations moved (forward and backward), since the last `take_stats`."""

    micro_batches: int = 0
    skipped: int = 0  # micro-batches that could not move (packed rows)
    moves: int = 0  # sequences this master gave to another master (on the way home too)
    sent_bytes: int = 0  # what this master sent to other masters: hidden states, their gradients, relay_bytes
    cross_node_bytes: int = 0  # the part of sent_bytes that went to a master on another node
    # combine on the new master: rows of the sequences leaving this master whose outputs the workers answered
    # to the new master, and the part of sent_bytes that told it about them (row codes, routing weights and,
    # backward, those weights' gradients)
    relayed_rows: int = 0
    relay_bytes: int = 0
    # master 0 only (all masters see the same numbers), over the MoE layers where a decision is taken: routed
    # rows, those whose expert ran off the node of the master the sequence was on (today's combine pulls them
    # across), and those off the node serving most of the sequence's rows (LUFFY's own accounting with free
    # moves and no capacity: the most a combine "where its experts ran" could keep on the node)
    combine_rows: int = 0
    combine_cross_node_rows: int = 0
    combine_cross_node_rows_best_node: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _MicroBatch:
    """One micro-batch's forward in progress: where each sequence is, and this layer's routing."""

    exchanger: Exchanger
    slots: Slots
    home: Slots
    tokens_S: list[int]  # real (unpadded) tokens of each sequence of the micro-batch: Eq. 1's lengths
    seq_len: int  # tokens in every slot (the micro-batch's padded length)
    layer_kwargs: dict[int, dict] | None = None  # padded: what each decoder layer gets for the whole micro-batch
    served: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # MoE layer -> (tokens, workers)
    # combine on the new master: decoder layer -> (the slots decided before its combine, rows of each sequence)
    decided: dict[int, tuple[Slots, np.ndarray]] = field(default_factory=dict)
    relays: dict[int, "_Relay"] = field(default_factory=dict)  # decoder layer -> this master's relayed rows


@dataclass(frozen=True)
class _Relay:
    """The rows of one MoE layer's forward whose outputs the workers answered to another master: those of the
    sequences leaving this master after the layer, in plan (worker-major) order."""

    key: tuple[int, int]
    token_R: torch.Tensor  # [R] token in this master's [B*T] rows
    worker_R: torch.Tensor  # [R]
    master_R: torch.Tensor  # [R] the master the output went to
    plan_weights: torch.Tensor  # [P] routing weights of all the plan's rows, in the graph (P >= R)
    away_P: torch.Tensor  # [P] bool: the relayed rows among them (their weights' gradient comes from their master)


class SequenceMigration:
    """One master's side: hooks on its decoder layers and its brokers' plans (see the module docstring)."""

    def __init__(self, model: nn.Module, dispatcher: ExpertDispatcher, rank: int, num_masters: int,
                 nodes: NodeMap, candidates: int = 1, combine: Combine = "new_master"):
        """`candidates`: LUFFY's q, the masters of least traffic a sequence may choose among (balanced by
        attention load). `combine`: where a moving sequence's expert outputs are combined, "new_master"
        (LUFFY's) where the model and data plane allow it (`combine_refusal`), else "home"."""
        if len(nodes.master_node_M) != num_masters:
            raise ValueError(f"NodeMap names {len(nodes.master_node_M)} masters' nodes, the job has {num_masters}")
        self.rank, self.num_masters, self.nodes, self.candidates = rank, num_masters, nodes, candidates
        self.dispatcher = dispatcher
        # a tensor-parallel master's ranks each see their share of a layer's rows: they decide together on the
        # sum, and the first counts the decisions (every rank moves its own copy of the hidden states)
        self.tp = dispatcher.tp if dispatcher.tp is not None and dispatcher.tp.size > 1 else None
        self.counts_decisions = self.tp is None or self.tp.rank == 0
        self.stats = SequenceMoveStats()
        self._worker_nodes = torch.nn.functional.one_hot(torch.tensor(nodes.worker_node_W), nodes.num_nodes)
        self._batch: _MicroBatch | None = None
        moe_layers, (self._last, last_layer), self._stack = _decoder_layers(model)
        self._moe_of_decoder = {index: moe for index, (moe, _) in moe_layers.items()}
        hooked = [*((index, layer) for index, (_, layer) in moe_layers.items()), (self._last, last_layer)]
        self._handles = [layer.register_forward_hook(self._hook(index)) for index, layer in hooked]
        # padded micro-batches: a moved sequence takes its own attention mask (and per-row positions) along
        self._handles += [layer.register_forward_pre_hook(self._carry(index), with_kwargs=True)
                          for index, layer in enumerate(self._stack)]
        self._decoder_of_moe = {moe: index for index, moe in self._moe_of_decoder.items()}
        refusal = combine_refusal(model, dispatcher, self._stack, self._moe_of_decoder) if combine == "new_master" \
            else None
        if refusal is not None and rank == 0:
            logger.info("sequence migration: sequences move after the combine on their old master: %s", refusal)
        self.combine: Combine = "home" if refusal is not None else combine
        dispatcher.relay_rows(self)

    def loss_fn(self, share: ReplicaShare, exchanger: Exchanger):
        """`share.loss` with this master's sequences migrating during the forward (the backward follows)."""
        def loss(model: nn.Module, full: Batch) -> torch.Tensor:
            self._begin(full, exchanger)
            if self._batch is not None and not one_mask(full):
                probed = self._probe(model, {k: v.to(share.device) for k, v in full.items()
                                             if k in ("input_ids", "attention_mask")})
                self._batch = replace(self._batch, layer_kwargs=probed)
            try:
                return share.loss(model, full)
            finally:
                self._batch = None
        return loss

    def take_stats(self) -> SequenceMoveStats:
        stats, self.stats = self.stats, SequenceMoveStats()
        return stats

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- one micro-batch -----------------------------------------------------------------------

    def _begin(self, full: Batch, exchanger: Exchanger) -> None:
        if not torch.is_grad_enabled():
            return  # a forward without a backward (evaluation): every master must take part, so none moves
        self.stats.micro_batches += self.counts_decisions
        if "position_ids" in full:  # packed rows: several documents per row, their masks built from positions
            self.stats.skipped += self.counts_decisions
            return
        ids = full["input_ids"]
        mask = full.get("attention_mask")
        tokens_S = [ids.shape[1]] * ids.shape[0] if mask is None else mask.sum(dim=1).tolist()
        master_S = contiguous_masters(ids.shape[0], self.num_masters)  # as `shard_rows` splits
        home = [np.flatnonzero(master_S == m).tolist() for m in range(self.num_masters)]
        self._batch = _MicroBatch(exchanger, [list(s) for s in home], home, [int(t) for t in tokens_S], ids.shape[1])

    def _probe(self, model: nn.Module, full: Batch) -> dict[int, dict]:
        """What every decoder layer is given for the whole micro-batch (attention masks, positions), read by
        running the model's forward up to its last layer on all the sequences, which every master has: a moved
        padded sequence then gets its own rows of them wherever it is, and no mask crosses the network. The
        model builds masks row by row, so a sequence's rows are the ones it gets unmoved. The brokers answer
        zeros meanwhile (`ExpertDispatcher.probing`: no row sent or counted), in eval mode (no draw of torch's
        RNG), without grad."""
        seen: dict[int, dict] = {}

        def record(index: int):
            def hook(module: nn.Module, args, kwargs):
                seen[index] = dict(kwargs)
                if index == len(self._stack) - 1:
                    raise _ProbeDone
            return hook

        batch, self._batch = self._batch, None  # no hooks of ours during the probe
        handles = [layer.register_forward_pre_hook(record(index), with_kwargs=True)
                   for index, layer in enumerate(self._stack)]
        try:
            with self.dispatcher.probing(torch.zeros_like), _evaluating(model), torch.no_grad():
                model(**full, use_cache=False)
        except _ProbeDone:
            pass
        finally:
            for handle in handles:
                handle.remove()
            self._batch = batch
        return seen

    def _carry(self, decoder: int):
        """Pre-hook: with sequences away from home, the layer's per-row inputs (masks, positions) for the
        sequences in this master's slots now, from the probe of the whole micro-batch."""
        def hook(module: nn.Module, args, kwargs):
            batch = self._batch
            if batch is None or batch.layer_kwargs is None or batch.slots == batch.home:
                return None
            rows = torch.tensor(batch.slots[self.rank], dtype=torch.long)
            total = sum(len(s) for s in batch.slots)
            whole = batch.layer_kwargs[decoder]
            return args, {k: _rows_of(whole.get(k, v), rows, total) if k in whole else v for k, v in kwargs.items()}
        return hook

    # -- the dispatcher's `RowRouter` (its `RelayRows` stage) ---------------------------------------------

    def reply_to(self, plan: DispatchPlan, token_T: torch.Tensor | None, hidden_size: int) -> torch.Tensor | None:
        """Sees every plan of a training forward. Combining on the new master, it decides here, before the
        combine, where each sequence goes after this layer, and sends the rows of those leaving this master to
        their new master (-1 elsewhere); otherwise it keeps the rows' workers for the decision after the layer."""
        batch = self._batch
        if batch is None:
            return None
        token_R = plan.token_idx_R if token_T is None else token_T.cpu()[plan.token_idx_R]
        worker_R = plan.worker_R
        decoder = self._decoder_of_moe.get(plan.layer)
        if self.combine == "home" or decoder is None:
            batch.served[plan.layer] = (token_R, worker_R)
            return None
        target, rows_S = self._decide(batch, token_R, worker_R, batch.seq_len, hidden_size)
        batch.decided[decoder] = (target, rows_S)
        master_S = np.empty(len(rows_S), dtype=np.int64)
        for master, seqs in enumerate(target):
            master_S[seqs] = master
        master_R = torch.as_tensor(master_S[batch.slots[self.rank]])[token_R // batch.seq_len]
        reply_R = torch.where(master_R == self.rank, -1, master_R)
        return reply_R if bool((reply_R >= 0).any()) else None

    def relayed(self, plan: DispatchPlan, key, weights_R: torch.Tensor) -> None:
        batch = self._batch
        if batch is None:
            return
        away_R = plan.reply_to_R >= 0
        self.stats.relayed_rows += int(away_R.sum())
        # all the plan's weights, unindexed: an indexing op here would save a tensor that a checkpointed
        # layer's recompute (which relays nothing) does not save again
        batch.relays[self._decoder_of_moe[plan.layer]] = _Relay(
            key, plan.token_idx_R[away_R], plan.worker_R[away_R], plan.reply_to_R[away_R], weights_R, away_R)

    # -- after a decoder layer -------------------------------------------------------------------

    def _hook(self, decoder: int):
        def hook(module: nn.Module, args, output):
            batch = self._batch
            if batch is None:
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            if decoder == self._last:
                target, rows_S = batch.home, None
            elif decoder in batch.decided:  # decided before the combine (LUFFY's): the outputs went ahead
                target, rows_S = batch.decided.pop(decoder)
            else:
                target, rows_S = self._plan(batch, decoder, hidden), None
            if target == batch.slots:
                return None
            relay = batch.relays.pop(decoder, None)
            exchange = _Exchange(self, batch.exchanger, batch.slots, target, self._moe_of_decoder.get(decoder), rows_S,
                                 relay)
            weights = relay.plan_weights if relay is not None else hidden.new_zeros(0)
            moved = _Move.apply(hidden, weights, exchange)
            batch.slots = target
            if self.dispatcher.condenser is not None:  # its history is keyed by the slots' tokens, which moved
                self.dispatcher.condenser.forget_history()
            return (moved, *output[1:]) if isinstance(output, tuple) else moved
        return hook

    def _plan(self, batch: _MicroBatch, decoder: int, hidden_BTD: torch.Tensor) -> Slots:
        """Every master's new slots after MoE decoder layer `decoder`, decided after its combine."""
        token_R, worker_R = batch.served.pop(self._moe_of_decoder[decoder])
        return self._decide(batch, token_R, worker_R, hidden_BTD.shape[1], hidden_BTD.shape[-1])[0]

    def _decide(self, batch: _MicroBatch, token_R: torch.Tensor, worker_R: torch.Tensor, num_tokens: int,
                hidden_size: int) -> tuple[Slots, np.ndarray]:
        """Every master's new slots after a MoE layer whose rows of this master went to `worker_R` [R], and
        the rows of each sequence of the micro-batch (the same on every master)."""
        total = sum(len(s) for s in batch.slots)
        served_SW = torch.zeros(total, len(self.nodes.worker_node_W), dtype=torch.long)
        mine = torch.tensor(batch.slots[self.rank], dtype=torch.long)
        served_SW.index_put_((mine[token_R // num_tokens], worker_R), torch.ones_like(worker_R), accumulate=True)
        if self.tp is not None:  # the TP ranks' shares of the layer's rows
            dist.all_reduce(served_SW, group=self.tp.group)
        served_SN = (batch.exchanger.sum_tensor(served_SW) @ self._worker_nodes).numpy()
        current_S = np.empty(total, dtype=np.int64)
        for master, seqs in enumerate(batch.slots):
            current_S[seqs] = master
        if self.rank == 0 and self.counts_decisions:
            rows_S = served_SN.sum(axis=1)
            master_nodes = sorted(set(self.nodes.master_node_M))
            self.stats.combine_rows += int(rows_S.sum())
            here_S = served_SN[np.arange(total), np.asarray(self.nodes.master_node_M)[current_S]]
            self.stats.combine_cross_node_rows += int((rows_S - here_S).sum())
            self.stats.combine_cross_node_rows_best_node += int((rows_S - served_SN[:, master_nodes].max(axis=1)).sum())
        next_S = migrate_sequences(batch.tokens_S, served_SN, self.nodes.master_node_M, q=self.candidates,
                                   current_S=current_S, hidden_size=hidden_size,
                                   capacity_tokens=[len(s) * num_tokens for s in batch.slots],
                                   capacity_sequences=[len(s) for s in batch.slots])
        return reslot(batch.slots, next_S), served_SN.sum(axis=1)

    def _count(self, outgoing: dict[int, torch.Tensor], relay: bool = False) -> None:
        for master, tensor in outgoing.items():
            size = tensor.numel() * tensor.element_size()
            self.stats.sent_bytes += size
            self.stats.relay_bytes += size if relay else 0
            if self.nodes.master_node_M[master] != self.nodes.master_node_M[self.rank]:
                self.stats.cross_node_bytes += size


def one_mask(batch: Batch) -> bool:
    """Whether every sequence of the micro-batch has the same attention mask (no padding, no packed rows): then
    the layers' inputs are the same in every slot and a move needs no `_probe`."""
    mask = batch.get("attention_mask")
    return "position_ids" not in batch and (mask is None or bool(mask.all()))


class _ProbeDone(Exception):
    """Ends `SequenceMigration._probe`'s forward after the last decoder layer has shown its inputs."""


def _rows_of(value, rows: torch.Tensor, total: int):
    """`value`'s rows `rows` where it has one row per sequence of the micro-batch (a tensor of `total` rows,
    or tuples of them, like rotary (cos, sin)); anything else (shared by all rows) as it is."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows.to(value.device)) if value.dim() and value.shape[0] == total else value
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, total) for v in value)
    return value


def _arriving(before: Slots, after: Slots, rank: int) -> dict[int, list[int]]:
    """{other master: the sequences it gives master `rank` in a move from `before` to `after` slots, sorted}."""
    where = {s: m for m, seqs in enumerate(before) for s in seqs}
    arriving: dict[int, list[int]] = {}
    for s in sorted(set(after[rank]) - set(before[rank])):
        arriving.setdefault(where[s], []).append(s)
    return arriving


def reslot(slots: Slots, next_S: np.ndarray) -> Slots:
    """The masters' slots after each sequence s moved to master next_S[s]: a sequence that stays keeps its
    slot, the ones that arrive fill the freed slots in sequence order."""
    out = []
    for master, seqs in enumerate(slots):
        arriving = iter(sorted(s for s in range(len(next_S)) if next_S[s] == master and s not in seqs))
        out.append([s if next_S[s] == master else next(arriving) for s in seqs])
    return out


@dataclass
class _Arrival:
    """Rows of the sequences another master gave this one at a layer, combined here: their outputs came from
    the workers, their routing weights and places from that master (kept for the backward)."""

    key: tuple[int, int]  # the other master's forward
    workers: list[int]
    counts: list[int]  # rows per worker, in `workers`' order (the rows' order)
    pos_R: torch.Tensor  # [R] row of this master's [B*T] hidden states each output adds into
    weights_R: torch.Tensor  # [R] float32
    out_RD: torch.Tensor  # [R, D]


@dataclass
class _Exchange:
    """One move of every master's sequences from `before` to `after` slots, as this master sees it.

    Combining on the new master (`rows_S` given: the rows each sequence sent this layer), the sequences that
    leave carry their hidden state without the relayed rows' contribution; the new master gets each relayed
    row's place and routing weight from the old one, the row's output from its worker, and adds
    weight * output into the sequence's token there. Backward: the new master sends the workers d(output) =
    weight * d(hidden), and the old master d(weight) = <d(hidden), output> beside the hidden state's gradient."""

    migration: SequenceMigration
    exchanger: Exchanger
    before: Slots
    after: Slots
    layer: int | None = None  # the MoE layer whose rows were relayed (combine on the new master)
    rows_S: np.ndarray | None = None
    relay: _Relay | None = None  # what this master relayed
    arrivals: dict[int, _Arrival] = field(default_factory=dict)  # from each other master

    def run(self, x_BTD: torch.Tensor, before: Slots, after: Slots) -> torch.Tensor:
        """x's rows in `before`'s slots -> in `after`'s (forward: before -> after; backward: the reverse)."""
        rank = self.migration.rank
        where = {s: m for m, seqs in enumerate(before) for s in seqs}
        mine_before, mine_after = before[rank], after[rank]
        outgoing = {}
        for master, seqs in enumerate(after):
            if master != rank:
                leaving = sorted(s for s in seqs if where[s] == rank)
                if leaving:
                    outgoing[master] = x_BTD[[mine_before.index(s) for s in leaving]]
        arriving = _arriving(before, after, rank)
        shape = tuple(x_BTD.shape[1:])
        received = self.exchanger.exchange(outgoing, {m: ((len(seqs), *shape), x_BTD.dtype)
                                                      for m, seqs in arriving.items()})
        self.migration._count(outgoing)
        out = torch.empty_like(x_BTD)
        for slot, s in enumerate(mine_after):
            if s in mine_before:
                out[slot] = x_BTD[mine_before.index(s)]
        for master, seqs in arriving.items():
            for row, s in enumerate(seqs):
                out[mine_after.index(s)] = received[master][row]
        return out

    # -- combine on the new master ---------------------------------------------------------------

    def combine_arrivals(self, out_BTD: torch.Tensor) -> torch.Tensor:
        """Forward, after `run`: send each new master the relayed rows' places and weights, and add the rows
        relayed to this master, weighted, into the tokens of the sequences that arrived."""
        rank, num_tokens, num_workers = self.migration.rank, out_BTD.shape[1], len(self.migration.nodes.worker_node_W)
        codes, weights = self._relay_messages(num_tokens, num_workers)
        arriving = {m: seqs for m, seqs in _arriving(self.before, self.after, rank).items()
                    if sum(self.rows_S[s] for s in seqs)}  # sequences that sent rows to the workers
        sizes = {m: int(sum(self.rows_S[s] for s in seqs)) for m, seqs in arriving.items()}
        got_codes = self.exchanger.exchange(codes, {m: ((1 + n,), torch.long) for m, n in sizes.items()})
        got_weights = self.exchanger.exchange(weights, {m: ((n,), torch.float32) for m, n in sizes.items()})
        self.migration._count(codes, relay=True)
        self.migration._count(weights, relay=True)
        flat_TD = out_BTD.view(-1, out_BTD.shape[-1])
        for master, seqs in arriving.items():
            key, row_R = (int(got_codes[master][0]), self.layer), got_codes[master][1:].cpu()
            worker_R, place_R = row_R % num_workers, row_R // num_workers
            slot_R = torch.tensor([self.after[rank].index(s) for s in seqs], dtype=torch.long)[place_R // num_tokens]
            workers, counts = (v.tolist() for v in torch.unique_consecutive(worker_R, return_counts=True))
            out_RD = self.migration.dispatcher.collect(self.layer, key, workers, out_BTD)
            arrival = _Arrival(key, workers, counts, (slot_R * num_tokens + place_R % num_tokens).to(out_BTD.device),
                               got_weights[master].to(out_BTD.device), out_RD)
            flat_TD.index_add_(0, arrival.pos_R, (arrival.out_RD * arrival.weights_R[:, None]).to(out_BTD.dtype))
            self.arrivals[master] = arrival
        return out_BTD

    def _relay_messages(self, num_tokens: int, num_workers: int) -> tuple[dict, dict]:
        """What this master tells each new master of the rows it relayed there: ({master: [1 + R] the forward's
        key, then each row's (sequence among those moving there, token, worker) as one int64}, {master: [R]
        float32 routing weights}), rows in plan order, which is the workers' order of the rows they hold."""
        codes, weights = {}, {}
        relay, rank = self.relay, self.migration.rank
        if relay is None:
            return codes, weights
        relayed_weights_R = relay.plan_weights.detach()[relay.away_P.to(relay.plan_weights.device)].float()
        for master in sorted(set(relay.master_R.tolist())):
            index_of = {s: j for j, s in enumerate(sorted(s for s in self.after[master] if s in self.before[rank]))}
            mine = relay.master_R == master
            token_R = relay.token_R[mine]
            seq_R = torch.tensor([index_of[self.before[rank][b]] for b in (token_R // num_tokens).tolist()],
                                 dtype=torch.long)
            row_R = (seq_R * num_tokens + token_R % num_tokens) * num_workers + relay.worker_R[mine]
            codes[master] = torch.cat([torch.tensor([relay.key[0]]), row_R])
            weights[master] = relayed_weights_R[mine.to(relayed_weights_R.device)]
        return codes, weights

    def weights_grad(self, grad_BTD: torch.Tensor) -> torch.Tensor | None:
        """Backward, before `run`'s reverse: send the workers the arrived rows' d(output) (they finish the old
        masters' backward with it) and the old masters their weights' gradients; returns those of the rows this
        master relayed (None if none)."""
        flat_TD = grad_BTD.reshape(-1, grad_BTD.shape[-1])
        dweights = {}
        for master, arrival in self.arrivals.items():
            grad_RD = flat_TD.index_select(0, arrival.pos_R)
            dout_RD = (grad_RD * arrival.weights_R[:, None]).to(arrival.out_RD.dtype)
            self.migration.dispatcher.deposit(self.layer, arrival.key,
                                              dict(zip(arrival.workers, dout_RD.split(arrival.counts))))
            dweights[master] = (grad_RD.float() * arrival.out_RD.float()).sum(dim=-1)
        relay = self.relay
        masters = [] if relay is None else sorted(set(relay.master_R.tolist()))
        got = self.exchanger.exchange(dweights, {m: ((int((relay.master_R == m).sum()),), torch.float32)
                                                 for m in masters})
        self.migration._count(dweights, relay=True)
        if relay is None:
            return None
        grad_R = torch.zeros(len(relay.master_R), dtype=torch.float32, device=relay.plan_weights.device)
        for master in masters:
            grad_R[(relay.master_R == master).to(grad_R.device)] = got[master].to(grad_R.device)
        grad_P = torch.zeros(len(relay.away_P), dtype=torch.float32, device=grad_R.device)
        grad_P[relay.away_P.to(grad_R.device)] = grad_R
        return grad_P.to(relay.plan_weights.dtype)


class _Move(torch.autograd.Function):
    """Hidden states [B, T, D] in this master's slots before a move -> after it; backward: the reverse.
    `weights_R`: the routing weights of the layer's rows when this master relayed some (combine on the new
    master; else empty): the relayed rows' gradient comes back from their new masters."""

    @staticmethod
    def forward(ctx, hidden_BTD: torch.Tensor, weights_R: torch.Tensor, exchange: _Exchange):
        ctx.exchange = exchange
        rank = exchange.migration.rank
        if exchange.migration.counts_decisions:
            exchange.migration.stats.moves += len(set(exchange.before[rank]) - set(exchange.after[rank]))
        out = exchange.run(hidden_BTD.detach(), exchange.before, exchange.after)
        return out if exchange.rows_S is None else exchange.combine_arrivals(out)

    @staticmethod
    def backward(ctx, grad_BTD: torch.Tensor):
        exchange = ctx.exchange
        grad_weights = None if exchange.rows_S is None else exchange.weights_grad(grad_BTD)
        return exchange.run(grad_BTD.contiguous(), exchange.after, exchange.before), grad_weights, None


def combine_refusal(model: nn.Module, dispatcher: ExpertDispatcher, stack: list[nn.Module],
                    moe_of_decoder: dict[int, int]) -> str | None:
    """Why a moving sequence's expert outputs cannot be combined on its new master here, or None when they can:
    the data plane must answer rows to another master, and every deciding decoder layer must add its experts'
    combined output to its output unchanged (checked on this model: `adds_expert_outputs`), since the new
    master adds the relayed rows' share after the layer."""
    if not isinstance(dispatcher.transport, RowRelay):
        return f"the {dispatcher.transport.describe()} data plane cannot answer rows to another master"
    if dispatcher.condenser is not None:
        return "token condensation chooses which rows travel"
    if dispatcher.tp is not None and dispatcher.tp.size > 1:
        return "a tensor-parallel master's ranks gather each layer's outputs among themselves before any leaves"
    brokers = [m for m in model.modules() if isinstance(m, ExpertBroker)]
    if any(b.layout is not None and b.layout.call == "grouped" for b in brokers):
        return "its experts are called on rows grouped by expert"
    bad = [index for index in moe_of_decoder if not adds_expert_outputs(model, stack, index)]
    if bad:
        return f"decoder layers {bad} do not add their experts' combined output to their output as it is"
    return None


def adds_expert_outputs(model: nn.Module, stack: list[nn.Module], decoder: int) -> bool:
    """Whether decoder layer `decoder`'s output moves by exactly what its expert broker returns: run the model
    on a few tokens with every broker answering zeros, then that layer again on the same inputs with its broker
    answering a pattern (`ExpertDispatcher.probing`), and compare. No row is sent anywhere."""
    layer = stack[decoder]
    brokers = [m for m in layer.modules() if isinstance(m, ExpertBroker)]
    others = [m for m in model.modules() if isinstance(m, ExpertBroker)]
    shift: dict[str, torch.Tensor] = {}
    seen: dict[str, bool] = {}

    def pattern(n: int, device) -> torch.Tensor:  # values -1 .. 1 in steps of 0.5: exact in any float dtype
        return (torch.remainder(torch.arange(n, device=device), 5) - 2) * 0.5

    def answer(hidden_TD: torch.Tensor) -> torch.Tensor:
        if not shift:
            return torch.zeros_like(hidden_TD)
        return pattern(hidden_TD.numel(), hidden_TD.device).view_as(hidden_TD).to(hidden_TD.dtype)

    def check(module, args, kwargs, output):
        if shift:
            return None
        shift["on"] = torch.ones(())
        try:
            again = module.forward(*args, **kwargs)
        finally:
            shift.clear()
        hidden, moved = (output[0], again[0]) if isinstance(output, tuple) else (output, again)
        delta = (moved - hidden).float().reshape(-1)
        seen["ok"] = bool(torch.allclose(delta, pattern(delta.numel(), delta.device).float(), atol=0.05, rtol=0))
        raise _ProbeDone

    handle = layer.register_forward_hook(check, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        with contextlib.ExitStack() as probes:
            for dispatcher in {id(b.dispatcher): b.dispatcher for b in others}.values():
                probes.enter_context(dispatcher.probing(answer))
            probes.enter_context(_evaluating(model))  # no dropout: both runs see the same numbers, RNG left alone
            probes.enter_context(torch.no_grad())
            model(input_ids=torch.arange(1, 5, device=device)[None], use_cache=False)
    except _ProbeDone:
        pass
    finally:
        handle.remove()
    return bool(brokers) and seen.get("ok", False)


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode within the block, every module's training mode put back after it."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _decoder_layers(model: nn.Module) -> tuple[dict[int, tuple[int, nn.Module]], tuple[int, nn.Module],
                                               list[nn.Module]]:
    """({decoder layer index: (its MoE layer, the decoder layer module)}, (last decoder layer index, module),
    every decoder layer in order)."""
    moe: dict[int, tuple[int, nn.Module]] = {}
    stack = None
    for path, module in model.named_modules():
        if not isinstance(module, ExpertBroker):
            continue
        match = _DECODER_LAYER_RE.match(path)
        if match is None:
            raise ValueError(f"sequence migration: MoE block {path} is not inside a `layers.<i>` decoder layer")
        stack = model.get_submodule(match.group(1))
        moe[int(match.group(2))] = (module.layer, stack[int(match.group(2))])
    if stack is None:
        raise ValueError(f"sequence migration: {type(model).__name__} has no expert brokers")
    last = len(stack) - 1
    if last in moe:  # its hook sends every sequence home; no decision after the last layer
        moe.pop(last)
    return moe, (last, stack[last]), list(stack)
