"""Preference objectives on the master's micro-batches: DPO as TRL's `DPOTrainer` computes it with peft.

A micro-batch of preference data (`data.kind: preference`) holds whole pairs, each two adjacent rows: prompt +
chosen answer, then prompt + rejected answer, their labels the answer's tokens (`IGNORE_INDEX` elsewhere). So both
sequences of a pair sit in one micro-batch and their rows reach the experts in the same broker calls.

The policy's log-probability of an answer is the sum over its tokens of log softmax(logits)[next token]. The
reference model's is the same with every adapter off: peft's `disable_adapter` on the master and, on the
ExpertManagers, the base experts (`experts.without_adapters`: each broker call of the pass asks its workers for
rows without LoRA). The reference costs one no-grad forward per micro-batch and no second copy of any weight; it
runs after the policy's forward, as in TRL, so both draw the same random numbers as TRL's step.

`PreferenceLoss` is a `step.LossFn`: with several data-parallel masters each scores its own whole pairs of the
micro-batch, over the micro-batch's pair count, so the masters' losses add up to the micro-batch's (a router aux
loss is weighted by the master's share of the tokens, as `replicas.ReplicaShare` weights it). It keeps the sums
of TRL's metrics over the pairs it scored (`take_sums`), which master 0 adds up over masters (`metric_means`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.model.experts import without_adapters

Batch = dict[str, torch.Tensor]

class DpoSettings(Protocol):
    """What DPO is computed with, in TRL's names: `config.PreferenceSection` (`training.preference`)."""

    loss_type: Sequence[str]
    loss_weights: Sequence[float] | None
    beta: float
    label_smoothing: float
    router_aux_loss_coef: float | None  # None: the model config's own


