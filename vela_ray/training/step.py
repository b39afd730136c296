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

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from vela_ray.model import tensor_parallel
from vela_ray.model.activity import MasterActivity
from vela_ray.model.streaming import BackboneStream
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


def forward_backward(model: nn.Module, micro_batches: Sequence[Batch], loss_fn: LossFn = model_loss,
                     in_flight: int = 1, activity: MasterActivity | None = None,
                     stream: BackboneStream | None = None) -> float:
    """Forward and backward of every micro-batch, each loss scaled by 1/len(micro_batches); their summed loss.

    `in_flight` > 1 (`training.overlap`): that many micro-batches at once, each driven by a thread of its own (on
    a GPU, on a CUDA stream of its own). A micro-batch whose rows are at the experts waits in its transport call
    with the GIL released, as torch's kernels run without it, so another micro-batch's attention, router and
    shared experts compute meanwhile and the workers get rows from both. Threads, not a hand-written schedule:
    autograd already orders each micro-batch's graph, and its engine accumulates into the shared LoRA gradients
    under a lock, in whichever order the backward passes end (a sum in another order: rel ~1e-7).
    `activity`: the master's (its dispatcher's), told of each micro-batch running, to count the seconds in which
    all of them wait on the experts. `stream`: the master's streamed backbone (`masters.streaming`), whose layers
    the micro-batches in flight pass in step (`_through_the_buffer`).
    """
    scale = len(micro_batches)
    running = contextlib.nullcontext if activity is None else activity.running
    if stream is not None and in_flight > 1 and scale > 1:
        return _through_the_buffer(model, micro_batches, loss_fn, in_flight, running, stream)

    def one(batch: Batch) -> float:
        with running():
            loss = loss_fn(model, batch) / scale
            loss.backward()
        return float(loss.detach())

    if in_flight == 1 or scale == 1:
        total = 0.0
        for batch in micro_batches:
            total += one(batch)
        return total
    device = next(model.parameters()).device
    with ThreadPoolExecutor(min(in_flight, scale), thread_name_prefix="vela-micro-batch") as pool:
        losses = list(pool.map(lambda batch: _on_own_stream(device, one, batch), micro_batches))
    return sum(losses)


def _through_the_buffer(model: nn.Module, micro_batches: Sequence[Batch], loss_fn: LossFn, in_flight: int,
                        running: Callable[[], contextlib.AbstractContextManager], stream: BackboneStream) -> float:
    """GPipe's schedule through a streamed backbone's buffer (APTMoE's and Mobius's, on one device): waves of
    `in_flight` micro-batches whose forwards pass the layers in step (`layer_major_waves`), so a block is uploaded
    once per wave instead of once per micro-batch; then one backward over the wave's losses, which autograd runs last
    layer first across the micro-batches (its ready queue takes the latest-made node first), so the backward too
    uploads each block about once. A micro-batch's rows at the experts still leave the layer to the others. The
    wave's activations are all kept until its backward (GPipe's memory): `in_flight` bounds them. Gradients are
    summed in another order than the serial step's (rel ~1e-7)."""
    scale, total = len(micro_batches), 0.0

    def forward(batch: Batch) -> torch.Tensor:
        with running():
            return loss_fn(model, batch) / scale

    for losses in layer_major_waves(stream, micro_batches, in_flight, forward):
        with running():
            torch.autograd.backward(losses)
        total += sum(float(loss.detach()) for loss in losses)
    return total


