"""Zeroth-order training: MeZO's ZO-SGD on the LoRA adapters or on every weight, over vela-ray (ZO-Offloading §4-5).

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

Full-parameter (`zo.parameters: full`, MeZO's and ZO-Offloading's setting): the frozen weights are perturbed and
updated too, in place wherever they live, by the same rule: the master every floating parameter of its peft model
(the embedding, attention, routers, norms and head, by peft name; a backbone streamed from host memory
(`masters.streaming`) has its host copies changed and its device slots refilled, `BackboneStream.rewritten`), each
ExpertManager its experts' weight stacks, expert by expert ("l{layer}.e{expert}.{stack}"; a tiered worker's host
copies, its device cache dropped). Still no gradient and no optimizer state: only seeds and scalars travel. In the
model's own dtype, as MeZO does (a bf16 weight takes a bf16 εz).

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

import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import torch
from torch import nn

from vela_ray.training.optim import ZoTensors, ZoTerm, apply_zo_terms, zo_tensor_seed
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel
from vela_ray.training.step import Batch, LossFn, layer_major_waves, model_loss


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


ZoParameters = Literal["lora", "full"]


def master_tensors(master: MasterModel, which: ZoTensors = "lora") -> dict[str, nn.Parameter]:
    """The tensors the master perturbs, by peft parameter name (the full peft model's names too): its trainable LoRA
    tensors, its other floating parameters (the frozen weights), or both."""
    return {name: p for name, p in master.peft_model.named_parameters()
            if p.is_floating_point() and (which == "full" or p.requires_grad == (which == "lora"))}


def perturb(master: MasterModel, workers: ExpertWorkers, terms: Sequence[ZoTerm], which: ZoTensors = "lora") -> None:
    """Every owner applies `terms` to its own tensors: the master here, each worker on its side. A streamed
    backbone's host copies change only with the frozen weights, and then its device slots are refilled."""
    writes_frozen = which != "lora" and master.stream is not None
    with master.stream.rewritten() if writes_frozen else nullcontext():
        apply_zo_terms(master_tensors(master, which), terms)
    workers.zo_apply(list(terms), which)


def full_model_frozen_tensors(peft_model: nn.Module, experts_paths: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """The frozen floating tensors of a whole model (plain transformers + peft, experts inside) by the names vela-ray's
    owners give them in full-parameter ZO, so replaying a trajectory on it (`replayed_terms`) rebuilds what a run
    trained: a backbone tensor by its peft name (the master's), an expert stack slice by slice as
    "l{layer}.e{expert}.{stack}" (the ExpertManagers'). `experts_paths`: each experts module's path in the model
    without peft (`MoeBlock.experts_path`) to its MoE layer index."""
    out: dict[str, torch.Tensor] = {}
    for name, param in peft_model.named_parameters():
        if param.requires_grad or not param.is_floating_point():
            continue
        module, _, stack = re.sub(r"^base_model\.model\.|\.base_layer", "", name).rpartition(".")
        if module in experts_paths:
            out.update({f"l{experts_paths[module]}.e{e}.{stack}": param.data[e] for e in range(param.shape[0])})
        else:
            out[name] = param.data
    return out


def replayed_terms(seed: int, eps: float, trajectory: Sequence[tuple[float, float]]) -> list[ZoTerm]:
    """Every term steps 0.. len(trajectory)-1 added to a tensor, in order: each step's +εz, −2εz, the restore +εz and
    the update −lr·g·z, from its (lr, projected gradient). Applied to the base weights they give the trained ones
    bit for bit: `apply_zo_terms` adds one term at a time, and the fused passes only group the same adds."""
    terms: list[ZoTerm] = []
    for step, (lr, grad) in enumerate(trajectory):
        z = step_seed(seed, step)
        terms += [(z, eps), (z, -2 * eps), (z, eps), (z, -lr * grad)]
    return terms


@torch.no_grad()
def forward_loss(master: MasterModel, micro_batches: Sequence[Batch], loss_fn: LossFn = model_loss,
                 in_flight: int = 1) -> float:
    """Mean loss over the micro-batches, as `train_step` sums it, with no graph anywhere.

    Eval mode, as MeZO runs its forwards: both passes must see the same function (no dropout, no
    sampled router jitter), or their difference is not a directional derivative. Under no_grad the
    brokers save nothing and send no key, so the workers keep no graph either. A streamed backbone with
    `in_flight` > 1 runs the micro-batches in waves passing its buffer in step (`step.layer_major_waves`): each
    block uploaded once per wave, the same losses summed in the same order, so the same bits."""
    model = master.peft_model
    model.eval()
    if master.stream is None or in_flight == 1 or len(micro_batches) == 1:
        return sum(float(loss_fn(model, batch) / len(micro_batches)) for batch in micro_batches)
    losses = [loss for wave in layer_major_waves(master.stream, micro_batches, in_flight,
                                                 lambda batch: loss_fn(model, batch)) for loss in wave]
    return sum(float(loss / len(micro_batches)) for loss in losses)


class ZoTrainer:
    """ZO-SGD steps with the update fused into the next step's first pass (see the module docstring).

    `pending`: terms every owner still has to apply to reach θ_{t+1} (the last step's restore and
    update); empty right after `settle`, and at the start. `parameters`: `lora`, or `full` for every weight."""

    def __init__(self, eps: float, seed: int = 0, parameters: ZoParameters = "lora", in_flight: int = 1):
        self.eps = eps
        self.seed = seed
        self.parameters = parameters
        self.in_flight = in_flight  # micro-batches at once through a streamed backbone (`forward_loss`)
        self.pending: tuple[ZoTerm, ...] = ()
        self.trajectory: list[tuple[float, float]] = []  # (lr, projected gradient) of steps 0, 1, ...

    def step(self, master: MasterModel, workers: ExpertWorkers, micro_batches: Sequence[Batch], lr: float,
             step: int, *, loss_fn: LossFn = model_loss) -> ZoStepResult:
        """Step `step` (0-based; it picks z) at learning rate `lr`; leaves the parameters at θ−εz."""
        seed, eps, which = step_seed(self.seed, step), self.eps, self.parameters
        perturb(master, workers, (*self.pending, (seed, eps)), which)  # last step's restore + update, then +εz
        self.pending = ()
        plus = forward_loss(master, micro_batches, loss_fn, self.in_flight)
        perturb(master, workers, ((seed, -2 * eps),), which)
        minus = forward_loss(master, micro_batches, loss_fn, self.in_flight)
        grad = (plus - minus) / (2 * eps)
        self.pending = ((seed, eps), (seed, -lr * grad))
        self.trajectory.append((lr, grad))  # step `step` is entry `step`: a resume restores the ones before it
        return ZoStepResult(plus, minus, grad)

    def settle(self, master: MasterModel, workers: ExpertWorkers) -> None:
        """Apply the pending restore and update alone: the parameters become θ_{t+1}, unperturbed."""
        if self.pending:
            perturb(master, workers, self.pending, self.parameters)
            self.pending = ()

    def state(self) -> dict:
        """What a checkpoint keeps (settled): the trajectory, which full-parameter ZO's frozen weights are rebuilt
        from (`resume`; `vela export --format merged`), and the settings that read it."""
        return {"parameters": self.parameters, "seed": self.seed, "eps": self.eps,
                "trajectory": [list(entry) for entry in self.trajectory]}

    def resume(self, master: MasterModel, workers: ExpertWorkers, saved: dict | None) -> None:
        """Go on from a checkpoint's `state()` (None: a fresh start). Its adapters are loaded already; with `full`
        the frozen weights, loaded from the model's checkpoint, are brought to the checkpoint's step by replaying
        its trajectory (MeZO's seed trick: each step's noise drawn once per tensor, its four adds made)."""
        self.pending = ()
        self.trajectory = [] if saved is None else [(float(lr), float(g)) for lr, g in saved["trajectory"]]
        if self.parameters == "full" and self.trajectory:
            perturb(master, workers, replayed_terms(self.seed, self.eps, self.trajectory), "frozen")
