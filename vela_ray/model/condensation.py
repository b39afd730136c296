"""LUFFY's token condensation (opt-in, LOSSY): rows routed to the same expert that are nearly alike travel once.

LUFFY (paper §V) observes that many tokens a layer routes to one expert are very similar, and
sends only one of them. Here, in one MoE layer, the broker's rows for the same expert are
compared; of each group of similar rows one *representative* is sent to the expert and every
*condensed* row takes the representative's output:

    out_i = f_e(x_rep(i))

Autograd is exact for that computation (`Condenser.expand` is an `index_select`): the
representative's input gets the sum of its group's output gradients through the expert;
condensed rows get none through the expert path (their routing weights still get theirs).
Training forwards only: the broker leaves eval and no-grad forwards exact, so eval loss
measures the trained model.

Similarity scale. The paper's similarity lies in [0, 1]; here s = clamp(cos, 0, 1), not
(cos + 1) / 2. Eq. 2's threshold never exceeds 0.5 while the loss falls, and on the
(cos + 1) / 2 scale 0.5 is orthogonality: from the first step every positively correlated
pair would condense (68-88% of the same-expert pairs, by layer, of the tiny pre-trained
Mixtral on WikiText-2). Clamped, 0 keeps the paper's meaning of "unrelated" (pairs of
different experts and pairs history calls dissimilar get weight 0), orthogonal or opposite
rows never condense whatever the threshold, and h = 0.5 means cos > 0.5 (5-12% of those pairs).

Selection (`select_representatives`), per layer:
  1. expert activation: only rows of the same expert are compared;
  2. history: a pair whose weight in the previous MoE layer of the same forward was above S1
     is taken as similar (weight 1), below S2 as dissimilar (weight 0), without recomputing
     (`PairHistory`, keyed by the token's index within the forward; the paper carries the
     assigned weight on, so a pair taken as similar stays so while it shares an expert);
  3. exact similarity for the remaining pairs: blockwise matmul of each group's normalized rows;
  4. graph: keep the pairs with s > threshold; repeatedly keep the remaining row of highest
     degree and condense its remaining neighbours into it, until no edge is left (every
     remaining row then represents itself).

Threshold (`Condenser.threshold`): fixed, or LUFFY's loss-adaptive Eq. 2,
h_t = 1 / (1 + exp(l_norm)), l_norm = (l_ini - l_{t-1}) / l_ini, which starts at 0.5 and
falls as the loss does (`Condenser.observe_loss` after each step).

    condenser = Condenser(config.training.condensation)
    ExpertDispatcher(table, transport, condenser=condenser)   # its `Condensation` stage selects and expands
    ...; condenser.observe_loss(loss)            # after each training step

Every master rank's dispatcher has a `Condenser` of its own and condenses the rows it sends (a data-parallel
master its share of the batch, a tensor-parallel rank its share of each layer's rows, keyed by the model's
token); each observes the loss of the whole batch, so all follow one threshold, and the run adds their
counters (`CondenserCounts`).

Legend: R = routed rows of one layer, D = hidden, n = rows of one expert group,
S = rows per token in a layer (its top-k).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from vela_ray.model.traffic import DIRECTIONS

if TYPE_CHECKING:
    from vela_ray.model.dispatch_stages import BrokerCall

BLOCK = 1024
"""Rows per side of one similarity matmul: bounds the temporaries at [BLOCK, BLOCK]."""


# --- history: the previous layer's pair states ------------------------------------------------------


@dataclass(frozen=True)
class PairHistory:
    """One layer's pair states for the next layer's step 2: +1 similar (s > S1), -1 dissimilar (s < S2), 0 neither.

    Kept per expert group (the pairs that layer compared) and looked up by token key. A token's
    rows in one layer carry the same hidden vector, so a pair's state does not depend on which
    of its shared groups compared it.
    """

    codes: torch.Tensor  # flat int8: every group's [n_g, n_g] block, row-major, one after another
    slot_start: torch.Tensor  # [keys, S] start in `codes` of the block of the group of the key's s-th row; -1 none
    slot_size: torch.Tensor  # [keys, S] that group's n_g
    slot_pos: torch.Tensor  # [keys, S] the row's position in it

    @classmethod
    def of(cls, keys_G: list[torch.Tensor], codes_G: list[torch.Tensor]) -> PairHistory:
        """From each group's row keys [n_g] and pair states [n_g, n_g]."""
        device = codes_G[0].device if codes_G else torch.device("cpu")
        sizes = torch.tensor([len(k) for k in keys_G], dtype=torch.long, device=device)
        starts = torch.cumsum(sizes * sizes, 0) - sizes * sizes
        keys = torch.cat(keys_G) if keys_G else torch.zeros(0, dtype=torch.long, device=device)
        slot = _rank_within(keys)
        shape = (int(keys.max()) + 1 if len(keys) else 0, int(slot.max()) + 1 if len(slot) else 0)
        tables = [torch.full(shape, -1, dtype=torch.long, device=device) for _ in range(3)]
        positions = torch.cat([torch.arange(len(k), device=device) for k in keys_G]) if keys_G else keys
        for table, values in zip(tables, (starts.repeat_interleave(sizes), sizes.repeat_interleave(sizes), positions)):
            table[keys, slot] = values
        flat = torch.cat([c.reshape(-1) for c in codes_G]) if codes_G else torch.zeros(0, dtype=torch.int8)
        return cls(flat, *tables)

    def states(self, keys_a: torch.Tensor, keys_b: torch.Tensor) -> torch.Tensor:
        """[a, b] int8 state of each pair (keys_a[i], keys_b[j]) some group of the layer compared; 0 elsewhere."""
        out = torch.zeros(len(keys_a), len(keys_b), dtype=torch.int8, device=keys_a.device)
        if not self.codes.numel() or not out.numel():
            return out
        start_a, size_a, pos_a = self._slots(keys_a)
        start_b, _, pos_b = self._slots(keys_b)
        for sa in range(start_a.shape[1]):
            for sb in range(start_b.shape[1]):
                same = (start_a[:, sa, None] == start_b[None, :, sb]) & (start_a[:, sa, None] >= 0)
                i, j = same.nonzero(as_tuple=True)  # about 1 pair in E shares a group: gather only those
                out[i, j] = self.codes[start_a[i, sa] + pos_a[i, sa] * size_a[i, sa] + pos_b[j, sb]]
        return out

    def _slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(start, size, pos) [len(keys), S] of each key's rows; keys the layer did not see get start -1."""
        known = keys < self.slot_start.shape[0]
        safe = torch.where(known, keys, 0)
        start = torch.where(known[:, None], self.slot_start[safe], -1)
        return start, self.slot_size[safe], self.slot_pos[safe]


