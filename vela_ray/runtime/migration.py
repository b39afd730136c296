"""Live migration: move experts between running ExpertManagers, and decide when moving pays.

A placement change used to respawn every worker. Now the pool keeps its workers and moves only
the experts whose worker changes (`WorkerPool.migrate`), between steps:

  1. each old worker sends the LoRA factors and AdamW state of its leaving experts
     (`ExpertManager.expert_states`), one message per (old, new) worker pair, worker to worker;
  2. each touched worker `rehost`s: keeps its staying experts, reads the arriving experts'
     frozen weights from the model's checkpoint (the master never holds expert weights),
     loads their state, drops the leaving ones;
  3. the master swaps the brokers' table (`ExpertDispatcher.retable`), one assignment.

Training after a migration equals training without it: the same adapters and optimizer
moments compute the same rows, only on another worker.

`replan` decides whether a re-placement pays: its expected saving over the next steps (the
cost model on the recent routing) against the migration's expected cost (measured seconds
per moved expert, at least what the link model gives for its bytes; EPLB's
`rebalance_with_migration_cost` weighs moves against balance the same way).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from placement import PlacementProblem, cost
from vela_ray.model.experts import ExpertKey
from vela_ray.training.expert_manager import MigrationStats
from vela_ray.training.summary import MigrationRecord


@dataclass(frozen=True)
class MigrationPlan:
    """The experts that change worker between two placement tables of the same shape."""

    old_LE: np.ndarray
    new_LE: np.ndarray

    @classmethod
    def between(cls, old_LE, new_LE) -> MigrationPlan:
        old_LE, new_LE = np.asarray(old_LE, dtype=np.int64), np.asarray(new_LE, dtype=np.int64)
        if old_LE.shape != new_LE.shape:
            raise ValueError(f"cannot migrate between placements of shapes {old_LE.shape} and {new_LE.shape}")
        return cls(old_LE, new_LE)

    @property
    def moved(self) -> list[ExpertKey]:
        return [(int(layer), int(expert)) for layer, expert in np.argwhere(self.old_LE != self.new_LE)]

    def by_pair(self) -> dict[tuple[int, int], list[ExpertKey]]:
        """{(old worker, new worker): experts moving between them}."""
        pairs: dict[tuple[int, int], list[ExpertKey]] = defaultdict(list)
        for key in self.moved:
            pairs[(int(self.old_LE[key]), int(self.new_LE[key]))].append(key)
        return dict(pairs)

    def touched(self) -> list[int]:
        """Workers that gain or lose an expert: the ones that must rehost."""
        return sorted({w for pair in self.by_pair() for w in pair})

    def keys_of(self, worker: int) -> list[ExpertKey]:
        """What `worker` hosts after the migration."""
        return [(int(layer), int(expert)) for layer, expert in np.argwhere(self.new_LE == worker)]

    def senders_to(self, worker: int) -> list[tuple[int, int]]:
        """The (old, new) pairs whose state `worker` receives."""
        return [pair for pair in self.by_pair() if pair[1] == worker]


def migration_record(plan: MigrationPlan, stats: list[MigrationStats], seconds: float, *, step: int,
                     reason: str, version: int, expected_saving_s: float | None = None,
                     expected_cost_s: float | None = None) -> MigrationRecord:
    return MigrationRecord(
        step=step, reason=reason, version=version, moved=len(plan.moved),
        state_bytes=sum(s.state_bytes for s in stats), frozen_bytes=sum(s.frozen_bytes for s in stats),
        seconds=seconds, expected_saving_s=expected_saving_s, expected_cost_s=expected_cost_s,
        expert_to_worker=plan.new_LE.tolist())


def seconds_per_moved_expert(history: list[MigrationRecord]) -> float | None:
    """Measured migration seconds per moved expert (all migrations so far), None if none moved one."""
    moved = sum(r.moved for r in history)
    return sum(r.seconds for r in history if r.moved) / moved if moved else None


@dataclass(frozen=True)
class ReplanDecision:
    """A re-solve on the recent routing: what it would save and what moving would cost."""

    candidate_LE: np.ndarray
    moved: int
    current_step_s: float
    candidate_step_s: float
    horizon_steps: int
    expected_cost_s: float

    @property
    def expected_saving_s(self) -> float:
        return max(0.0, self.current_step_s - self.candidate_step_s) * self.horizon_steps

    @property
    def adopt(self) -> bool:
        return self.moved > 0 and self.expected_saving_s > self.expected_cost_s


def replan(recent: PlacementProblem, current_LE: np.ndarray, candidate_LE: np.ndarray, horizon_steps: int,
           seconds_per_expert: float) -> ReplanDecision:
    """Weigh `candidate_LE` (solved on `recent`) against keeping `current_LE` for `horizon_steps` steps."""
    moved = int((np.asarray(current_LE) != np.asarray(candidate_LE)).sum())
    return ReplanDecision(candidate_LE=np.asarray(candidate_LE), moved=moved,
                          current_step_s=cost.step_time(recent, current_LE),
                          candidate_step_s=cost.step_time(recent, candidate_LE), horizon_steps=horizon_steps,
                          expected_cost_s=moved * seconds_per_expert)


def estimated_seconds_per_expert(bytes_per_expert: int, slowest_link_bytes_per_s: float) -> float:
    """The link model's seconds to move one expert: its frozen weights, LoRA and AdamW state over the
    slowest link (the receiver reads the weights from the checkpoint, on a cluster often over the
    same network)."""
    return bytes_per_expert / slowest_link_bytes_per_s
