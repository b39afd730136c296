"""Expert placement as pure math (numpy, cvxpy, pydantic; no torch, no ray).

    from placement import PlacementProblem, solve
    problem = PlacementProblem.from_file("problem.yaml")
    placement = solve(problem, "improved")      # or "vela", "sequential", "random"
    placement.to_json("placement.json")

Modules: `problem` (the inputs), `cost` (expected time and bytes of any
placement), `lp` (the paper's LP relaxation, aggregated over worker classes),
`rounding` (the paper's rounding), `greedy` and `search` (the improved
solver's construction and local search), `solvers` (the plan and the solver
registry), `io` (profile and problem files), `report` (text summary).
"""

from placement.cost import (
    CostReport,
    cost_report,
    cross_node_bytes,
    layer_worker_times,
    step_time,
    worker_bytes,
)
from placement.io import load_profile
from placement.lp import solve_lp
from placement.problem import PlacementProblem, build_problem, synthetic_probs
from placement.rounding import round_relaxed
from placement.solvers import SOLVERS, Placement, solve

__all__ = [
    "CostReport",
    "Placement",
    "PlacementProblem",
    "SOLVERS",
    "build_problem",
    "cost_report",
    "cross_node_bytes",
    "layer_worker_times",
    "load_profile",
    "round_relaxed",
    "solve",
    "solve_lp",
    "step_time",
    "synthetic_probs",
    "worker_bytes",
]
