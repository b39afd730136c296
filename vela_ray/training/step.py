"""One training step of the master, over any set of expert workers.

`train_step` is the whole step: forward/backward over the micro-batches
(experts run wherever the placement put them, through the brokers), global
grad-norm clipping across master and workers, and the optimizer steps on
both sides. Every runtime calls the same function: the job runner with
ExpertManagers in this process or behind Ray actors (`ExpertWorkers`), tests
with in-process ShardTrainers.

The master (`vela_ray.training.master`), the workers' control plane (`vela_ray.training.expert_workers`) and the
adapter's files (`vela_ray.training.adapter_io`) live beside it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from vela_ray.model import tensor_parallel
from vela_ray.training.optim import apply_step, clip_coefficient, grad_sq_norm
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel
from vela_ray.training.replicas import SINGLE, Replicas




Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
"""(peft model, micro-batch) -> this replica's share of the micro-batch's mean loss."""


def model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss of the whole micro-batch: what a lone master trains on."""
    return model(**batch).loss


def step_seed(seed: int, step: int) -> int:
    """The torch seed of training step `step` of a run seeded `seed` (`training.seed`): a step's random draws
    (LoRA dropout's masks) depend on (seed, step) alone, so a resumed run and peft's reference
    (`equivalence.peft_losses`) draw the same, whatever the process or Python version."""
    return (seed * 1_000_003 + step) % 2**31


def train_step(
    master: MasterModel, workers: ExpertWorkers, micro_batches: Sequence[Batch], lr: float,
    max_grad_norm: float | None, *, loss_fn: LossFn = model_loss, replicas: Replicas = SINGLE,
) -> float:
    """Forward/backward all micro-batches, clip globally, step master and workers. Returns mean loss.

    With data-parallel `replicas` (e.g. expert-parallel ranks) every replica calls this at once,
    `loss_fn` gives its share of each micro-batch, and `workers` are its own experts (disjoint
    from the other replicas'): the backbone gradients and the scalars are summed over replicas,
    so all of them clip with the global norm and return the loss of the whole batch.
    """
    model = master.peft_model
    model.train()
    if master.tp is not None and master.tp.draws_dropout:
        tensor_parallel.agree_on_rng(master.tp)  # the group's ranks draw the dropout masks one master would
    total_loss = 0.0
    for batch in micro_batches:
        loss = loss_fn(model, batch) / len(micro_batches)
        loss.backward()
        total_loss += float(loss.detach())
    params = master.trainable_parameters()
    replicas.sync_grads(params)
    if master.tp is None:
        total_sq = grad_sq_norm(params) + replicas.sum(workers.grad_sq_norm())
    else:  # the group's backward has ended (a barrier) before its first rank reads the workers' norm
        own_sq = tensor_parallel.grad_sq_norm(model, master.tp)
        total_sq = own_sq + tensor_parallel.all_sum(replicas.sum(workers.grad_sq_norm()), master.tp)
    master.grad_norm = total_sq ** 0.5
    clip_coef = clip_coefficient(total_sq, max_grad_norm)
    apply_step(master.optimizer, lr, clip_coef)
    workers.step(lr, clip_coef)
    return replicas.sum(total_loss)


@torch.no_grad()
def eval_loss(master: MasterModel, batches: Sequence[Batch], *, loss_fn: LossFn = model_loss,
              replicas: Replicas = SINGLE) -> float:
    """Mean over `batches` of each batch's loss (summed over `replicas`' shares, as in `train_step`)."""
    model = master.peft_model
    model.eval()
    local = sum(float(loss_fn(model, b)) for b in batches)
    return replicas.sum(local) / max(1, len(batches))
