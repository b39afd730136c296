"""Tokenised training examples and the two ways to lay them into fixed-length rows.

An `Example` is one instruction or conversation as token ids with its labels
(`IGNORE_INDEX` where the loss does not look: prompts, user turns, template text).
Rows of S tokens are made in one of two ways:

* `padded_rows`: one example per row, padding masked out of loss and attention;
* `packed_rows`: several examples per row, laid end to end (best-fit decreasing: the longest example first,
  each into the row with the least room that holds it; within a row in data order). `position_ids` restart
  at 0 at each example, and the batch carries no `attention_mask`: transformers then builds a block-diagonal
  causal mask from the position ids (`masking_utils.find_packed_sequence_indices`), so no token attends to
  another example. The first label of every example is `IGNORE_INDEX`, so the loss never predicts one
  example's first token from the previous example's last. The padding at a row's end forms its own block
  and carries no label.

Truncation (both layouts, `data.truncation`), for an example longer than S, before any packing:

* ``right``: its first S tokens;
* ``keep_answer``: its answer (from the first label of the last run of labels, i.e. the last assistant
  turn, to the end) whole, after the prompt cut in the middle to the B = S - answer tokens left: the
  prompt's first ceil(B/2) and last floor(B/2) tokens (the task's head, and its end with the assistant
  header). An answer so long that B < min(prompt, S // 2) gets B = min(prompt, S // 2) and is itself cut
  on the right.

An example with no supervised token (empty), or left without one by truncation, is dropped. Every build
counts what it read, kept, truncated and dropped (by reason) into the rows' `DataStats`, logs it, and warns
when more than `LOSS_WARNING_SHARE` of the examples were dropped or truncated, naming the fix.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace
from typing import Literal, Mapping

import torch

from vela_ray.data.tokenized import CUT_AWAY, EMPTY, DataStats, TokenizedDataset

log = logging.getLogger(__name__)

IGNORE_INDEX = -100

Truncation = Literal["right", "keep_answer"]


@dataclass(frozen=True)
class InstructExample:
    """One instruction-following example (Alpaca fields)."""

    instruction: str
    input: str
    output: str


@dataclass(frozen=True)
class Example:
    """One tokenised example: `input_ids` and `labels` of equal length, IGNORE_INDEX where unsupervised."""

    input_ids: list[int]
    labels: list[int]

    def __post_init__(self):
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"example has {len(self.input_ids)} ids but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.input_ids)

    def truncated(self, seq_len: int, truncation: Truncation = "right") -> Example:
        """At most `seq_len` tokens, cut as `truncation` says (see the module docstring)."""
        if len(self) <= seq_len:
            return self
        if truncation == "right":
            return Example(self.input_ids[:seq_len], self.labels[:seq_len])
        answer = self.answer_start
        budget = max(seq_len - (len(self) - answer), min(answer, seq_len // 2))  # prompt tokens kept
        head, tail = (budget + 1) // 2, budget // 2
        keep = [*range(head), *range(answer - tail, answer), *range(answer, answer + seq_len - budget)]
        return Example([self.input_ids[i] for i in keep], [self.labels[i] for i in keep])

    @property
    def answer_start(self) -> int:
        """Index of the first label of the last run of labels (the last assistant turn); 0 with no label."""
        supervised = [i for i, label in enumerate(self.labels) if label != IGNORE_INDEX]
        if not supervised:
            return 0
        start = supervised[-1]
        while start > 0 and self.labels[start - 1] != IGNORE_INDEX:
            start -= 1
        return start

    @property
    def num_supervised(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def fit(examples: list[Example], seq_len: int, truncation: Truncation, source: str,
        skipped: Mapping[str, int] | None = None) -> tuple[list[Example], DataStats]:
    """The examples truncated to `seq_len`, those left with something to learn, and the counts (`rows` and
    `padding_fraction` still 0: the layout fills them in). `skipped`: examples dropped before tokenisation,
    by reason, counted as read and dropped."""
    dropped = dict(skipped or {})
    kept: list[Example] = []
    truncated = supervised = lost = 0
    for example in examples:
        cut = example.truncated(seq_len, truncation)
        before, after = example.num_supervised, cut.num_supervised
        supervised, lost = supervised + before, lost + before - after
        reason = EMPTY if not before else CUT_AWAY if not after else None
        if reason is not None:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        truncated += cut is not example
        kept.append(cut)
    lengths = sorted(len(e) for e in examples)
    stats = DataStats(examples=len(examples) + sum((skipped or {}).values()), kept=len(kept), truncated=truncated,
                      dropped=dropped, supervised_tokens=supervised, supervised_tokens_lost=lost,
                      longest=lengths[-1] if lengths else 0,
                      seq_len_p90=lengths[(9 * len(lengths) + 9) // 10 - 1] if lengths else 0,
                      seq_len=seq_len, truncation=truncation)
    if not kept:
        reasons = ", ".join(f"{count} {reason}" for reason, count in dropped.items())
        raise ValueError(f"{source}: no example has a supervised token within seq_len={seq_len} "
                         f"({len(examples)} examples: {reasons}); raise data.seq_len or check the records")
    return kept, stats


def _finish(rows: TokenizedDataset, stats: DataStats, warn: bool) -> TokenizedDataset:
    """`rows` with `stats` completed; the counts logged (INFO), and the warning (`DataStats.warning`) at WARNING,
    when `warn`; else both at DEBUG: a second build of data the driver's preflight already reported (the master's,
    whose INFO lines reach the driver's console too: the same lines printed twice more)."""
    stats = replace(stats, rows=len(rows), padding_fraction=rows.padding_fraction)
    log.log(logging.INFO if warn else logging.DEBUG, "%s: %d examples read, %d kept (%d truncated to seq_len=%d, %s), %d dropped; %d rows, %.1f%% padding",
             rows.source, stats.examples, stats.kept, stats.truncated, stats.seq_len, stats.truncation,
             stats.num_dropped, stats.rows, 100.0 * stats.padding_fraction)
    warning = stats.warning(rows.source)
    if warning is not None:
        log.log(logging.WARNING if warn else logging.DEBUG, warning)
    return replace(rows, stats=stats)


