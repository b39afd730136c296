"""Placement solvers and the plan they produce.

    placement = solve(problem, "improved", seed=0, time_budget_s=10.0)
    placement.to_json("placement.json")
    placement = Placement.from_json("placement.json", problem)   # checks it fits

Solvers (registered in `SOLVERS`, all `(problem, *, seed, time_budget_s, direct)
-> (expert_to_worker [L, E], lower_bound | None)`):

- `sequential`: the paper's baseline, expert e of every layer on worker e mod N
  (`sequential_table`, expert parallelism's table). Only when capacities do not
  allow that table, a worker that is full passes the expert on to the next
  worker (e + 1, e + 2, ... mod N) with room; layers are filled in order.
- `random`: the paper's other baseline, a seeded uniformly random assignment of
  all L * E experts to capacity slots.
- `vela`: the paper's method, the LP relaxation (`placement.lp`, class-aggregated
  unless `direct`) followed by its three-step rounding (`placement.rounding`).
  The rounding computes no times: it sees shared links through the relaxed
  placement of the LP, which has a row per shared link and layer.
- `improved`: `vela`'s placement as the incumbent, replaced by the greedy
  construction (`placement.greedy`) if that is strictly better, then local
  search (`placement.search`) that only accepts strict improvements; so it is
  never worse than `vela`. It stops when the search stalls or at
  `time_budget_s` (LP and greedy construction included). Where cvxpy is not
  installed (a bare GPU node: `make gpu-wheels`), it starts from the greedy
  construction alone, says so in one log line, and reports no lower bound;
  `vela` is then refused, naming the package.

Every solver that looks at times (LP, greedy, search, `improved`'s choice of
start) minimises the cost model's step time, shared links included.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, computed_field, model_validator

from placement.cost import check_expert_to_worker, check_table, experts_per_worker, step_time
from placement.greedy import greedy_placement
from placement.io import read_json
from placement.problem import PlacementProblem
from placement.rounding import round_relaxed
from placement.search import improve

logger = logging.getLogger(__name__)

DEFAULT_TIME_BUDGET_S = 10.0

SolverFn = Callable[..., tuple[np.ndarray, "float | None"]]


class Placement(BaseModel):
    """A feasible placement of every expert on one worker, with how it was found."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    expert_to_worker: list[list[int]]
    """[num_layers][num_experts] worker index of each expert."""
    num_workers: int
    """Workers of the problem it was solved for."""
    capacities: list[int]
    """[num_workers] capacities of the problem it was solved for."""
    solver: str
    """Name of the solver in `SOLVERS` that produced it."""
    expected_step_time: float
    """Expected seconds per step, sum_l max_n E[T_{n,l}] (communication, plus compute if the problem has it;
    with shared links, each layer's slowest worker or shared link: `placement.cost.step_time`)."""
    lower_bound: float | None = None
    """LP bound on the optimum (seconds), for LP-based solvers."""
    solve_seconds: float = 0.0
    """Wall-clock seconds the solver took."""
    routes: list[list[list[int]]] | None = None
    """With data-parallel masters and replicated experts (`placement.replicas.replicate`): [M][L][E] the
    worker each master sends its rows of each expert to; `expert_to_worker` is then master 0's."""

    @model_validator(mode="after")
    def _fits_its_workers(self) -> Placement:
        if len(self.capacities) != self.num_workers:
            raise ValueError(
                f"capacities has {len(self.capacities)} entries for {self.num_workers} workers"
            )
        check_table(self.expert_to_worker, self.capacities)
        if self.routes is not None:
            counts = experts_per_worker(self.num_workers, np.asarray(self.routes))
            if (counts > np.asarray(self.capacities)).any() or self.routes[0] != self.expert_to_worker:
                raise ValueError("routes host more experts on a worker than its capacity, or their first "
                                 "table is not expert_to_worker: solve again")
        return self

    def tables(self) -> np.ndarray:
        """What the workers host and the masters send to: routes [M, L, E], or the one table [L, E]."""
        return np.asarray(self.routes if self.routes is not None else self.expert_to_worker, dtype=np.int64)

    @computed_field
    @property
    def gap(self) -> float | None:
        """expected_step_time / lower_bound - 1 (how far above the LP bound it may be)."""
        if self.lower_bound is None or self.lower_bound <= 0:
            return None
        return self.expected_step_time / self.lower_bound - 1

    @computed_field
    @property
    def worker_to_experts(self) -> list[list[tuple[int, int]]]:
        """[num_workers] list of the (layer, expert) pairs each worker holds."""
        held: list[list[tuple[int, int]]] = [[] for _ in range(self.num_workers)]
        for layer, row in enumerate(self.expert_to_worker):
            for expert, worker in enumerate(row):
                held[worker].append((layer, expert))
        return held

    @property
    def shape(self) -> tuple[int, int, int]:
        """(num_layers, num_experts, num_workers)."""
        return len(self.expert_to_worker), len(self.expert_to_worker[0]), self.num_workers

    def as_array(self) -> np.ndarray:
        """expert_to_worker as an int64 array [num_layers, num_experts]."""
        return np.asarray(self.expert_to_worker, dtype=np.int64)

    def check_fits(self, problem: PlacementProblem, source: str | None = None) -> None:
        """Raise ValueError unless this placement is a feasible one for `problem`.

        `source` (e.g. the placement file's path) starts every message, so a user
        who points a job at the wrong file learns which file it was.
        """
        if self.shape != (problem.num_layers, problem.num_experts, problem.num_workers):
            what = f"placement {source}" if source else "placement"
            raise ValueError(
                f"{what} is for {_size(*self.shape)}, but the problem has "
                f"{_size(problem.num_layers, problem.num_experts, problem.num_workers)}: "
                "solve again for this problem (vela place)"
            )
        check_table(self.expert_to_worker, problem.capacities, source=source)

    def to_json(self, path: str | Path) -> None:
        """Write the placement (both mappings and its metadata) as JSON."""
        data = self.model_dump(mode="json")
        lines = [f"  {json.dumps(key)}: {_compact_json(value)}" for key, value in data.items()]
        Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n")

    @classmethod
    def from_json(cls, path: str | Path, problem: PlacementProblem | None = None) -> Placement:
        """Read a placement; with `problem`, also check that it fits that problem.

        Every error is one ValueError that names the file (it is often a file a
        job's config points to, written long before).
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"placement {str(path)!r} does not exist or is not a file (write one with vela place)")
        try:
            data = read_json(path)
            if not isinstance(data, dict):
                raise ValueError("must be a JSON object as `vela place --out` writes")
            for derived in ("gap", "worker_to_experts"):
                data.pop(derived, None)
            placement = cls.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise ValueError(f"placement {path}: {field + ': ' if field else ''}{message}") from None
        except ValueError as err:
            raise ValueError(f"placement {path}: {err}") from None
        if problem is not None:
            placement.check_fits(problem, source=str(path))
        return placement


def _size(num_layers: int, num_experts: int, num_workers: int) -> str:
    return f"{num_layers} layers x {num_experts} experts on {num_workers} workers"


def _compact_json(value: object) -> str:
    """JSON with one inner list per line for tables (expert_to_worker, worker_to_experts)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "[\n    " + ",\n    ".join(json.dumps(row) for row in value) + "\n  ]"
    return json.dumps(value)


