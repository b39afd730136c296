"""Preference objectives on the master's micro-batches: DPO and KTO as TRL's `DPOTrainer` and `KTOTrainer` compute
them with peft.

A micro-batch of DPO data (`data.kind: preference`) holds whole pairs, each two adjacent rows: prompt + chosen
answer, then prompt + rejected answer, their labels the answer's tokens (`IGNORE_INDEX` elsewhere). So both
sequences of a pair sit in one micro-batch and their rows reach the experts in the same broker calls. A micro-batch
of KTO data (`data.kind: unpaired_preference`) holds one row per example and `desirable` [B] bool.

The policy's log-probability of an answer is the sum over its tokens of log softmax(logits)[next token]. The
reference model's is the same with every adapter off: peft's `disable_adapter` on the master and, on the
ExpertManagers, the base experts (`experts.without_adapters`: each broker call of the pass asks its workers for
rows without LoRA). The reference costs no-grad forwards and no second copy of any weight. They run before the
policy's forward (TRL runs the reference after it), so no pass holds its activations while the policy's graph is
alive: a step's peak is SFT's on the same rows. The order draws the same random numbers as TRL's: a pass with every
adapter off draws no LoRA dropout mask (the base models hold no other active dropout; TRL disables it anyway).

Each objective is a `step.LossFn`: with several data-parallel masters each scores its own whole examples of the
micro-batch, over the micro-batch's example count, so the masters' losses add up to the micro-batch's (a router
aux loss is weighted by the master's share of the tokens, as `replicas.ReplicaShare` weights it; KTO's KL baseline,
a mean over the micro-batch, is summed over the masters). Each keeps the sums of TRL's metrics over the examples it
scored (`take_sums`), which master 0 adds up over masters (`metric_means`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.model.experts import without_adapters

Batch = dict[str, torch.Tensor]

class PreferenceSettings(Protocol):
    """What the objectives are computed with, in TRL's names: `config.PreferenceSection` (`training.preference`)."""

    objective: str
    losses: Sequence[str]
    loss_weights: Sequence[float] | None
    beta: float
    label_smoothing: float
    desirable_weight: float
    undesirable_weight: float
    router_aux_loss_coef: float | None  # None: the model config's own


COUNT_OF = {"rewards/chosen": "n/chosen", "logps/chosen": "n/chosen", "rewards/rejected": "n/rejected",
            "logps/rejected": "n/rejected", "rewards/accuracies": "n/pairs", "rewards/margins": "n/pairs",
            "kl": "n/micro_batches"}
"""TRL's metrics, each a sum (`take_sums`) over the count it is a mean of."""


class Replica(Protocol):
    def sum(self, value: float) -> float: ...


class _Alone:
    """One master: its sums are the micro-batch's."""

    def sum(self, value: float) -> float:
        return value


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


def own_examples(num_examples: int, rank: int, num_ranks: int, rows_per_example: int) -> np.ndarray:
    """Rows of master `rank`'s contiguous whole examples among `num_examples` (np.array_split sizes), each
    example's `rows_per_example` rows adjacent."""
    if num_examples < num_ranks:
        raise ValueError(f"a micro-batch of {num_examples} preference examples cannot feed {num_ranks} masters: each "
                         "needs at least one; raise training.micro_batch_size (or batch_size) or use fewer")
    examples = np.array_split(np.arange(num_examples), num_ranks)[rank]
    return (examples[:, None] * rows_per_example + np.arange(rows_per_example)).reshape(-1)


