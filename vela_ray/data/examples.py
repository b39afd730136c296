"""Tokenised training examples and the two ways to lay them into fixed-length rows.

An `Example` is one instruction or conversation as token ids with its labels
(`IGNORE_INDEX` where the loss does not look: prompts, user turns, template text).
Rows of S tokens are made in one of two ways:

* `padded_rows`: one example per row, truncated on the right to S tokens, padding
  masked out of loss and attention;
* `packed_rows`: several examples per row, laid end to end (first-fit in data order,
  an example longer than S is truncated to S first). `position_ids` restart at 0 at
  each example, and the batch carries no `attention_mask`: transformers then builds a
  block-diagonal causal mask from the position ids (`masking_utils.find_packed_sequence_indices`),
  so no token attends to another example. The first label of every example is
  `IGNORE_INDEX`, so the loss never predicts one example's first token from the previous
  example's last. The padding at a row's end forms its own block and carries no label.

Truncation policy (both layouts): an example is cut on the right at S tokens; one left
without a single supervised token is dropped and counted in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vela_ray.data.tokenized import TokenizedDataset

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


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

    def truncated(self, seq_len: int) -> "Example":
        return Example(self.input_ids[:seq_len], self.labels[:seq_len])

    @property
    def supervised(self) -> bool:
        return any(label != IGNORE_INDEX for label in self.labels)


def _fit(examples: list[Example], seq_len: int, source: str) -> list[Example]:
    """Truncate each example to `seq_len`; drop (and count) those left with nothing to learn."""
    fitted = [e.truncated(seq_len) for e in examples]
    kept = [e for e in fitted if e.supervised]
    if len(kept) < len(fitted):
        log.warning("%s: dropped %d of %d examples with no supervised token within seq_len=%d",
                    source, len(fitted) - len(kept), len(fitted), seq_len)
    if not kept:
        raise ValueError(f"{source}: no example has a supervised token within seq_len={seq_len}; "
                         "raise data.seq_len or check the records")
    return kept


def padded_rows(examples: list[Example], seq_len: int, pad_id: int, source: str) -> TokenizedDataset:
    """One example per row, right-padded to `seq_len` (pad: label IGNORE_INDEX, attention 0)."""

    kept = _fit(examples, seq_len, source)
    shape = (len(kept), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for row, example in enumerate(kept):
        length = len(example.input_ids)
        input_ids[row, :length] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, :length] = torch.tensor(example.labels, dtype=torch.long)
        attention_mask[row, :length] = 1
    return TokenizedDataset(input_ids, labels, attention_mask, source=source)


def packed_rows(examples: list[Example], seq_len: int, pad_id: int, source: str) -> TokenizedDataset:
    """Several examples per row (first-fit in data order), position ids restarting per example."""

    kept = _fit(examples, seq_len, source)
    rows: list[list[Example]] = []
    free: list[int] = []  # tokens left in each row
    for example in kept:
        length = len(example.input_ids)
        row = next((i for i, left in enumerate(free) if left >= length), None)
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(example)
        free[row] -= length
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for example in members:
            end = start + len(example.input_ids)
            input_ids[r, start:end] = torch.tensor(example.input_ids, dtype=torch.long)
            labels[r, start + 1:end] = torch.tensor(example.labels[1:], dtype=torch.long)
            attention_mask[r, start:end] = 1
            position_ids[r, start:end] = torch.arange(end - start)
            start = end
        position_ids[r, start:] = torch.arange(seq_len - start)  # the padding: a block of its own
    log.info("%s: %d examples packed into %d rows of %d (%.1f%% padding)", source, len(kept), len(rows), seq_len,
             100.0 * float(1 - attention_mask.float().mean()))
    return TokenizedDataset(input_ids, labels, attention_mask, source=source, position_ids=position_ids)


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
