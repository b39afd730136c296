"""The control plane over every expert worker (`ExpertWorkers`; the data plane is the Transport), and the
workers as a data-parallel master other than master 0 sees them (`STEPPED_ELSEWHERE`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from vela_ray.model.experts import ExpertKey
from vela_ray.training.tiers import TierCounters
from vela_ray.training.optim import ZoTensors
from vela_ray.training.worker_report import WorkerCounters, WorkerReport

LoraState = dict[ExpertKey, dict[str, torch.Tensor]]


class WorkerCalls(Protocol):
    """How the control plane reaches the workers: `InProcessCalls`, or `actors.workers.ActorCalls` (Ray actors)."""

    def all(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker at once; their answers in worker order."""
        ...

    def one(self, worker: int, method: str, *args: Any) -> Any:
        """Start `method(*args)` on `worker`; its pending answer. A pending answer may be an argument of a later
        `one` call: the worker called gets its value, without this process waiting for it."""
        ...

    def wait(self, pending: list[Any]) -> list[Any]:
        """The values of pending answers (a value passes as it is)."""
        ...


@dataclass(frozen=True)
class InProcessCalls:
    """Workers that are objects of this process: a call runs when it is made, its answer is its value."""

    workers: list[Any]

    def all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(w, method)(*args) for w in self.workers]

    def one(self, worker: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[worker], method)(*args)

    def wait(self, pending: list[Any]) -> list[Any]:
        return list(pending)