def mismatched_rows(batch: Batch) -> Batch:
    """KTO's KL sequences of a micro-batch: row i's prompt followed by row i-1's answer (the answers rotated by one,
    as TRL pairs them), cut to the rows' width, right-padded; `labels` on the borrowed answer."""
    ids, labels = batch["input_ids"], batch["labels"]
    width = ids.shape[1]
    marked = (labels != IGNORE_INDEX).long()
    starts = marked.argmax(dim=1)  # the answer's first token: labels run over the answer to its end
    ends = width - marked.flip(1).argmax(dim=1)
    out_ids, out_labels = torch.zeros_like(ids), torch.full_like(labels, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for i in range(ids.shape[0]):
        j = (i - 1) % ids.shape[0]
        row = torch.cat([ids[i, :starts[i]], ids[j, starts[j]:ends[j]]])[:width]
        out_ids[i, :len(row)], mask[i, :len(row)] = row, 1
        out_labels[i, starts[i]:len(row)] = row[starts[i]:]
    return {"input_ids": out_ids, "attention_mask": mask, "labels": out_labels}


class _PreferenceLoss:
    """What both objectives share: master `rank` of `num_masters` takes its whole examples of each micro-batch, the
    router aux loss as TRL adds it, the metric sums."""

    rows_per_example = 1

    def __init__(self, settings: PreferenceSettings, model_config, rank: int = 0, num_masters: int = 1,
                 device: torch.device | str = "cpu", replicas: Replica | None = None):
        """`replicas`: the data-parallel masters' group, for a sum over the micro-batch (KTO's KL baseline)."""
        self.settings, self.rank, self.num_masters, self.device = settings, rank, num_masters, device
        self.replicas = replicas or _Alone()
        coef = settings.router_aux_loss_coef
        self.aux_coef = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else coef
        # TRL's test: a config that can return router logits, and a coefficient that counts
        self.aux = hasattr(model_config, "output_router_logits") and self.aux_coef != 0.0
        self._sums: Counter[str] = Counter()

    def _own(self, full: Batch) -> tuple[Batch, torch.Tensor, int]:
        """This master's rows of `full` on its device, their indices, and the micro-batch's example count."""
        num_examples = full["input_ids"].shape[0] // self.rows_per_example
        rows = torch.as_tensor(own_examples(num_examples, self.rank, self.num_masters, self.rows_per_example))
        return {k: v[rows].to(self.device) for k, v in full.items()}, rows, num_examples

    def _policy(self, model: nn.Module, batch: Batch):
        inputs = model_inputs(batch)
        return model(**inputs, output_router_logits=True) if self.aux else model(**inputs)

    def _with_aux(self, loss: torch.Tensor, out, full: Batch, rows: torch.Tensor) -> torch.Tensor:
        if not self.aux:
            return loss
        mask = full.get("attention_mask", torch.ones_like(full["input_ids"]))
        share = float(mask[rows].sum() / mask.sum().clamp(min=1))  # of the micro-batch's tokens
        return loss + self.aux_coef * share * out.aux_loss

    def take_sums(self) -> dict[str, float]:
        """The metric sums (`COUNT_OF`) since the last call (a step's, or an evaluation's), then none."""
        sums, self._sums = dict(self._sums), Counter()
        return sums


class DpoLoss(_PreferenceLoss):
    """`training.preference.objective: dpo`: TRL's `DPOTrainer._compute_loss` with peft and no reference model (the
    same loss types, `beta`, `label_smoothing`, `loss_weights` and router aux loss), over whole pairs."""

    rows_per_example = 2

    def __call__(self, model: nn.Module, full: Batch) -> torch.Tensor:
        batch, rows, num_pairs = self._own(full)
        with torch.no_grad(), reference_model(model):
            ref_logps = answer_logps(model(**model_inputs(batch)).logits, batch["labels"])
        out = self._policy(model, batch)
        logps = answer_logps(out.logits, batch["labels"])
        answer_tokens = (batch["labels"] != IGNORE_INDEX).sum(dim=1)
        per_pair = self._per_pair(logps, ref_logps, answer_tokens, full)
        self._observe(logps.detach(), ref_logps)
        return self._with_aux(per_pair.sum() / num_pairs, out, full, rows)

    def _per_pair(self, logps: torch.Tensor, ref_logps: torch.Tensor, answer_tokens: torch.Tensor,
                  full: Batch) -> torch.Tensor:
        """[P] each pair's loss, the loss types summed with their weights (TRL's formulas; `sft` is a token mean
        over the micro-batch's chosen answers, spread over its pairs so that their mean is it)."""
        beta, smoothing = self.settings.beta, self.settings.label_smoothing
        chosen, rejected = logps[0::2], logps[1::2]
        chosen_ratio, rejected_ratio = chosen - ref_logps[0::2], rejected - ref_logps[1::2]
        delta = chosen_ratio - rejected_ratio
        weights = self.settings.loss_weights or [1.0] * len(self.settings.losses)
        total = torch.zeros_like(chosen)
        for loss_type, weight in zip(self.settings.losses, weights):
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
                loss = -chosen / max(1, chosen_tokens) * (full["input_ids"].shape[0] // 2)
            total = total + weight * loss
        return total

    def _observe(self, logps: torch.Tensor, ref_logps: torch.Tensor) -> None:
        beta = self.settings.beta
        chosen_rewards = beta * (logps[0::2] - ref_logps[0::2])
        rejected_rewards = beta * (logps[1::2] - ref_logps[1::2])
        pairs = chosen_rewards.numel()
        self._sums.update({"n/pairs": pairs, "n/chosen": pairs, "n/rejected": pairs,
                           "rewards/chosen": float(chosen_rewards.sum()),
                           "rewards/rejected": float(rejected_rewards.sum()),
                           "rewards/accuracies": float((chosen_rewards > rejected_rewards).sum()),
                           "rewards/margins": float((chosen_rewards - rejected_rewards).sum()),
                           "logps/chosen": float(logps[0::2].sum()), "logps/rejected": float(logps[1::2].sum())})


class KtoLoss(_PreferenceLoss):
    """`training.preference.objective: kto`: TRL's `KTOTrainer._compute_loss` with peft and no reference model
    (`kto` with its KL baseline from the mismatched sequences, or `apo_zero_unpaired`; `beta`, the desirable and
    undesirable weights, the router aux loss). The KL baseline is the micro-batch's mean over every master's
    examples, clamped at 0, as TRL gathers it over ranks."""

    def __call__(self, model: nn.Module, full: Batch) -> torch.Tensor:
        batch, rows, num_examples = self._own(full)
        desirable = batch["desirable"].bool()
        calculate_kl = self.settings.losses[0] == "kto"
        mismatched = {k: v[rows].to(self.device) for k, v in mismatched_rows(full).items()} if calculate_kl else None
        with torch.no_grad():  # the no-grad passes first (module docstring): the KL sequences, then the reference's
            kl_logps = answer_logps(model(**model_inputs(mismatched)).logits, mismatched["labels"]) \
                if calculate_kl else None
            with reference_model(model):
                ref_kl_logps = answer_logps(model(**model_inputs(mismatched)).logits, mismatched["labels"]) \
                    if calculate_kl else None
                ref_logps = answer_logps(model(**model_inputs(batch)).logits, batch["labels"])
        out = self._policy(model, batch)
        logps = answer_logps(out.logits, batch["labels"])
        kl = torch.zeros((), device=logps.device)
        if calculate_kl:
            kl = torch.tensor(max(0.0, self.replicas.sum(float((kl_logps - ref_kl_logps).sum())) / num_examples),
                              device=logps.device)
        ratios = logps - ref_logps
        beta, settings = self.settings.beta, self.settings
        if calculate_kl:
            losses = torch.where(desirable, 1 - torch.sigmoid(beta * (ratios - kl)),
                                 1 - torch.sigmoid(beta * (kl - ratios)))
        else:  # apo_zero_unpaired
            losses = torch.where(desirable, 1 - torch.sigmoid(beta * ratios), torch.sigmoid(beta * ratios))
        losses = losses * torch.where(desirable, settings.desirable_weight, settings.undesirable_weight)
        self._observe(logps.detach(), ratios.detach(), desirable, float(kl))
        return self._with_aux(losses.sum() / num_examples, out, full, rows)

    def _observe(self, logps: torch.Tensor, ratios: torch.Tensor, desirable: torch.Tensor, kl: float) -> None:
        rewards = self.settings.beta * ratios
        self._sums.update({"n/chosen": int(desirable.sum()), "n/rejected": int((~desirable).sum()),
                           "n/micro_batches": 1 if self.rank == 0 else 0, "kl": kl if self.rank == 0 else 0.0,
                           "rewards/chosen": float(rewards[desirable].sum()),
                           "rewards/rejected": float(rewards[~desirable].sum()),
                           "logps/chosen": float(logps[desirable].sum()),
                           "logps/rejected": float(logps[~desirable].sum())})


def model_inputs(batch: Batch) -> Batch:
    """What the model takes of a batch: not its labels (the log-probabilities are computed here) nor `desirable`."""
    return {k: v for k, v in batch.items() if k not in ("labels", "desirable")} | {"use_cache": False}


def objective_loss(settings: PreferenceSettings, model_config, rank: int = 0, num_masters: int = 1,
                   device: torch.device | str = "cpu", replicas: Replica | None = None) -> _PreferenceLoss:
    """The `step.LossFn` of `settings.objective` (dpo or kto) for master `rank` of `num_masters`."""
    kind = {"dpo": DpoLoss, "kto": KtoLoss}[settings.objective]
    return kind(settings, model_config, rank, num_masters, device, replicas)


def metric_means(sums: list[dict[str, float]]) -> dict[str, float]:
    """TRL's metrics (`rewards/chosen`, `rewards/margins`, `logps/rejected`, `kl`, ...): the means over every
    example the masters scored, from their `take_sums`. KTO's margins: the chosen rewards' mean less the
    rejected's, as TRL logs them."""
    total: Counter[str] = Counter()
    for one in sums:
        total.update(one)
    means = {name: total[name] / total[count] for name, count in COUNT_OF.items() if total[count] > 0}
    if "rewards/margins" not in means and {"rewards/chosen", "rewards/rejected"} <= means.keys():
        means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
    return means


def take_sums(loss_fn: object) -> dict[str, float] | None:
    """A step loss's metric sums since the last call (`_PreferenceLoss.take_sums`); None for a loss without any
    (SFT's)."""
    return loss_fn.take_sums() if isinstance(loss_fn, _PreferenceLoss) else None
