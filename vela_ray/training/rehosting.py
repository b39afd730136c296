"""What an ExpertManager hosts, and how its experts move to other workers (live migration).

`host_experts` builds a worker's `Hosting` over exactly the experts whose frozen weights it is given:
their shard, its AdamW, and APTMoE's tiers over them when the spec enables them. A moving expert carries
its `expert_states` (LoRA factors and AdamW slots, named as in a checkpoint part); the worker it moves to
reads its frozen weights from the model's checkpoint again (`arriving_weights`). `ExpertMove` checks and
counts one worker's re-hosting (`vela_ray.runtime.migration` plans them, between steps):

    move = ExpertMove.between(worker, hosted_keys, new_keys, incoming_states)
    weights = kept_weights | arriving_weights(spec, move.arriving)
    hosting = host_experts(spec, weights, prototypes, device, previous_tiers)
    load_expert_states(hosting.shard, hosting.trainer, states)
    stats = move.stats(weights)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from vela_ray.errors import ExpertWorkerError
from vela_ray.model.experts import ExpertKey, ExpertShard, ExpertWeights
from vela_ray.training.expert_spec import ExpertManagerSpec, compute_dtype, load_expert_weights
from vela_ray.training.optim import ShardTrainer
from vela_ray.training.tiered import TieredExperts

# LoRA factors and AdamW slots of each expert, named as in a checkpoint part ("lora_A_up", "lora_A_up.exp_avg")
ExpertStates = dict[ExpertKey, dict[str, torch.Tensor]]


class MigrationStats(BaseModel):
    """What one worker's `rehost` took in: experts that arrived, their state over the wire, weights read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: int
    arrived: int = Field(description="experts this worker now hosts that it did not before")
    state_bytes: int = Field(description="LoRA + AdamW bytes received from the experts' old workers")
    frozen_bytes: int = Field(description="frozen expert weights read from the model's checkpoint")


class Hosting(NamedTuple):
    """What a worker serves rows from and steps: its experts, their shard and AdamW, their dtype, the tiers."""

    keys: list[ExpertKey]
    shard: ExpertShard
    trainer: ShardTrainer | None  # None without experts: torch's AdamW refuses an empty parameter list
    dtype: torch.dtype  # what the frozen weights compute in, which rows are decoded to (`vela_ray.model.wire`)
    tiers: TieredExperts | None  # APTMoE's tiers (`vela_ray.training.tiered`), None when `spec.tiers` is off


def host_experts(spec: ExpertManagerSpec, weights: ExpertWeights, prototypes: dict, device: torch.device,
                 previous_tiers: TieredExperts | None = None) -> Hosting:
    """A shard and its AdamW over exactly `weights`' experts on `device`, with fresh LoRA and optimizer
    state. `previous_tiers`: this worker's tiers before a re-hosting, whose speeds, predictor and counters
    go on."""
    keys: list[ExpertKey] = sorted(weights)
    dtype = compute_dtype(spec, weights)
    shard = ExpertShard.from_weights(weights, spec.lora, prototypes, seed=spec.seed, dtype=dtype).to(device)
    trainer = ShardTrainer(shard, spec.optim) if keys else None
    tiers = TieredExperts(shard, prototypes, spec.lora, spec.tiers, torch.device(spec.device), spec.worker,
                          previous=previous_tiers) if spec.tiers.enabled else None
    return Hosting(keys, shard, trainer, dtype, tiers)


def expert_states(shard: ExpertShard, trainer: ShardTrainer | None, keys: list[ExpertKey]) -> ExpertStates:
    """LoRA factors and AdamW state of `keys`, on the CPU, named as in a checkpoint part."""
    lora, optim = shard.lora_state(), trainer.optimizer_state() if trainer else {}
    return {k: {**{n: t.cpu() for n, t in lora[k].items()}, **{n: v.cpu() for n, v in optim.get(k, {}).items()}}
            for k in keys}


def load_expert_states(shard: ExpertShard, trainer: ShardTrainer | None, states: ExpertStates) -> None:
    """Take LoRA factors (names without a dot) and AdamW slots ("<factor>.<slot>") of every hosted expert."""
    shard.load_lora_state({k: {n: v for n, v in s.items() if "." not in n} for k, s in states.items()})
    if trainer:
        trainer.load_optimizer_state({k: {n: v for n, v in s.items() if "." in n} for k, s in states.items()})


def arriving_weights(spec: ExpertManagerSpec, arriving: list[ExpertKey]) -> ExpertWeights:
    """The frozen weights of experts arriving at worker `spec.worker`, read as at spawn."""
    if not arriving:
        return {}
    if spec.weights is not None and any(k not in spec.weights for k in arriving):
        raise ExpertWorkerError(spec.worker, "rehost: this worker was built from in-memory `weights` "
                                             "that lack arriving experts; give it a `model_dir`")
    return load_expert_weights(spec.model_copy(update={"keys": arriving}))[0]


@dataclass(frozen=True)
class ExpertMove:
    """One worker's re-hosting: the experts it keeps, those arriving (with their states), how many leave."""

    worker: int
    keys: list[ExpertKey]  # hosted afterwards, sorted
    staying: list[ExpertKey]
    arriving: list[ExpertKey]
    leaving: int
    incoming: ExpertStates  # the arriving experts' states, from their old workers

    @classmethod
    def between(cls, worker: int, hosted: list[ExpertKey], keys: list[ExpertKey],
                incoming: Sequence[ExpertStates]) -> ExpertMove:
        """The move from `hosted` to `keys`; every arriving expert's state must be in one of `incoming`."""
        keys = sorted(tuple(k) for k in keys)
        arriving = [k for k in keys if k not in hosted]
        states: ExpertStates = {}
        for part in incoming:
            states.update(part)
        missing = [k for k in arriving if k not in states]
        if missing:
            raise ExpertWorkerError(worker, f"rehost: no LoRA/AdamW state sent for arriving experts "
                                            f"{missing[:8]}; send each old worker's expert_states")
        staying = [k for k in keys if k in hosted]
        return cls(worker, keys, staying, arriving, len(hosted) - len(staying), states)

    def stats(self, weights: ExpertWeights) -> MigrationStats:
        """What arrived: the experts, their states' bytes, and the bytes of their frozen `weights` read."""
        received = sum(t.numel() * t.element_size() for k in self.arriving for t in self.incoming[k].values())
        frozen = sum(t.numel() * t.element_size() for k in self.arriving for t in weights[k].values())
        return MigrationStats(worker=self.worker, arrived=len(self.arriving), state_bytes=received,
                              frozen_bytes=frozen)
