"""`TokenizedDataset`: N fixed-length rows of token ids, labels and masks, the one shape every kind of
fine-tuning data becomes (`vela_ray.data.datasets` builds them, `vela_ray.data.examples` and
`vela_ray.data.preference` lay them out), and `DataStats`: what became of a file's examples on the way
(kept, truncated, dropped and why).

An example may take several adjacent rows (`TokenizedDataset.group`: a preference pair is its chosen then its
rejected sequence); whatever selects rows (batches, the eval hold-out) selects whole examples, so the rows of one
example are never parted. Unpaired preference (KTO) data carries one more tensor, `TokenizedDataset.desirable`:
each row's label, which travels with the row into batches, splits and subsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

Batch = dict[str, torch.Tensor]

LOSS_WARNING_SHARE = 0.10
"""A build that drops or truncates more than this share of its examples warns, naming the fix."""
EMPTY = "empty: no supervised token at all"
CUT_AWAY = "no supervised token left after truncation"
"""`DataStats.dropped` reasons of `vela_ray.data.examples` (other steps may add their own)."""
PROMPT_FILLS = "the prompt alone fills seq_len"
"""The `DataStats.dropped` reason of a preference pair or an unpaired preference example whose prompt leaves no
room for an answer token (TRL's DPOTrainer and KTOTrainer drop those too)."""


@dataclass(frozen=True)
class DataStats:
    """How the examples of one file (instruct, chat, preference and unpaired preference data) became rows: the
    whole build, before any train/eval split (`TokenizedDataset.split` and `subset` keep it as it is)."""

    examples: int
    """Examples read: records that reached tokenisation, plus those dropped before it (`dropped`)."""
    kept: int
    """Examples in the rows, whole or truncated."""
    truncated: int
    """Of the kept, examples longer than `seq_len` and cut to it (`truncation`)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Examples not in the rows, by reason (`EMPTY`, `CUT_AWAY`, or a reason of a step before tokenisation)."""
    supervised_tokens: int = 0
    """Label tokens (the answers) of every example read, before truncation."""
    supervised_tokens_lost: int = 0
    """Of them, those truncation cut off, the dropped examples' included."""
    longest: int = 0
    """Tokens of the longest example."""
    seq_len_p90: int = 0
    """The shortest seq_len that would hold 90% of the examples whole."""
    seq_len: int = 0
    truncation: str = "right"
    rows: int = 0
    """Rows built from the kept examples (one each padded; several each packed)."""
    padding_fraction: float = 0.0
    """Share of those rows' token slots that are padding."""
    pairs: bool = False
    """The examples are preference pairs (two rows each: `vela_ray.data.preference`), their supervised tokens
    the two answers'."""
    keep_start: bool = False
    """The rows were cut as TRL's preference trainers cut them (kinds preference and unpaired_preference): each
    sequence's first seq_len tokens, an example whose prompt fills seq_len dropped (`PROMPT_FILLS`);
    data.truncation keep_answer does not apply."""
    desirable: int | None = None
    """Unpaired preference (KTO) data: of the kept, the examples labelled desirable (None for other kinds)."""
    undesirable: int | None = None
    """Unpaired preference (KTO) data: of the kept, the examples labelled undesirable (None for other kinds)."""

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def lost_share(self) -> float:
        """Share of the examples dropped or truncated."""
        return (self.num_dropped + self.truncated) / max(1, self.examples)

    def warning(self, source: str) -> str | None:
        """The warning when more than `LOSS_WARNING_SHARE` of the examples were dropped or truncated, naming
        the fix (raise data.seq_len, or data.truncation: keep_answer); None when fewer were."""
        if self.lost_share <= LOSS_WARNING_SHARE:
            return None
        reasons = "".join(f"; {count} dropped ({reason})" for reason, count in self.dropped.items())
        lost = self.supervised_tokens_lost / max(1, self.supervised_tokens)
        unit = "pairs" if self.pairs else "examples"
        fixes = []
        if self.truncated or self.dropped.get(CUT_AWAY) or self.dropped.get(PROMPT_FILLS):
            fixes.append(f"raise data.seq_len ({self.seq_len_p90} holds 90% of the {unit} whole, the longest "
                         f"has {self.longest} tokens)")
            if self.truncation == "right" and not self.keep_start:
                fixes.append("set data.truncation: keep_answer (cuts the prompt's middle, keeps the answer)")
        if set(self.dropped) - {CUT_AWAY, PROMPT_FILLS}:
            fixes.append("check the records dropped for another reason")
        how = "each sequence's first seq_len tokens, TRL's keep_start" if self.keep_start else \
            f"data.truncation: {self.truncation}"
        return (f"{source}: {self.lost_share:.0%} of {self.examples} {unit} dropped or truncated at data.seq_len="
                f"{self.seq_len}: {self.truncated} truncated ({how}){reasons}; "
                f"{lost:.1%} of the supervised tokens cut; " + " or ".join(fixes))


@dataclass(frozen=True)
class TokenizedDataset:
    """N fixed-length rows: `input_ids`, `labels`, `attention_mask`, each a LongTensor [N, S]; `group` adjacent
    rows per example."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    """1 on example tokens, 0 on padding (kept for packed rows too, where batches omit it)."""
    source: str
    position_ids: torch.Tensor | None = None
    """Packed rows only (`examples.packed_rows`): positions restarting at 0 at every example."""
    stats: DataStats | None = None
    """Instruct, chat, preference and unpaired preference data: what became of the file's examples (None: text
    data, or rows made by hand)."""
    group: int = 1
    """Rows per example: 1, or 2 for preference pairs (example i is rows 2i, its chosen sequence, and 2i + 1, its
    rejected one). Batches, splits and subsets take whole examples (`example_rows`)."""
    desirable: torch.Tensor | None = None
    """Unpaired preference (KTO) data: a BoolTensor [N], each row's label (True: desirable), carried into batches
    (``batch["desirable"]``), splits and subsets; None for other kinds."""

    def __post_init__(self):
        if self.group < 1 or len(self) % self.group:
            raise ValueError(f"{self.source}: {len(self)} rows are not whole examples of {self.group} rows each")
        if self.desirable is not None and (self.desirable.dtype != torch.bool or
                                           tuple(self.desirable.shape) != (len(self),)):
            raise ValueError(f"{self.source}: desirable must be a bool tensor of one label per row ({len(self)}), "
                             f"got {self.desirable.dtype} {tuple(self.desirable.shape)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_examples(self) -> int:
        """Examples (preference pairs: pairs) in the data set: `len(self) // group`."""
        return len(self) // self.group

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens in the whole data set."""
        return int(self.attention_mask.sum())

    @property
    def padding_fraction(self) -> float:
        """Share of the token slots that are padding: compute spent on nothing."""
        return 1.0 - self.num_tokens / max(1, self.attention_mask.numel())

    def example_rows(self, examples: torch.Tensor | np.ndarray | list[int]) -> np.ndarray:
        """The row indices of `examples`, in their order, each example's `group` rows adjacent (the identity for
        one row per example)."""
        examples = np.asarray(examples, dtype=np.int64)
        if self.group == 1:
            return examples
        return (examples[:, None] * self.group + np.arange(self.group)).reshape(-1)

    def rows(self, index: torch.Tensor | np.ndarray | list[int], token_mask: bool = False) -> Batch:
        """A batch of these rows: the model's keyword arguments. Packed rows carry `position_ids` and no
        `attention_mask`: transformers then masks attention block-diagonally, one block per example (see
        `vela_ray.data.examples`). `token_mask` adds the padding mask to packed rows too, for counting
        tokens (the routing profiler), not for the model. Unpaired preference rows add ``desirable`` [B] bool,
        for the loss, not for the model."""
        index = torch.as_tensor(index, dtype=torch.long)
        batch = {"input_ids": self.input_ids[index], "labels": self.labels[index]}
        if self.position_ids is None or token_mask:
            batch["attention_mask"] = self.attention_mask[index]
        if self.position_ids is not None:
            batch["position_ids"] = self.position_ids[index]
        if self.desirable is not None:
            batch["desirable"] = self.desirable[index]
        return batch

    def subset(self, index: torch.Tensor | np.ndarray | list[int], source: str) -> TokenizedDataset:
        """These rows at `index` (whole examples: see `example_rows`); `stats` stays the whole build's."""
        index = torch.as_tensor(index, dtype=torch.long)
        positions = None if self.position_ids is None else self.position_ids[index]
        desirable = None if self.desirable is None else self.desirable[index]
        return TokenizedDataset(self.input_ids[index], self.labels[index], self.attention_mask[index], source,
                                positions, self.stats, self.group, desirable)

    def split(self, eval_fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset]:
        """(train, eval): a seeded random `eval_fraction` of the examples (whole preference pairs) is held out;
        both must be non-empty."""
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        count = self.num_examples
        num_eval = int(round(count * eval_fraction))
        if num_eval == 0 or num_eval == count:
            what = f"{count} rows" if self.group == 1 else f"{count} examples ({self.group} rows each)"
            raise ValueError(
                f"{self.source}: eval_fraction {eval_fraction} of {what} leaves an empty "
                "train or eval set; use more data or another fraction"
            )
        order = np.random.default_rng([seed, 0xE7A1]).permutation(count)
        eval_examples, train_examples = np.sort(order[:num_eval]), np.sort(order[num_eval:])
        return (self.subset(self.example_rows(train_examples), f"{self.source} [train]"),
                self.subset(self.example_rows(eval_examples), f"{self.source} [eval]"))