def layer_major_waves(stream: BackboneStream, micro_batches: Sequence[Batch], in_flight: int,
                      forward: Callable[[Batch], torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Each wave's `forward(batch)` results, in micro-batch order: waves of `in_flight` micro-batches, each one's
    forward on a thread of its own, the wave passing the streamed layers in step (`BackboneStream.layer_major`).
    On a GPU all of them on the one compute stream: a slot's reuse waits for every kernel that read it by that
    stream's order (micro-batches' own streams would each need an event per slot); what overlaps is a micro-batch's
    wait for its rows with the others' compute. The caller's grad mode holds in the threads. A failing forward ends
    the wave's gate, so the others do not wait for it at the next layer, and its error is raised."""
    grad = torch.is_grad_enabled()

    def guarded(batch: Batch) -> torch.Tensor:
        try:
            with torch.set_grad_enabled(grad):
                return forward(batch)
        except BaseException:
            stream.end_wave()
            raise

    for start in range(0, len(micro_batches), in_flight):
        wave = micro_batches[start:start + in_flight]
        with stream.layer_major(len(wave)), ThreadPoolExecutor(len(wave), thread_name_prefix="vela-wave") as pool:
            results = list(pool.map(guarded, wave))
        yield results


def master_compute_seconds(master: MasterModel, micro_batch: Batch, loss_fn: LossFn = model_loss,
                           repeats: int = 2) -> float:
    """Seconds the master computes one micro-batch's forward and backward, every broker call run as in a step but
    answered by zeros at once (`ExpertDispatcher.answering_at_once`): the master groups, packs and combines the
    rows as it will, but no row travels, no worker computes or keeps a gradient. (Standing the experts in
    outright left that work out: 30% of the tiny Mixtral's master compute.) Best of `repeats`, the first building
    what the later reuse; the gradients it leaves are dropped, so training starts as it would have.

    The step prediction's master compute (`placement.TrainingStep.master_compute_s` = micro-batches x this),
    measured before training because a step cannot tell it apart: its time mixes the master's compute with its
    waits on the experts. A real forward and backward rather than the profile's forwards times a backward
    factor: those run without gradients, saved activations or dropout, and LoRA's backward through a frozen
    backbone costs no fixed multiple of a forward (its weight gradients are the adapters' alone). Left out:
    the optimizer step, the gradient norm and the broker's own planning, small beside the passes."""
    model = master.peft_model
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    seconds = []
    try:
        with master.dispatcher.answering_at_once():
            for _ in range(repeats):
                start = time.perf_counter()
                if master.stage is not None:  # every stage's part, one after another: the pipeline's latency
                    master.stage.forward_backward(model, [micro_batch], loss_fn)
                else:
                    loss_fn(model, micro_batch).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - start)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return min(seconds)


def _on_own_stream(device: torch.device, run: Callable[[Batch], float], batch: Batch) -> float:
    """`run(batch)` on a CUDA stream of its own (after the work queued so far, and before what is queued later on
    the default stream), so two micro-batches' kernels can run at once; on the CPU, just `run(batch)`."""
    if device.type != "cuda":
        return run(batch)
    default = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(default)
    with torch.cuda.stream(stream):
        result = run(batch)
    default.wait_stream(stream)
    return result


def train_step(
    master: MasterModel, workers: ExpertWorkers, micro_batches: Sequence[Batch], lr: float,
    max_grad_norm: float | None, *, loss_fn: LossFn = model_loss, replicas: Replicas = SINGLE, in_flight: int = 1,
) -> float:
    """Forward/backward all micro-batches, clip globally, step master and workers. Returns mean loss.

    With data-parallel `replicas` (e.g. expert-parallel ranks) every replica calls this at once,
    `loss_fn` gives its share of each micro-batch, and `workers` are its own experts (disjoint
    from the other replicas'): the backbone gradients and the scalars are summed over replicas,
    so all of them clip with the global norm and return the loss of the whole batch. `in_flight`: micro-batches
    run at once (`forward_backward`).
    """
    model = master.peft_model
    model.train()
    if master.tp is not None and master.tp.draws_dropout:
        tensor_parallel.agree_on_rng(master.tp)  # the group's ranks draw the dropout masks one master would
    if master.stage is not None:  # the backward of every stage has ended when stage 0's has (`pipeline`)
        total_loss = master.stage.forward_backward(model, micro_batches, loss_fn)
    else:
        total_loss = forward_backward(model, micro_batches, loss_fn, in_flight, master.dispatcher.activity,
                                      master.stream)
    params = master.trainable_parameters()
    replicas.sync_grads(params)
    if master.stage is not None:
        total_sq = master.stage.group.sum(grad_sq_norm(params) + workers.grad_sq_norm())
    elif master.tp is None:
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
    if master.stage is not None:
        return master.stage.group.sum(sum(float(loss) for loss in master.stage.forwards(
            batches, lambda batch: loss_fn(model, batch))[2])) / max(1, len(batches))
    local = sum(float(loss_fn(model, b)) for b in batches)
    return replicas.sum(local) / max(1, len(batches))