def _rank_within(keys: torch.Tensor) -> torch.Tensor:
    """[R] 0, 1, ... for the successive rows of each key (a token's top-k rows get slots 0..k-1)."""
    order = torch.argsort(keys, stable=True)
    ordered = keys[order]
    index = torch.arange(len(keys), device=keys.device)
    new_run = torch.ones_like(ordered, dtype=torch.bool)
    new_run[1:] = ordered[1:] != ordered[:-1]
    run_start = torch.cummax(torch.where(new_run, index, 0), 0).values if len(keys) else index
    rank = torch.empty_like(index)
    rank[order] = index - run_start
    return rank


# --- selection ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which rows of one layer travel: each row is a representative or condensed into one."""

    representative_R: torch.Tensor  # [R] row whose expert output the row takes (itself for a representative)
    pairs_computed: int  # same-expert pairs whose similarity was calculated (step 3)
    pairs_from_history: int  # same-expert pairs the previous layer decided (step 2)
    history: PairHistory  # this layer's pair states, for the next layer

    @property
    def kept_R(self) -> torch.Tensor:
        """[R] bool: the representatives, the rows that travel."""
        return self.representative_R == torch.arange(len(self.representative_R))

    @property
    def source_R(self) -> torch.Tensor:
        """[R] position of each row's representative among the kept rows (what `Condenser.expand` gathers)."""
        return (torch.cumsum(self.kept_R.long(), 0) - 1)[self.representative_R]

    @property
    def num_condensed(self) -> int:
        return int((~self.kept_R).sum())


