"""`TokenizedDataset`: N fixed-length rows of token ids, labels and masks, the one shape every kind of
fine-tuning data becomes (`vela_ray.data.datasets` builds them, `vela_ray.data.examples` lays them out).
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TokenizedDataset:
    """N fixed-length rows: `input_ids`, `labels`, `attention_mask`, each a LongTensor [N, S]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    """1 on example tokens, 0 on padding (kept for packed rows too, where batches omit it)."""
    source: str
    position_ids: torch.Tensor | None = None
    """Packed rows only (`examples.packed_rows`): positions restarting at 0 at every example."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

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

    def rows(self, index: torch.Tensor | np.ndarray | list[int], token_mask: bool = False) -> Batch:
        """A batch of these rows: the model's keyword arguments. Packed rows carry `position_ids` and no
        `attention_mask`: transformers then masks attention block-diagonally, one block per example (see
        `vela_ray.data.examples`). `token_mask` adds the padding mask to packed rows too, for counting
        tokens (the routing profiler), not for the model."""
        index = torch.as_tensor(index, dtype=torch.long)
        batch = {"input_ids": self.input_ids[index], "labels": self.labels[index]}
        if self.position_ids is None or token_mask:
            batch["attention_mask"] = self.attention_mask[index]
        if self.position_ids is not None:
            batch["position_ids"] = self.position_ids[index]
        return batch

    def subset(self, index: torch.Tensor | np.ndarray | list[int], source: str) -> TokenizedDataset:
        index = torch.as_tensor(index, dtype=torch.long)
        positions = None if self.position_ids is None else self.position_ids[index]
        return TokenizedDataset(self.input_ids[index], self.labels[index], self.attention_mask[index], source,
                                positions)

    def split(self, eval_fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset]:
        """(train, eval): a seeded random `eval_fraction` of the rows is held out; both must be non-empty."""
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        num_eval = int(round(len(self) * eval_fraction))
        if num_eval == 0 or num_eval == len(self):
            raise ValueError(
                f"{self.source}: eval_fraction {eval_fraction} of {len(self)} rows leaves an empty "
                "train or eval set; use more data or another fraction"
            )
        order = np.random.default_rng([seed, 0xE7A1]).permutation(len(self))
        eval_rows, train_rows = np.sort(order[:num_eval]), np.sort(order[num_eval:])
        return (self.subset(train_rows, f"{self.source} [train]"),
                self.subset(eval_rows, f"{self.source} [eval]"))