# --- solvers -------------------------------------------------------------------


def sequential_table(num_layers: int, num_experts: int, num_workers: int) -> np.ndarray:
    """[num_layers, num_experts] expert e of every layer on worker e mod N.

    Expert parallelism's table (the paper's baseline), in one place: the
    `sequential` solver starts from it and the expert-parallel ranks own by it.
    """
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("num_workers", num_workers)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    return np.tile(np.arange(num_experts, dtype=np.int64) % num_workers, (num_layers, 1))


def sequential_placement(problem: PlacementProblem, **_: object) -> tuple[np.ndarray, None]:
    """`sequential_table` where capacities allow; else a full worker passes the expert to the next one with room."""
    table = sequential_table(problem.num_layers, problem.num_experts, problem.num_workers)
    if np.all(experts_per_worker(problem.num_workers, table) <= np.asarray(problem.capacities)):
        return table, None
    return _sequential_with_overflow(problem), None


def _sequential_with_overflow(problem: PlacementProblem) -> np.ndarray:
    """Expert e on worker e mod N, layers in order; a full worker passes it on (e + 1, e + 2, ... mod N)."""
    room = np.array(problem.capacities)
    assignment = np.empty(problem.probs.shape, dtype=np.int64)
    for layer in range(problem.num_layers):
        for expert in range(problem.num_experts):
            worker = expert % problem.num_workers
            while room[worker] == 0:
                worker = (worker + 1) % problem.num_workers
            assignment[layer, expert] = worker
            room[worker] -= 1
    return assignment