def select_representatives(
    rows_RD: torch.Tensor, expert_R: torch.Tensor, threshold: float, *, keys_R: torch.Tensor | None = None,
    history: PairHistory | None = None, similar_above: float = 0.8, dissimilar_below: float = 0.2,
    block: int = BLOCK,
) -> Selection:
    """LUFFY's selection (module docstring, steps 1-4) for one layer's rows [R, D] and their experts [R].

    `keys_R`: each row's token (default: every row its own), which keys `history`, the previous
    layer's `Selection.history`. Pairs with s > `threshold` condense; s = clamp(cos, 0, 1).
    """
    device = rows_RD.device
    num_rows = rows_RD.shape[0]
    keys_R = torch.arange(num_rows) if keys_R is None else keys_R
    keys_R, expert_R = keys_R.to(device, torch.long), expert_R.to(device, torch.long)
    representative_R = torch.arange(num_rows, device=device)
    computed = decided = 0
    keys_G, codes_G = [], []
    for rows_n in _expert_groups(expert_R):
        weights_nn, c, d = _group_weights(F.normalize(rows_RD[rows_n].float(), dim=1), keys_R[rows_n], history, block)
        computed, decided = computed + c, decided + d
        representative_R[rows_n] = rows_n[torch.from_numpy(_greedy((weights_nn > threshold).cpu().numpy())).to(device)]
        keys_G.append(keys_R[rows_n])
        codes_G.append((weights_nn > similar_above).to(torch.int8) - (weights_nn < dissimilar_below).to(torch.int8))
    return Selection(representative_R.cpu(), computed, decided, PairHistory.of(keys_G, codes_G))