class ExpertWorkers:
    """The control plane over every expert worker (the data plane is the Transport).

    Each call fans out to all workers and gathers their answers, so the workers step, load
    and report in parallel; chained calls of single workers (`call_one`, `wait`) pass one worker's
    answer to another without it coming back here. One class for every runtime; only the calls differ:
    `ExpertWorkers.in_process(objs)` calls objects in this process (ExpertManagers, or
    ShardTrainers in tests), `actors.workers.actor_workers(handles)` calls Ray actors.
    """

    def __init__(self, calls: WorkerCalls, num_workers: int):
        self._calls = calls
        self.num_workers = num_workers
        # Replicated experts (several masters, each using its nearest copy): {expert: its workers}. The
        # first worker of each counts it in norms and checkpoints; the others' copies are `not_counted`.
        self.copies: dict[ExpertKey, list[int]] = {}
        # Per worker: its counters as of the last step's fan-out (`step`, `zo_apply` answer them) or report,
        # whichever came last; what the trackers and the tiers' metrics read each step without asking.
        self.counters: list[WorkerCounters] = []

    @classmethod
    def in_process(cls, workers: Sequence[Any]) -> "ExpertWorkers":
        workers = list(workers)
        return cls(InProcessCalls(workers), len(workers))

    def call_one(self, worker: int, method: str, *args: Any) -> Any:
        """Start `method(*args)` on `worker`; its pending answer (`WorkerCalls.one`): pass it to another
        worker's `call_one`, or to `wait` for its value."""
        return self._calls.one(worker, method, *args)

    def wait(self, pending: list[Any]) -> list[Any]:
        """The values of `call_one`'s pending answers."""
        return self._calls.wait(pending)

    def set_copies(self, copies: dict[ExpertKey, list[int]]) -> None:
        """The replicated experts of the placement the workers now host (`migration.copies_of`)."""
        self.copies = dict(copies)

    @property
    def not_counted(self) -> dict[int, list[ExpertKey]]:
        out: dict[int, list[ExpertKey]] = {}
        for key, workers in self.copies.items():
            for worker in workers[1:]:
                out.setdefault(worker, []).append(key)
        return out

    def grad_sq_norm(self) -> float:
        """Sum over workers of their experts' squared gradient norms, each expert once.

        Called after every master's backward: first the copies of each replicated expert get the sum
        of all copies' gradients (the gradient of the one expert they stand for), so that they take
        the same optimizer step and stay identical."""
        if not self.copies:
            return float(sum(self._calls.all("grad_sq_norm")))
        # a worker runs its calls in order: its sum comes before its norm, and one wait covers both
        summing = self._sum_copies()
        norms = [self.call_one(n, "grad_sq_norm", self.not_counted) for n in range(self.num_workers)]
        return float(sum(self.wait(summing + norms)[len(summing):]))

    def _sum_copies(self) -> list[Any]:
        """Start the copies' gradient sums among their workers (`ExpertManager.sum_copy_grads`); the pending
        answers. Each worker holding copies hands its copies' gradients, pending, to the other holders of the
        same experts: the master never waits for them nor sums them (over Ray, see `actors.workers` for the
        route their bytes take)."""
        held: dict[int, list[ExpertKey]] = {}
        for key, workers in self.copies.items():
            for worker in workers:
                held.setdefault(worker, []).append(key)
        grads = {n: self.call_one(n, "lora_grads", keys) for n, keys in held.items()}
        summing = []
        for n, keys in held.items():
            peers = sorted({m for key in keys for m in self.copies[key]} - {n})
            summing.append(self.call_one(n, "sum_copy_grads", peers, *[grads[m] for m in peers]))
        return summing

    def step(self, lr: float, clip_coef: float) -> None:
        """Every worker's optimizer step; their answers are the latest `counters`."""
        self.counters = self._calls.all("step", lr, clip_coef)

    def zo_apply(self, terms: list[tuple[int, float]], which: ZoTensors = "lora") -> None:
        """Zeroth-order training (`vela_ray.training.zo`): every worker adds each (step seed, coefficient)
        term's noise to its own experts' `which` tensors (LoRA, frozen weights or both), drawing the noise itself;
        only the scalars travel. Their
        answers are the latest `counters`: a ZO step's last fan-out comes before its second forward pass, whose
        rows and compute the next step's counters include."""
        self.counters = self._calls.all("zo_apply", terms, which)

    def lora_state(self) -> LoraState:
        """All experts' adapters, keyed by logical (layer, expert)."""
        state: LoraState = {}
        for part in self._calls.all("lora_state"):
            state.update(part)
        return state

    def load_lora_state(self, state: LoraState) -> None:
        """Each worker takes its own experts from `state`."""
        self._calls.all("load_lora_state", state)

    def save_checkpoint_parts(self, staging_dir: str) -> list[str]:
        """Every worker writes its experts' LoRA and AdamW state into the staging directory (a replicated
        expert once, by the worker that counts it)."""
        self.snapshot_checkpoint_parts(staging_dir)
        return self.finish_checkpoint_parts()

    def snapshot_checkpoint_parts(self, staging_dir: str) -> None:
        """`save_checkpoint_parts` in two halves: every worker copies its state now and writes it into the
        staging directory on a thread of its own; `finish_checkpoint_parts` waits for the files."""
        self._calls.all("snapshot_checkpoint_part", staging_dir, self.not_counted)

    def finish_checkpoint_parts(self, poll_s: float | None = None) -> list[str]:
        """Every worker's part file once written (a failed write raises). `poll_s`: ask every `poll_s`
        seconds instead of waiting inside the workers, which would hold up their data plane meanwhile."""
        if poll_s is None:
            return self._calls.all("finish_checkpoint_part")
        while True:
            parts = self._calls.all("finish_checkpoint_part", 0.0)
            if all(part is not None for part in parts):
                return parts
            time.sleep(poll_s)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        self._calls.all("load_checkpoint", checkpoint_dir)

    def reports(self) -> list[WorkerReport]:
        """Per worker: its `worker_report.WorkerReport` (where it runs, its sizing, its counters so far), in a
        round trip of its own (the latest `counters` too): for what is read once a run, not each step."""
        reports = self._calls.all("report")
        self.counters = reports
        return reports

    def tier_stats(self) -> list[TierCounters | None]:
        """Per worker: its `tiers.TierCounters` (`expert_tiers`) in the latest `counters`, None where untiered."""
        return [counters.tiers for counters in self.counters]

    def set_predictor(self, state: dict[str, torch.Tensor], top_k: int) -> None:
        """Every tiered worker forecasts next-layer demand with this `popularity.PopularityPredictor` state."""
        self._calls.all("set_predictor", state, top_k)


STEPPED_ELSEWHERE = ExpertWorkers.in_process([])
"""The workers as a data-parallel master other than master 0 sees them (`vela_ray.runtime.masters`):
master 0 reads their gradient norm and steps them, so here both are no-ops (a norm of 0 in the sum)."""