SUMS = ("pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "logps/rejected")
"""What `PreferenceLoss.take_sums` adds up over the pairs a master scored; TRL's metric names beside `pairs`."""


@contextlib.contextmanager
def reference_model(model: nn.Module) -> Iterator[None]:
    """Within the block `model` computes the reference: peft's adapters off on the master (`disable_adapter`), and
    the experts' LoRA off wherever its broker calls land (`experts.without_adapters`, this thread only)."""
    with model.disable_adapter(), without_adapters():
        yield


def answer_logps(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """[B] each row's summed log-probability of its labelled tokens, each predicted from the position before it
    (fp32, as TRL sums them)."""
    labels = labels_BS[:, 1:]
    logps = torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
    per_token = torch.gather(logps, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * (labels != IGNORE_INDEX)).sum(dim=1)


def pair_rows(num_pairs: int, rank: int, num_ranks: int) -> np.ndarray:
    """Rows of master `rank`'s contiguous whole pairs among `num_pairs` (np.array_split sizes)."""
    if num_pairs < num_ranks:
        raise ValueError(f"a micro-batch of {num_pairs} preference pairs cannot feed {num_ranks} masters: each "
                         "needs at least one pair; raise training.micro_batch_size (or batch_size) or use fewer")
    pairs = np.array_split(np.arange(num_pairs), num_ranks)[rank]
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


class PreferenceLoss:
    """`training.preference.objective: dpo`: master `rank` of `num_masters`'s share of a micro-batch's DPO loss
    (TRL's `DPOTrainer._compute_loss` with peft and no reference model: the same loss types, `beta`,
    `label_smoothing`, `loss_weights` and router aux loss)."""

    def __init__(self, section: DpoSettings, model_config, rank: int = 0, num_masters: int = 1,
                 device: torch.device | str = "cpu"):
        self.section, self.rank, self.num_masters, self.device = section, rank, num_masters, device
        coef = section.router_aux_loss_coef
        self.aux_coef = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else coef
        # TRL's test: a config that can return router logits, and a coefficient that counts
        self.aux = hasattr(model_config, "output_router_logits") and self.aux_coef != 0.0
        self.weights = section.loss_weights or [1.0] * len(section.loss_type)
        self._sums = torch.zeros(len(SUMS), dtype=torch.float64)

    def __call__(self, model: nn.Module, full: Batch) -> torch.Tensor:
        num_pairs = full["input_ids"].shape[0] // 2
        rows = torch.as_tensor(pair_rows(num_pairs, self.rank, self.num_masters))
        batch = {k: v[rows].to(self.device) for k, v in full.items()}
        labels = batch.pop("labels")
        kwargs = {**batch, "use_cache": False}
        out = model(**kwargs, output_router_logits=True) if self.aux else model(**kwargs)
        logps = answer_logps(out.logits, labels)
        with torch.no_grad(), reference_model(model):
            ref_logps = answer_logps(model(**kwargs).logits, labels)
        answer_tokens = (labels != IGNORE_INDEX).sum(dim=1)
        per_pair = self._per_pair(logps, ref_logps, answer_tokens, out.logits, labels, full)
        loss = per_pair.sum() / num_pairs
        if self.aux:
            loss = loss + self.aux_coef * self._token_share(full, rows) * out.aux_loss
        self._observe(logps.detach(), ref_logps)
        return loss

    def _per_pair(self, logps: torch.Tensor, ref_logps: torch.Tensor, answer_tokens: torch.Tensor,
                  logits: torch.Tensor, labels: torch.Tensor, full: Batch) -> torch.Tensor:
        """[P] each pair's loss, the loss types summed with their weights (TRL's formulas; `sft` is a token mean
        over the micro-batch's chosen answers, spread over its pairs so that their mean is it)."""
        beta, smoothing = self.section.beta, self.section.label_smoothing
        chosen, rejected = logps[0::2], logps[1::2]
        chosen_ratio, rejected_ratio = chosen - ref_logps[0::2], rejected - ref_logps[1::2]
        delta = chosen_ratio - rejected_ratio
        total = torch.zeros_like(chosen)
        for loss_type, weight in zip(self.section.loss_type, self.weights):
            if loss_type == "sigmoid":
                loss = -F.logsigmoid(beta * delta)
            elif loss_type == "hinge":
                loss = torch.relu(1 - beta * delta)
            elif loss_type in ("ipo", "sigmoid_norm"):  # the log ratios per answer token
                per_token = chosen_ratio / answer_tokens[0::2].clamp(min=1) - \
                    rejected_ratio / answer_tokens[1::2].clamp(min=1)
                loss = (per_token - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * per_token)
            elif loss_type == "robust":
                loss = (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) \
                    / (1 - 2 * smoothing)
            elif loss_type == "exo_pair":
                eps = torch.tensor(smoothing, device=delta.device, dtype=delta.dtype)
                loss = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-eps)) + \
                    torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps))
            elif loss_type == "nca_pair":
                loss = -F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio) \
                    - 0.5 * F.logsigmoid(-beta * rejected_ratio)
            elif loss_type == "bco_pair":
                loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
            elif loss_type == "sppo_hard":
                loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
            elif loss_type == "apo_zero":
                loss = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
            elif loss_type == "apo_down":
                loss = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * delta)
            else:  # sft: minus the mean log-probability of the micro-batch's chosen answer tokens
                chosen_tokens = int((full["labels"][0::2, 1:] != IGNORE_INDEX).sum())
                num_pairs = full["input_ids"].shape[0] // 2
                loss = (-chosen / max(1, chosen_tokens) * num_pairs).to(chosen.dtype)
            total = total + weight * loss
        return total

    def _token_share(self, full: Batch, rows: torch.Tensor) -> float:
        """This master's share of the micro-batch's tokens: the weight of its router aux loss."""
        mask = full.get("attention_mask", torch.ones_like(full["input_ids"]))
        return float(mask[rows].sum() / mask.sum().clamp(min=1))

    def _observe(self, logps: torch.Tensor, ref_logps: torch.Tensor) -> None:
        beta = self.section.beta
        chosen_rewards = beta * (logps[0::2] - ref_logps[0::2])
        rejected_rewards = beta * (logps[1::2] - ref_logps[1::2])
        values = [chosen_rewards.numel(), chosen_rewards.sum(), rejected_rewards.sum(),
                  (chosen_rewards > rejected_rewards).sum(), (chosen_rewards - rejected_rewards).sum(),
                  logps[0::2].sum(), logps[1::2].sum()]
        self._sums += torch.tensor([float(v) for v in values], dtype=torch.float64)

    def take_sums(self) -> list[float]:
        """The `SUMS` over the pairs scored since the last call (a step's, or an evaluation's), then zero."""
        sums, self._sums = self._sums.tolist(), torch.zeros(len(SUMS), dtype=torch.float64)
        return sums


def metric_means(sums: list[list[float]]) -> dict[str, float]:
    """TRL's metrics (`rewards/chosen`, `rewards/margins`, `logps/rejected`, ...): the means over every pair the
    masters scored, from their `PreferenceLoss.take_sums`."""
    total = np.sum(np.asarray(sums, dtype=np.float64), axis=0)
    pairs = max(1.0, total[0])
    return {name: float(value / pairs) for name, value in zip(SUMS[1:], total[1:])}


def take_sums(loss_fn: object) -> list[float] | None:
    """A step loss's metric sums since the last call (`PreferenceLoss.take_sums`); None for a loss without any
    (SFT's)."""
    return loss_fn.take_sums() if isinstance(loss_fn, PreferenceLoss) else None