def _expert_groups(expert_R: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each expert's rows (step 1: only these are compared)."""
    order = torch.argsort(expert_R, stable=True)
    _, counts = torch.unique_consecutive(expert_R[order], return_counts=True)
    return list(torch.split(order, counts.tolist()))


def _group_weights(unit_nD: torch.Tensor, keys_n: torch.Tensor, history: PairHistory | None,
                   block: int) -> tuple[torch.Tensor, int, int]:
    """(symmetric [n, n] pair weights with a zero diagonal, pairs computed, pairs decided by history).

    Steps 2 and 3, a block of rows at a time: history's similar pairs weigh 1 and dissimilar
    ones 0; a row block's matmul runs only when some of its pairs are undecided ("computed"
    counts the undecided pairs, the similarities step 3 needs).
    """
    n = unit_nD.shape[0]
    weights_nn = torch.empty(n, n, device=unit_nD.device)
    decided = 0
    for i in range(0, n, block):
        a = slice(i, i + block)
        if history is None:
            torch.matmul(unit_nD[a], unit_nD.T, out=weights_nn[a])
            continue
        state = history.states(keys_n[a], keys_n)
        known = state != 0
        decided += int(torch.count_nonzero(known)) - int(torch.count_nonzero(known[:, a].diagonal()))
        part = weights_nn[a]
        if bool(known.all()):
            part.copy_(state > 0)
        else:
            torch.matmul(unit_nD[a], unit_nD.T, out=part)
            part.masked_fill_(known, 0.0).masked_fill_(state > 0, 1.0)
    weights_nn.clamp_(0, 1).fill_diagonal_(0)
    weights_nn = torch.maximum(weights_nn, weights_nn.T)  # blockwise matmuls need not round symmetrically
    decided //= 2  # each pair was seen from both of its rows
    return weights_nn, n * (n - 1) // 2 - decided, decided


def _greedy(adjacent_nn: np.ndarray) -> np.ndarray:
    """[n] local index of each row's representative: step 4 on a symmetric bool graph without self-loops.

    NumPy, not torch: the loop runs once per kept hub, and on groups of a few hundred rows torch's
    per-call overhead made it 7x slower. Ties in degree go to the lowest index (argmax returns the
    first maximum), so the result is deterministic.
    """
    n = adjacent_nn.shape[0]
    representative_n = np.arange(n)
    degree_n = adjacent_nn.sum(1, dtype=np.int32)
    alive_n = np.ones(n, dtype=bool)
    while n:
        hub = int(degree_n.argmax())
        if degree_n[hub] <= 0:
            break
        members_n = adjacent_nn[hub] & alive_n
        representative_n[members_n] = hub
        members_n[hub] = True
        alive_n &= ~members_n
        degree_n -= adjacent_nn[members_n].sum(0, dtype=np.int32)
        degree_n[members_n] = -1  # gone: never picked again
    return representative_n


# --- the threshold and the dispatcher's state -------------------------------------------------------


class CondensationSettings(Protocol):
    """What a `Condenser` reads of its config: `vela_ray.config.CondensationSection` (the model side sits below it)."""

    threshold: float | Literal["adaptive"]
    similar_above: float
    dissimilar_below: float


def adaptive_threshold(first_loss: float | None, last_loss: float | None) -> float:
    """LUFFY's Eq. 2: h_t = 1 / (1 + exp(l_norm)), l_norm = (l_ini - l_{t-1}) / l_ini; 0.5 before any loss."""
    if first_loss is None or last_loss is None or first_loss == 0:
        return 0.5
    l_norm = min(max((first_loss - last_loss) / first_loss, -50.0), 50.0)
    return 1.0 / (1.0 + math.exp(l_norm))


@dataclass(frozen=True)
class CondenserCounts:
    """What a `Condenser` counted (`Condenser.counts`), a step's part of it (a difference), or the sum over master
    ranks: the counters the run's summary reports (`summary.CondensationRecord`, same names)."""

    rows_seen: int = 0  # routed rows of the training forwards
    rows_condensed: int = 0  # of them, rows that took their representative's output
    pairs_computed: int = 0  # same-expert pairs whose similarity was calculated
    pairs_from_history: int = 0  # same-expert pairs the previous layer decided
    select_s: float = 0.0  # seconds spent selecting
    bytes_saved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))  # by direction

    def __add__(self, other: CondenserCounts) -> CondenserCounts:
        return self._combined(other, 1)

    def __sub__(self, other: CondenserCounts) -> CondenserCounts:
        return self._combined(other, -1)

    def _combined(self, other: CondenserCounts, sign: int) -> CondenserCounts:
        scalars = {f.name: getattr(self, f.name) + sign * getattr(other, f.name) for f in fields(self)
                   if f.name != "bytes_saved"}
        saved = {d: self.bytes_saved.get(d, 0) + sign * other.bytes_saved.get(d, 0)
                 for d in dict.fromkeys([*self.bytes_saved, *other.bytes_saved])}
        return CondenserCounts(**scalars, bytes_saved=saved)

    def as_dict(self) -> dict:
        return asdict(self)


