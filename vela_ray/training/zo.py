"""Zeroth-order training: MeZO's ZO-SGD on the LoRA adapters, over vela-ray (ZO-Offloading §4-5).

`training.method: zo`. A step is two forward passes, at θ+εz and θ−εz, under torch.no_grad:
no backward, no activations kept for one, and the brokers move rows out and outputs back only
(no `grad_dispatch`/`grad_gather` traffic). With the projected gradient g = (L+ − L−)/(2ε)
the step is

    θ ← θ − lr·g·z

z is never sent. Whoever owns a tensor draws its z from (step seed, the tensor's canonical name)
(`optim.zo_noise`): the master its backbone LoRA (peft parameter names, as in the full peft
model), each ExpertManager its experts' LoRA (logical names "l{layer}.e{expert}.{factor}", as in
checkpoints). So any placement, worker count or device adds the same numbers, and all that
travels per pass is a few (step seed, coefficient) pairs (`ExpertWorkers.zo_apply`). Both kinds of
tensor are fp32 in a bf16 model (peft's rule, `experts.adapter_dtype`), so ±εz is not lost to rounding.

Fused update (§5.3): after the minus pass the parameters are θ−εz. Restoring them (+εz) and
stepping (−lr·g·z) would cost two more passes over every tensor; `ZoTrainer` keeps both pending
and applies them in the next step's first pass, together with that step's +εz', so a step makes
two passes over the parameters instead of four. Before anything reads the parameters
(checkpoint, eval, export) the runner calls `settle`, which applies the pending terms alone:
then they hold exactly θ_{t+1}, the same bits as unfused MeZO (`optim.apply_zo_terms`).

    zo = ZoTrainer(eps=1e-3, seed=0)
    result = zo.step(master, workers, micro_batches, lr, step)   # result.loss = (L+ + L−) / 2
    zo.settle(master, workers)                                   # before a checkpoint, eval or export

Not LOSSY in the sense of token condensation (the forwards are exact), but a different optimizer
from first-order AdamW: it needs many more steps; AdamW's settings and max_grad_norm are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from vela_ray.training.optim import ZoTerm, apply_zo_terms, zo_tensor_seed
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel
from vela_ray.training.step import Batch, LossFn, model_loss


@dataclass(frozen=True)
class ZoStepResult:
    """What one ZO step measured: the losses of both passes and the projected gradient."""

    loss_plus: float
    loss_minus: float
    projected_grad: float

    @property
    def loss(self) -> float:
        """(L+ + L−) / 2: the loss at the unperturbed θ up to O(ε²); what the run reports."""
        return (self.loss_plus + self.loss_minus) / 2


def step_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s z: a function of (training seed, step) alone, so a resumed or
    replayed step draws the same z as the step it repeats."""
    return zo_tensor_seed(seed, f"step {step}")


def master_tensors(master: MasterModel) -> dict[str, nn.Parameter]:
    """The master's trainable LoRA tensors by peft parameter name (the full peft model's names too)."""
    return {name: p for name, p in master.peft_model.named_parameters() if p.requires_grad}


def perturb(master: MasterModel, workers: ExpertWorkers, terms: Sequence[ZoTerm]) -> None:
    """Every owner applies `terms` to its own tensors: the master here, each worker on its side."""
    apply_zo_terms(master_tensors(master), terms)
    workers.zo_apply(list(terms))


@torch.no_grad()
def forward_loss(master: MasterModel, micro_batches: Sequence[Batch], loss_fn: LossFn = model_loss) -> float:
    """Mean loss over the micro-batches, as `train_step` sums it, with no graph anywhere.

    Eval mode, as MeZO runs its forwards: both passes must see the same function (no dropout, no
    sampled router jitter), or their difference is not a directional derivative. Under no_grad the
    brokers save nothing and send no key, so the workers keep no graph either."""
    model = master.peft_model
    model.eval()
    return sum(float(loss_fn(model, batch) / len(micro_batches)) for batch in micro_batches)


class ZoTrainer:
    """ZO-SGD steps with the update fused into the next step's first pass (see the module docstring).

    `pending`: terms every owner still has to apply to reach θ_{t+1} (the last step's restore and
    update); empty right after `settle`, and at the start."""

    def __init__(self, eps: float, seed: int = 0):
        self.eps = eps
        self.seed = seed
        self.pending: tuple[ZoTerm, ...] = ()

    def step(self, master: MasterModel, workers: ExpertWorkers, micro_batches: Sequence[Batch], lr: float,
             step: int, *, loss_fn: LossFn = model_loss) -> ZoStepResult:
        """Step `step` (0-based; it picks z) at learning rate `lr`; leaves the parameters at θ−εz."""
        seed, eps = step_seed(self.seed, step), self.eps
        perturb(master, workers, (*self.pending, (seed, eps)))  # last step's restore + update, then +εz
        self.pending = ()
        plus = forward_loss(master, micro_batches, loss_fn)
        perturb(master, workers, ((seed, -2 * eps),))
        minus = forward_loss(master, micro_batches, loss_fn)
        grad = (plus - minus) / (2 * eps)
        self.pending = ((seed, eps), (seed, -lr * grad))
        return ZoStepResult(plus, minus, grad)

    def settle(self, master: MasterModel, workers: ExpertWorkers) -> None:
        """Apply the pending restore and update alone: the parameters become θ_{t+1}, unperturbed."""
        if self.pending:
            perturb(master, workers, self.pending)
            self.pending = ()