def padded_rows(examples: list[Example], seq_len: int, pad_id: int, source: str, *, truncation: Truncation = "right",
                warn: bool = True, skipped: Mapping[str, int] | None = None) -> TokenizedDataset:
    """One example per row, right-padded to `seq_len` (pad: label IGNORE_INDEX, attention 0). `truncation`,
    `skipped`: as `fit` takes them; `warn`: as `_finish` takes it."""
    kept, stats = fit(examples, seq_len, truncation, source, skipped)
    shape = (len(kept), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for row, example in enumerate(kept):
        length = len(example)
        input_ids[row, :length] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, :length] = torch.tensor(example.labels, dtype=torch.long)
        attention_mask[row, :length] = 1
    return _finish(TokenizedDataset(input_ids, labels, attention_mask, source=source), stats, warn)


def best_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Indices of `lengths` (each <= `seq_len`) grouped into rows of at most `seq_len` tokens: the longest
    first, each into the row with the least room that holds it. Rows are in order of their first index and
    list their indices in order."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row) of the rows not full, ascending
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths in data order
        at = bisect.bisect_left(room, (lengths[i], -1))  # the first row with room >= lengths[i]
        if at == len(room):
            rows.append([])
            free, row = seq_len, len(rows) - 1
        else:
            free, row = room.pop(at)
        rows[row].append(i)
        if free - lengths[i] > 0:
            bisect.insort(room, (free - lengths[i], row))
    return sorted(sorted(members) for members in rows)


def packed_rows(examples: list[Example], seq_len: int, pad_id: int, source: str, *, truncation: Truncation = "right",
                warn: bool = True, skipped: Mapping[str, int] | None = None) -> TokenizedDataset:
    """Several examples per row (`best_fit_decreasing` of what truncation leaves), position ids restarting per
    example. `truncation`, `skipped`: as `fit` takes them; `warn`: as `_finish` takes it."""
    kept, stats = fit(examples, seq_len, truncation, source, skipped)
    rows = best_fit_decreasing([len(e) for e in kept], seq_len)
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for example in (kept[i] for i in members):
            end = start + len(example)
            input_ids[r, start:end] = torch.tensor(example.input_ids, dtype=torch.long)
            labels[r, start + 1:end] = torch.tensor(example.labels[1:], dtype=torch.long)
            attention_mask[r, start:end] = 1
            position_ids[r, start:end] = torch.arange(end - start)
            start = end
        position_ids[r, start:] = torch.arange(seq_len - start)  # the padding: a block of its own
    packed = TokenizedDataset(input_ids, labels, attention_mask, source=source, position_ids=position_ids)
    return _finish(packed, stats, warn)


PACKING_TOLERANCE = 1e-5  # fp32 debug models: rounding is ~1e-7; a recurrent layer's leak can be ~1e-4


def packing_leak(model_config) -> float:
    """How much a packed example's logits change because another example precedes it in the row.

    Measured on a random debug-size model of `model_config`'s architecture (its class, layer
    types and attention settings; no weights are loaded), in eval mode so that a router that
    samples in training (PhiMoE) draws nothing: 0 up to rounding where attention honours the per-example position ids; large where a
    layer mixes tokens another way (recurrent or linear-attention layers, attention sinks).
    """
    from vela_ray.model.families import build_model, debug_config, debug_config_like

    try:
        config = debug_config_like(model_config)
    except Exception:  # a config the shrinker cannot rebuild: probe the family's own debug config
        config = debug_config(model_config.model_type)
    generator = torch.Generator().manual_seed(0)
    vocab = int(config.get_text_config().vocab_size)
    first, second = (torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 7))
    row = packed_rows([Example(first, first), Example(second, second)], 16, 0, "packing probe").rows([0])
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the caller's RNG stream stays as it was
        torch.manual_seed(0)
        model = build_model(config).float().eval()
        packed = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
        alone = model(input_ids=torch.tensor([second]), use_cache=False).logits
    return float((packed[0, len(first):len(first) + len(second)] - alone[0]).abs().max())


def check_packing(model_config, where: str) -> None:
    """Refuse `data.packing` for a model whose packed examples would see each other."""
    leak = packing_leak(model_config)
    if leak > PACKING_TOLERANCE:
        raise ValueError(
            f"{where}: data.packing would leak between examples in {type(model_config).__name__} models (an "
            f"example's logits change by {leak:.2g} when another precedes it in the row: recurrent or "
            "linear-attention layers, or attention that ignores per-example positions); set data.packing: false")