class Condenser:
    """What an `ExpertDispatcher` holds for token condensation: the settings, the threshold and the counters.

    One per dispatcher (it keeps the current forward's history between layers), not shared
    between threads. Counters cover training forwards and their backwards only:
    `bytes_saved` by the broker's traffic directions (dispatch and gather when a layer is
    selected, grad_dispatch and grad_gather when its backward runs).
    """

    def __init__(self, config: CondensationSettings):
        self.config = config
        self.rows_seen = 0
        self.rows_condensed = 0
        self.pairs_computed = 0
        self.pairs_from_history = 0
        self.select_seconds = 0.0
        self.bytes_saved = dict.fromkeys(DIRECTIONS, 0)
        self._first_loss: float | None = None
        self._last_loss: float | None = None
        self._previous: tuple[int, PairHistory] | None = None  # (layer, its history) of the current forward

    @property
    def threshold(self) -> float:
        """The similarity (clamped cosine) a pair must exceed to condense in the next step."""
        if self.config.threshold == "adaptive":
            return adaptive_threshold(self._first_loss, self._last_loss)
        return float(self.config.threshold)

    @property
    def policy(self) -> str:
        return "adaptive" if self.config.threshold == "adaptive" else f"fixed {self.config.threshold:g}"

    def observe_loss(self, loss: float) -> None:
        """A training step's loss, for the adaptive threshold (non-finite losses are skipped)."""
        if not math.isfinite(loss):
            return
        if self._first_loss is None:
            self._first_loss = loss
        self._last_loss = loss

    def counts(self) -> CondenserCounts:
        """The counters so far."""
        return CondenserCounts(self.rows_seen, self.rows_condensed, self.pairs_computed, self.pairs_from_history,
                               self.select_seconds, dict(self.bytes_saved))

    def forget_history(self) -> None:
        """The forward's rows changed tokens (sequence migration moved sequences between masters after a layer):
        the next layer compares all its pairs, as history is keyed by the token's place in this forward."""
        self._previous = None

    def state(self) -> dict:
        """What a checkpoint keeps: the losses the adaptive threshold follows."""
        return {"first_loss": self._first_loss, "last_loss": self._last_loss}

    def load_state(self, state: dict | None) -> None:
        state = state or {}
        self._first_loss, self._last_loss = state.get("first_loss"), state.get("last_loss")

    def select(self, layer: int, rows_RD: torch.Tensor, expert_R: torch.Tensor, keys_R: torch.Tensor) -> Selection:
        """The rows of MoE layer `layer` that travel; history is used when the previous call was layer - 1."""
        start = time.perf_counter()
        previous = self._previous[1] if self._previous and self._previous[0] == layer - 1 else None
        # History may only shortcut what the threshold would decide: a pair it calls similar must pass both.
        selection = select_representatives(
            rows_RD, expert_R, self.threshold, keys_R=keys_R, history=previous,
            similar_above=max(self.config.similar_above, self.threshold),
            dissimilar_below=self.config.dissimilar_below)
        self._previous = (layer, selection.history)
        self.rows_seen += rows_RD.shape[0]
        self.rows_condensed += selection.num_condensed
        self.pairs_computed += selection.pairs_computed
        self.pairs_from_history += selection.pairs_from_history
        self._saved(("dispatch", "gather"), selection.num_condensed * _row_bytes(rows_RD))
        self.select_seconds += time.perf_counter() - start
        return selection

    def expand(self, selection: Selection, outputs_KD: torch.Tensor) -> torch.Tensor:
        """[R, D] every row's expert output from the representatives' [K, D] (K kept rows).

        An index_select, so autograd sums each group's output gradients into its representative's.
        """
        if outputs_KD.requires_grad and selection.num_condensed:
            saved = selection.num_condensed * _row_bytes(outputs_KD)
            outputs_KD.register_hook(lambda grad: self._saved(("grad_dispatch", "grad_gather"), saved))
        return outputs_KD.index_select(0, selection.source_R.to(outputs_KD.device))

    def _saved(self, directions: tuple[str, ...], nbytes: int) -> None:
        for direction in directions:
            self.bytes_saved[direction] += nbytes


class Condensation:
    """The dispatcher's condensation stage (`dispatch_stages`): a training forward sends only the representatives
    of its rows, and every row takes its representative's output. Eval and no-grad forwards choose nothing, so
    they stay exact; a checkpoint's recompute takes its first forward's selection (`CheckpointReplay`)."""

    def __init__(self, condenser: Condenser):
        self.condenser = condenser

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        if call.replayed_RD is not None or not (call.track_grad and call.training):
            return call
        plan = call.plan
        rows_RD = call.hidden_TD.detach().index_select(0, plan.token_idx_R.to(call.hidden_TD.device))
        token_R = plan.token_idx_R if call.token_T is None else call.token_T.cpu()[plan.token_idx_R]
        selection = self.condenser.select(call.layer, rows_RD, plan.expert_ids_R, token_R)
        return replace(call, selection=selection, sent=plan.subset(selection.kept_R))

    def combine(self, call: BrokerCall, out: torch.Tensor) -> torch.Tensor:
        return out if call.selection is None else self.condenser.expand(call.selection, out)


def _row_bytes(rows: torch.Tensor) -> int:
    """Bytes of one row as the broker counts it (the workers answer in the rows' dtype)."""
    return rows.shape[1] * rows.element_size()
