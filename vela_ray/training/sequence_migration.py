"""Sequence migration among data-parallel masters (LUFFY, Chen et al., Sec. IV), exact.

With M masters (`masters.count`) each master runs its share of every micro-batch's sequences
through the backbone, and sends their rows to the shared ExpertManagers. With
`masters.sequence_migration` on, after every decoder layer that holds a MoE block the masters
decide together where each sequence continues: on the master whose node served most of that
layer's rows of it (`placement.migrate_sequences`, LUFFY's Algorithm 1), and its hidden states move
there. After the last decoder layer every sequence goes back to the master it started on, which
has its labels. The backward pass moves the gradients back along the same path (`_Move`, an
autograd Function). Every layer sees the very rows it would have seen without migration, so
losses and gradients are unchanged: the math is the same, only bytes move differently.

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
  * a sequence moves at the decoder layer's boundary, after the combine: the layer's expert outputs
    return to the old master and the combined hidden state moves (one row per token). LUFFY gathers
    the outputs straight to the new master; that needs the workers to answer a master other than the
    one that sent the rows, which the transport (`vela_ray.model.collective`) does not do. The stats'
    `combine_*` rows measure what it could save: the gathered rows that crossed nodes, and those that would
    have crossed had each sequence combined on the node serving most of its rows (free moves);
  * each master keeps its number of sequences (the model's forward has one batch shape per master),
    so a master takes exactly as many as it gives (`capacity_sequences`); every slot is as long as the
    micro-batch's longest sequence, so Eq. 1 decides where sequences go but the attention still runs padded;
  * packed rows (`position_ids`, several documents per row) do not move (`skipped`);
  * training forwards only: evaluation runs on master 0 alone.

Every master decides from the same numbers (the served rows of every sequence, summed over the
masters), so all of them compute the same moves without a coordinator.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import nn

from placement.sequences import contiguous_masters, migrate_sequences
from vela_ray.model.broker import DispatchPlan, ExpertBroker, ExpertDispatcher
from vela_ray.training.replicas import Batch, Exchanger, ReplicaShare

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
    sent_bytes: int = 0  # hidden states and their gradients this master sent to other masters
    cross_node_bytes: int = 0  # the part of sent_bytes that went to a master on another node
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
    layer_kwargs: dict[int, dict] | None = None  # padded: what each decoder layer gets for the whole micro-batch
    served: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # MoE layer -> (tokens, workers)


class SequenceMigration:
    """One master's side: hooks on its decoder layers and its brokers' plans (see the module docstring)."""

    def __init__(self, model: nn.Module, dispatcher: ExpertDispatcher, rank: int, num_masters: int,
                 nodes: NodeMap, candidates: int = 1):
        """`candidates`: LUFFY's q, the masters of least traffic a sequence may choose among (balanced by
        attention load)."""
        if len(nodes.master_node_M) != num_masters:
            raise ValueError(f"NodeMap names {len(nodes.master_node_M)} masters' nodes, the job has {num_masters}")
        self.rank, self.num_masters, self.nodes, self.candidates = rank, num_masters, nodes, candidates
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
        dispatcher.plan_observer = self._observe

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
        self.stats.micro_batches += 1
        if "position_ids" in full:  # packed rows: several documents per row, their masks built from positions
            self.stats.skipped += 1
            return
        ids = full["input_ids"]
        mask = full.get("attention_mask")
        tokens_S = [ids.shape[1]] * ids.shape[0] if mask is None else mask.sum(dim=1).tolist()
        master_S = contiguous_masters(ids.shape[0], self.num_masters)  # as `shard_rows` splits
        home = [np.flatnonzero(master_S == m).tolist() for m in range(self.num_masters)]
        self._batch = _MicroBatch(exchanger, [list(s) for s in home], home, [int(t) for t in tokens_S])

    def _probe(self, model: nn.Module, full: Batch) -> dict[int, dict]:
        """What every decoder layer is given for the whole micro-batch (attention masks, positions), read by
        running the model's forward up to its layers on all the sequences, which every master has: a moved
        padded sequence then gets its own rows of them wherever it is, and no mask crosses the network. The
        model builds masks row by row, so a sequence's rows are the ones it gets unmoved."""
        seen: dict[int, dict] = {}
        own = {index: layer.__dict__.get("forward") for index, layer in enumerate(self._stack)}  # patched by others

        def recorder(index: int):
            def forward(hidden, *args, **kwargs):
                seen[index] = kwargs
                if index == len(self._stack) - 1:
                    raise _ProbeDone
                return hidden
            return forward

        batch, self._batch = self._batch, None  # no hooks of ours during the probe
        try:
            for index, layer in enumerate(self._stack):
                layer.forward = recorder(index)
            with torch.no_grad():
                model(**full, use_cache=False)
        except _ProbeDone:
            pass
        finally:
            for index, layer in enumerate(self._stack):
                if own[index] is None:
                    del layer.forward  # the class's forward again
                else:
                    layer.forward = own[index]
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

    def _observe(self, plan: DispatchPlan, token_T: torch.Tensor | None) -> None:
        if self._batch is None:
            return
        token_R = plan.token_idx_R if token_T is None else token_T.cpu()[plan.token_idx_R]
        worker_R = torch.cat([torch.full((e - s,), w, dtype=torch.long) for w, s, e in plan.worker_rows]) \
            if plan.worker_rows else torch.zeros(0, dtype=torch.long)
        self._batch.served[plan.layer] = (token_R, worker_R)

    def _hook(self, decoder: int):
        def hook(module: nn.Module, args, output):
            batch = self._batch
            if batch is None:
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            target = batch.home if decoder == self._last else self._plan(batch, decoder, hidden)
            if target == batch.slots:
                return None
            moved = _Move.apply(hidden, _Exchange(self, batch.exchanger, batch.slots, target))
            batch.slots = target
            return (moved, *output[1:]) if isinstance(output, tuple) else moved
        return hook

    def _plan(self, batch: _MicroBatch, decoder: int, hidden_BTD: torch.Tensor) -> Slots:
        """Every master's new slots after MoE decoder layer `decoder` (the same on every master)."""
        token_R, worker_R = batch.served.pop(self._moe_of_decoder[decoder])
        num_tokens = hidden_BTD.shape[1]
        total = sum(len(s) for s in batch.slots)
        served_SW = torch.zeros(total, len(self.nodes.worker_node_W), dtype=torch.long)
        mine = torch.tensor(batch.slots[self.rank], dtype=torch.long)
        served_SW.index_put_((mine[token_R // num_tokens], worker_R), torch.ones_like(worker_R), accumulate=True)
        served_SN = (batch.exchanger.sum_tensor(served_SW) @ self._worker_nodes).numpy()
        current_S = np.empty(total, dtype=np.int64)
        for master, seqs in enumerate(batch.slots):
            current_S[seqs] = master
        if self.rank == 0:
            rows_S = served_SN.sum(axis=1)
            master_nodes = sorted(set(self.nodes.master_node_M))
            self.stats.combine_rows += int(rows_S.sum())
            here_S = served_SN[np.arange(total), np.asarray(self.nodes.master_node_M)[current_S]]
            self.stats.combine_cross_node_rows += int((rows_S - here_S).sum())
            self.stats.combine_cross_node_rows_best_node += int((rows_S - served_SN[:, master_nodes].max(axis=1)).sum())
        next_S = migrate_sequences(batch.tokens_S, served_SN, self.nodes.master_node_M, q=self.candidates,
                                   current_S=current_S, hidden_size=hidden_BTD.shape[-1],
                                   capacity_tokens=[len(s) * num_tokens for s in batch.slots],
                                   capacity_sequences=[len(s) for s in batch.slots])
        return reslot(batch.slots, next_S)

    def _count(self, outgoing: dict[int, torch.Tensor]) -> None:
        for master, tensor in outgoing.items():
            size = tensor.numel() * tensor.element_size()
            self.stats.sent_bytes += size
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


def reslot(slots: Slots, next_S: np.ndarray) -> Slots:
    """The masters' slots after each sequence s moved to master next_S[s]: a sequence that stays keeps its
    slot, the ones that arrive fill the freed slots in sequence order."""
    out = []
    for master, seqs in enumerate(slots):
        arriving = iter(sorted(s for s in range(len(next_S)) if next_S[s] == master and s not in seqs))
        out.append([s if next_S[s] == master else next(arriving) for s in seqs])
    return out


@dataclass
class _Exchange:
    """One move of every master's sequences from `before` to `after` slots, as this master sees it."""

    migration: SequenceMigration
    exchanger: Exchanger
    before: Slots
    after: Slots

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
        arriving: dict[int, list[int]] = {}
        for s in sorted(set(mine_after) - set(mine_before)):
            arriving.setdefault(where[s], []).append(s)
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


class _Move(torch.autograd.Function):
    """Hidden states [B, T, D] in this master's slots before a move -> after it; backward: the reverse."""

    @staticmethod
    def forward(ctx, hidden_BTD: torch.Tensor, exchange: _Exchange):
        ctx.exchange = exchange
        rank = exchange.migration.rank
        exchange.migration.stats.moves += len(set(exchange.before[rank]) - set(exchange.after[rank]))
        return exchange.run(hidden_BTD.detach(), exchange.before, exchange.after)

    @staticmethod
    def backward(ctx, grad_BTD: torch.Tensor):
        exchange = ctx.exchange
        return exchange.run(grad_BTD.contiguous(), exchange.after, exchange.before), None


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
