"""PlacementService: measure links and capacities, solve the placement, publish it.

It runs on the master's node (pinned there by `spawn_placement_service`), so
the bandwidth it measures to each ExpertManager is the master's link to it,
over the same Ray transport the broker uses. A placement is a pure function of
what it measures (`placement.solve`); the master carries it out.

    service = spawn_placement_service(master_node_id)
    links = ray.get(service.probe.remote(handles))           # [WorkerLink]
    compute = ray.get(service.probe_compute.remote(handles, num_rows=512))  # [seconds per row]
    plan = ray.get(service.solve.remote(request))            # placement.Placement
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray
import torch
from pydantic import BaseModel, ConfigDict
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from placement import Placement, PlacementProblem, solve

logger = logging.getLogger(__name__)

PROBE_SIZES = (16 << 10, 256 << 10, 2 << 20, 8 << 20)  # bytes per probe message


class WorkerLink(BaseModel):
    """Fitted one-way link from the master to a worker: time = latency + bytes / bandwidth."""

    model_config = ConfigDict(frozen=True)

    latency_s: float
    bandwidth_bytes_per_s: float
    samples: list[tuple[int, float]]  # (bytes, seconds)


class PlacementRequest(BaseModel):
    """Everything the solver needs, measured or configured."""

    model_config = ConfigDict(frozen=True)

    probs: list[list[float]]
    top_k: int
    tokens_per_step: int
    hidden_size: int
    bits_per_element: int
    bandwidths: list[float]
    capacities: list[int]
    worker_nodes: list[str]
    master_node: str
    compute_seconds_per_row: list[float] | None = None  # None: communication-only cost model (the paper's)
    solver: str
    seed: int = 0
    placement_file: str | None = None

    def problem(self) -> PlacementProblem:
        return PlacementProblem(
            probs=np.asarray(self.probs), top_k=self.top_k, tokens_per_step=self.tokens_per_step,
            hidden_size=self.hidden_size, bits_per_element=self.bits_per_element,
            bandwidths=self.bandwidths, capacities=self.capacities,
            worker_nodes=self.worker_nodes, master_node=self.master_node,
            compute_seconds_per_row=self.compute_seconds_per_row,
        )


def fit_link(samples: Sequence[tuple[int, float]]) -> WorkerLink:
    """Least-squares fit of seconds = latency + bytes / bandwidth (bandwidth kept positive)."""
    sizes = np.array([s for s, _ in samples], dtype=np.float64)
    times = np.array([t for _, t in samples], dtype=np.float64)
    slope, intercept = np.polyfit(sizes, times, 1)
    slope = max(slope, 1e-15)
    return WorkerLink(latency_s=max(intercept, 0.0), bandwidth_bytes_per_s=1.0 / slope, samples=list(samples))


class PlacementService:
    """Plain class; `spawn_placement_service` makes it an actor on the master's node."""

    def __init__(self) -> None:
        self.version = 0
        self.published: Placement | None = None

    def probe(self, handles: list[Any], sizes: Sequence[int] = PROBE_SIZES, repeats: int = 3,
              enough_s: float = 0.1) -> list[WorkerLink]:
        """Time `echo` calls of several sizes to each worker alone; fit each worker's link.

        One worker at a time: the cost model takes per-worker links. (Probing all workers at
        once, as the broker sends, folds the shared NIC into every link; in the vela-vs-EP
        benchmark that over-predicted the communication time of spread placements 2.5x, while
        probing alone predicted it within 35%.) Sizes grow until a message takes `enough_s`
        (after at least two sizes): 8 MB over 100 Mbit/s would cost seconds per sample.
        """
        links = []
        for worker, handle in enumerate(handles):
            ray.get(handle.echo.remote(torch.zeros(1)))  # warm the path
            samples = []
            for size in sizes:
                payload = torch.zeros(size // 4, dtype=torch.float32)
                best = min(self._time_echo(handle, payload) for _ in range(repeats))
                samples.append((size, best))
                if len(samples) >= 2 and best >= enough_s:
                    break
            links.append(fit_link(samples))
            logger.info("link to worker %d: %.3g GB/s, %.0f us latency", worker,
                        links[-1].bandwidth_bytes_per_s / 1e9, links[-1].latency_s * 1e6)
        return links

    def probe_compute(self, handles: list[Any], num_rows: int) -> list[float]:
        """Seconds per routed row of expert forward+backward on each worker (the cost model's c_n).

        All workers are timed at once, as they compute during a layer: workers that share a
        node's cores see each other's load. A worker without experts gets the median of the rest.
        """
        measured = ray.get([h.seconds_per_row.remote(num_rows) for h in handles])
        known = [m for m in measured if m is not None]
        if not known:
            raise ValueError("no worker hosts an expert, so compute per row cannot be measured")
        fallback = float(np.median(known))
        per_row = [fallback if m is None else m for m in measured]
        logger.info("expert compute per row: %s us", ", ".join(f"{1e6 * s:.2f}" for s in per_row))
        return per_row

    @staticmethod
    def _time_echo(handle: Any, payload: torch.Tensor) -> float:
        start = time.perf_counter()
        ray.get(handle.echo.remote(payload))
        return time.perf_counter() - start

    def solve(self, request: PlacementRequest) -> Placement:
        """Solve (or read) the placement for `request` and publish it with a new version."""
        problem = request.problem()
        if request.solver == "file":
            plan = Placement.from_json(Path(request.placement_file))
            _check_matches(plan, problem, request.placement_file)
        else:
            plan = solve(problem, request.solver, seed=request.seed)
        self.published, self.version = plan, self.version + 1
        logger.info("placement v%d (%s): expected %.3g s/step, bound %s", self.version, plan.solver,
                    plan.expected_step_time, plan.lower_bound)
        return plan

    def current(self) -> tuple[int, Placement | None]:
        return self.version, self.published


def _check_matches(plan: Placement, problem: PlacementProblem, source: str | None) -> None:
    shape = (len(plan.expert_to_worker), len(plan.expert_to_worker[0]))
    if shape != (problem.num_layers, problem.num_experts) or plan.num_workers != problem.num_workers:
        raise ValueError(
            f"placement.file {source} places {shape[0]}x{shape[1]} experts on {plan.num_workers} workers, "
            f"but this job has {problem.num_layers}x{problem.num_experts} on {problem.num_workers}")


def spawn_placement_service(node_id: str, env_vars: dict[str, str] | None = None) -> Any:
    """The PlacementService actor, pinned to `node_id` (the master's node).

    `env_vars`: the master's data-plane settings (`actors.transports.data_plane_env`), so the probe
    measures links the way the broker uses them.
    """
    return ray.remote(PlacementService).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": env_vars or {}},
    ).remote()
