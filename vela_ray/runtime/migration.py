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
from functools import cached_property

import numpy as np

from placement import PlacementProblem, cost
from vela_ray.model.experts import ExpertKey
from vela_ray.training.expert_manager import MigrationStats
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.summary import MigrationRecord


@dataclass(frozen=True)
class MigrationPlan:
    """The experts a worker gains or loses between two placements: tables [L, E], or per-master routes
    [M, L, E] (replicated experts: a worker hosts what any master routes to it). An expert arriving
    at a worker takes its state from the lowest-numbered worker that hosted it before."""

    old: np.ndarray
    new: np.ndarray

    @classmethod
    def between(cls, old, new) -> MigrationPlan:
        old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
        if old.shape[-2:] != new.shape[-2:]:
            raise ValueError(f"cannot migrate between placements of shapes {old.shape} and {new.shape}")
        return cls(old, new)

    @property
    def new_LE(self) -> np.ndarray:
        """Master 0's table after the migration."""
        return self.new if self.new.ndim == 2 else self.new[0]

    @cached_property
    def _hosts(self) -> tuple[np.ndarray, np.ndarray]:
        """(old, new) [N, L, E] bool: which worker hosts which expert."""
        num_workers = int(max(self.old.max(), self.new.max())) + 1
        return cost.hosted(_routes(self.old), num_workers), cost.hosted(_routes(self.new), num_workers)

    def _senders(self) -> np.ndarray:
        """[L, E] the lowest-numbered old host of each expert."""
        return self._hosts[0].argmax(axis=0)

    @property
    def arrivals(self) -> list[tuple[int, ExpertKey]]:
        """(worker, expert) for every expert a worker hosts after but not before."""
        old, new = self._hosts
        return [(int(n), (int(l), int(e))) for n, l, e in np.argwhere(new & ~old)]

    @property
    def moved(self) -> list[ExpertKey]:
        """Experts that arrive somewhere (with one copy each: the experts that change worker)."""
        return sorted({key for _, key in self.arrivals})

    def by_pair(self) -> dict[tuple[int, int], list[ExpertKey]]:
        """{(sending worker, receiving worker): experts the receiver gains}."""
        senders = self._senders()
        pairs: dict[tuple[int, int], list[ExpertKey]] = defaultdict(list)
        for worker, key in self.arrivals:
            pairs[(int(senders[key]), worker)].append(key)
        return dict(pairs)

    def touched(self) -> list[int]:
        """Workers that gain or lose an expert: the ones that must rehost."""
        old, new = self._hosts
        return sorted(int(n) for n in np.flatnonzero((old != new).any(axis=(1, 2))))

    def keys_of(self, worker: int) -> list[ExpertKey]:
        """What `worker` hosts after the migration."""
        new = self._hosts[1]
        if worker >= len(new):
            return []
        return [(int(layer), int(expert)) for layer, expert in np.argwhere(new[worker])]

    def senders_to(self, worker: int) -> list[tuple[int, int]]:
        """The (sender, receiver) pairs whose state `worker` receives."""
        return [pair for pair in self.by_pair() if pair[1] == worker]


def move_experts(workers: ExpertWorkers, plan: MigrationPlan) -> list[MigrationStats]:
    """Carry `plan` out on the live workers (steps 1 and 2 above), worker to worker: each receiver is handed
    its senders' pending `expert_states` (Ray actors: object refs, which the master never waits for:
    `actors.workers`); every touched worker's stats."""
    sent = {pair: workers.call_one(pair[0], "expert_states", keys) for pair, keys in plan.by_pair().items()}
    return workers.wait([workers.call_one(n, "rehost", plan.keys_of(n), *[sent[pair] for pair in plan.senders_to(n)])
                         for n in plan.touched()])


def _routes(table: np.ndarray) -> np.ndarray:
    return table if table.ndim == 3 else table[None]


def master_table(tables: np.ndarray, master: int = 0) -> np.ndarray:
    """Master `master`'s table [L, E]: the one table, or its row of per-master routes [M, L, E]."""
    tables = np.asarray(tables)
    return tables if tables.ndim == 2 else tables[master]


def copies_of(tables: np.ndarray) -> dict[ExpertKey, list[int]]:
    """{expert: the workers hosting it} for the experts hosted on more than one worker (routes [M, L, E];
    a table [L, E] has none)."""
    tables = np.asarray(tables)
    if tables.ndim == 2:
        return {}
    hosts = cost.hosted(tables, int(tables.max()) + 1)
    multi = np.argwhere(hosts.sum(axis=0) > 1)
    return {(int(l), int(e)): np.flatnonzero(hosts[:, l, e]).tolist() for l, e in multi}


def migration_record(plan: MigrationPlan, stats: list[MigrationStats], seconds: float, *, step: int,
                     reason: str, version: int, expected_saving_s: float | None = None,
                     expected_cost_s: float | None = None) -> MigrationRecord:
    return MigrationRecord(
        step=step, reason=reason, version=version, moved=len(plan.arrivals),
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
    moved = len(MigrationPlan.between(current_LE, candidate_LE).arrivals)
    return ReplanDecision(candidate_LE=np.asarray(candidate_LE), moved=moved,
                          current_step_s=cost.step_time(recent, current_LE),
                          candidate_step_s=cost.step_time(recent, candidate_LE), horizon_steps=horizon_steps,
                          expected_cost_s=moved * seconds_per_expert)


def estimated_seconds_per_expert(bytes_per_expert: int, slowest_link_bytes_per_s: float) -> float:
    """The link model's seconds to move one expert: its frozen weights, LoRA and AdamW state over the
    slowest link (the receiver reads the weights from the checkpoint, on a cluster often over the
    same network)."""
    return bytes_per_expert / slowest_link_bytes_per_s
