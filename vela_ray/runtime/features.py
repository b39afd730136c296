"""How a run steps, and the optional parts it runs with, each one object the runner calls at fixed points.

A step is a first-order `train_step` or, with `training.method: zo`, a ZO-SGD step (`Stepper`:
`GradientSteps`, `ZoSteps`). Optional features are `RunFeature`s in one list (`run_features`): the
runner calls every feature's hook at its point of the run, so a feature is added here, never as a
flag check in the loop. The others plug in where they belong: several masters and tensor-parallel
ranks through the `MasterGroup` (`runtime.masters`), re-placement and replicas in the `Placer`'s policy,
recovery in `Recovery`.
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

import torch

from vela_ray.config import JobConfig, TrainingSection, ZoSection
from vela_ray.data.datasets import sequential_batches
from vela_ray.model.condensation import Condenser
from vela_ray.observability.metrics import MetricsSink
from vela_ray.runtime.state import Live
from vela_ray.training.popularity import PopularityPredictor
from vela_ray.training.step import Batch, LossFn, step_seed, train_step
from vela_ray.training.summary import StepRecord
from vela_ray.training.zo import ZoTrainer

logger = logging.getLogger(__name__)


class Stepper(Protocol):
    def step(self, live: Live, micro_batches: Sequence[Batch], lr: float, step: int, loss_fn: LossFn) -> float:
        """One optimizer step of master 0 and the workers on `micro_batches`; its loss."""
        ...

    def settle(self, live: Live) -> None:
        """Make the adapters what the last step made them, before anything reads them (eval, checkpoint,
        export)."""
        ...

    def state(self) -> dict | None:
        """What a checkpoint keeps of the steps beyond the adapters and optimizer state (None: nothing)."""
        ...

    def resume(self, live: Live, saved: dict | None) -> None:
        """Go on from a checkpoint's `state()` (None: a fresh start), its adapters loaded already."""
        ...


class GradientSteps:
    """First-order steps: `train_step` with the masters' gradient sum and clipping, each from torch seeded by
    (`seed`, step) (`step_seed`; a tensor-parallel master's ranks take master 0's state in `train_step`)."""

    def __init__(self, max_grad_norm: float | None, seed: int, in_flight: int = 1):
        self.max_grad_norm = max_grad_norm
        self.seed = seed
        self.in_flight = in_flight  # micro-batches at once (`training.overlap`)

    def step(self, live: Live, micro_batches: Sequence[Batch], lr: float, step: int, loss_fn: LossFn) -> float:
        torch.manual_seed(step_seed(self.seed, step))
        return train_step(live.master, live.workers, micro_batches, lr, self.max_grad_norm, loss_fn=loss_fn,
                          replicas=live.masters.replicas, in_flight=self.in_flight)

    def settle(self, live: Live) -> None:
        pass

    def state(self) -> dict | None:
        return None

    def resume(self, live: Live, saved: dict | None) -> None:
        pass


class ZoSteps:
    """`training.method: zo`: ZO-SGD steps whose update is fused into the next step's first pass until
    `settle` applies it (`vela_ray.training.zo`); their trajectory (each step's lr and projected gradient) goes
    into every checkpoint, which full-parameter ZO's frozen weights are rebuilt from on resume."""

    def __init__(self, zo: ZoSection, seed: int, in_flight: int = 1):
        self.trainer = ZoTrainer(zo.eps, seed, zo.parameters, in_flight)

    def step(self, live: Live, micro_batches: Sequence[Batch], lr: float, step: int, loss_fn: LossFn) -> float:
        return self.trainer.step(live.master, live.workers, micro_batches, lr, step).loss

    def settle(self, live: Live) -> None:
        self.trainer.settle(live.master, live.workers)

    def state(self) -> dict | None:
        return self.trainer.state()

    def resume(self, live: Live, saved: dict | None) -> None:
        self.trainer.resume(live.master, live.workers, saved)


def stepper_for(training: TrainingSection, in_flight: int = 1) -> Stepper:
    """The steps `training.method` asks for, with their `training` settings (seed, ZO's eps, clipping), and
    `in_flight` micro-batches at once (`OverlapSection.in_flight`)."""
    if training.method == "zo":
        return ZoSteps(training.zo, training.seed, in_flight)
    return GradientSteps(training.optimizer.max_grad_norm, training.seed, in_flight)


class RunFeature:
    """An optional part of a run; the runner calls each hook of every feature at its point. The defaults
    do nothing."""

    def after_placement(self, live: Live) -> None:
        """The placement is settled and the experts hosted by it; no step has run."""

    def after_step(self, live: Live, record: StepRecord) -> None:
        """A training step ended (before its eval and checkpoint)."""

    def workers_replaced(self, live: Live) -> None:
        """Recovery started new workers in place of lost ones (`live.hosted` is theirs)."""


class Condensation(RunFeature):
    """LUFFY's token condensation (LOSSY, `training.condensation.enabled`): every master rank's brokers condense
    (`vela_ray.model.condensation`); master 0's adaptive threshold follows the loss here, the other ranks' in
    their `MasterRank.train_step`, from the same loss."""

    def __init__(self, condenser: Condenser):
        self.condenser = condenser

    def after_step(self, live: Live, record: StepRecord) -> None:
        self.condenser.observe_loss(record.loss)


class ExpertTiers(RunFeature):
    """APTMoE's CPU/device expert tiers (`expert_tiers`): the popularity predictor is fitted on the
    routing of the profile batches and sent to every worker (new ones too); the tiers' counts, as each step
    answered them (`ExpertWorkers.tier_stats`), are metrics."""

    def __init__(self, metrics: MetricsSink, batch_size: int, profile_batches: int):
        """The predictor is fitted on `profile_batches` batches of `batch_size` rows (`training.batch_size`,
        `placement.profile_batches`: the batches the placement profiles)."""
        self.metrics = metrics
        self.batch_size = batch_size
        self.profile_batches = profile_batches
        self.predictor: tuple[dict, int] | None = None  # (state, top-k), re-sent to workers that replace lost ones

    def after_placement(self, live: Live) -> None:
        backbone = live.backbone
        if len(backbone.blocks) < 2:  # it predicts a layer's routing from the one before
            return
        batches = sequential_batches(backbone.train_set, self.batch_size, max_batches=self.profile_batches,
                                     token_mask=True)
        pairs = live.masters.routing_pairs(batches, backbone.blocks)
        predictor = PopularityPredictor.from_model(backbone.model, backbone.blocks)
        predictor.fit(pairs)
        logger.info("popularity predictor: top-k overlap per layer on its fitting batches %s",
                    {layer: round(overlap, 3) for layer, overlap in predictor.top_k_overlap(pairs).items()})
        self.predictor = (predictor.state_dict(), predictor.top_k)
        live.workers.set_predictor(*self.predictor)

    def after_step(self, live: Live, record: StepRecord) -> None:
        self.metrics.record_tiers(live.workers.tier_stats())

    def workers_replaced(self, live: Live) -> None:
        if self.predictor is not None:  # the new workers' tiers forecast as the old ones did
            live.workers.set_predictor(*self.predictor)


def run_features(config: JobConfig, metrics: MetricsSink, condenser: Condenser | None) -> list[RunFeature]:
    """The optional features this job runs with, in the order their hooks are called. The one place that reads
    the job for them: each feature is given only its own settings."""
    features: list[RunFeature] = []
    if condenser is not None:
        features.append(Condensation(condenser))
    if config.expert_tiers.enabled:
        features.append(ExpertTiers(metrics, config.training.batch_size, config.placement.profile_batches))
    return features