def random_placement(problem: PlacementProblem, *, seed: int = 0, **_: object) -> tuple[np.ndarray, None]:
    """Every expert to a distinct capacity slot, uniformly at random (seeded)."""
    rng = np.random.default_rng(seed)
    slots = np.repeat(np.arange(problem.num_workers), problem.capacities)
    chosen = rng.permutation(slots)[: problem.num_layers * problem.num_experts]
    return chosen.reshape(problem.probs.shape), None


def lp_available() -> bool:
    """Whether the LP relaxation can be solved here: cvxpy (and its HiGHS backend) installed. The training core
    runs without them (a bare GPU node), so `placement.lp` is imported only where it is used."""
    return all(importlib.util.find_spec(name) is not None for name in ("cvxpy", "highspy"))


def vela_placement(problem: PlacementProblem, *, direct: bool = False, **_: object) -> tuple[np.ndarray, float]:
    """The paper: LP relaxation, then its three-step rounding."""
    if not lp_available():
        raise ValueError("placement.solver: vela solves the paper's LP with cvxpy and highspy, which are not "
                         "installed here; pip install cvxpy highspy, or use solver improved (greedy + search "
                         "without them) or sequential")
    from placement.lp import solve_lp

    # 1. relax
    lower_bound, x_relaxed = solve_lp(problem, direct=direct)
    # 2. round
    return round_relaxed(x_relaxed, problem.capacities), lower_bound


def improved_placement(
    problem: PlacementProblem,
    *,
    seed: int = 0,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    direct: bool = False,
) -> tuple[np.ndarray, float | None]:
    """`vela`'s placement as incumbent, replaced only by strictly better ones."""
    start = time.perf_counter()
    greedy = greedy_placement(problem)
    if lp_available():
        # 1. the paper's placement is the incumbent
        incumbent, lower_bound = vela_placement(problem, direct=direct)
        # 2. the greedy construction replaces it if it is better
        if step_time(problem, greedy) < step_time(problem, incumbent):
            incumbent = greedy
    else:
        logger.info("placement: cvxpy/highspy not installed, so the improved solver starts from the greedy "
                    "construction without the paper's LP (no lower bound); pip install cvxpy highspy for it")
        incumbent, lower_bound = greedy, None
    # 3. local search with what is left of the budget
    remaining = max(0.0, time_budget_s - (time.perf_counter() - start))
    return improve(problem, incumbent, time_budget_s=remaining, seed=seed), lower_bound


SOLVERS: dict[str, SolverFn] = {
    "sequential": sequential_placement,
    "random": random_placement,
    "vela": vela_placement,
    "improved": improved_placement,
}


def solve(
    problem: PlacementProblem,
    solver: str = "improved",
    *,
    seed: int = 0,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    direct: bool = False,
) -> Placement:
    """Place every expert with the named solver and evaluate the result.

    `seed` drives `random` and the search in `improved`; `time_budget_s` bounds
    `improved`; `direct` makes the LP solvers use the paper's per-worker LP.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}: choose one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    assignment, lower_bound = SOLVERS[solver](
        problem, seed=seed, time_budget_s=time_budget_s, direct=direct
    )
    elapsed = time.perf_counter() - start
    assignment = check_expert_to_worker(problem, assignment)
    return Placement(
        expert_to_worker=assignment.tolist(),
        num_workers=problem.num_workers,
        capacities=list(problem.capacities),
        solver=solver,
        expected_step_time=step_time(problem, assignment),
        lower_bound=lower_bound,
        solve_seconds=elapsed,
    )
