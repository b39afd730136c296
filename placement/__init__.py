"""Expert placement as pure math (numpy, cvxpy, pydantic; no torch, no ray).

    from placement import PlacementProblem, solve
    problem = PlacementProblem.from_file("problem.yaml")
    placement = solve(problem, "improved")      # or "vela", "sequential", "random"
    placement.to_json("placement.json")

Modules: `problem` (the inputs, shared links such as NICs included), `cost`
(expected time and bytes of any placement, and `check_table`, the one
placement validator), `lp` (the paper's LP relaxation, aggregated over worker
classes), `rounding` (the paper's rounding), `greedy` and `search` (the
improved solver's construction and local search), `solvers` (the plan,
`sequential_table` and the solver registry), `replicas` (several copies of an expert
for data-parallel masters: `replicate`, `nearest_routes`), `eplb` (DeepSeek's EPLB as a
baseline for them), `sequences` (LUFFY's sequence migration between masters:
`migrate_sequences`, `simulate_sequences`), `io` (profile and problem files:
`load_profile` is the one profile reader), `report` (text summary).

The names below are imported on first use (PEP 562), so `import placement.io`
(the profile reader the runtime's data side uses) does not pay for cvxpy and scipy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "CostReport": "placement.cost",
    "check_table": "placement.cost",
    "cost_report": "placement.cost",
    "cross_node_bytes": "placement.cost",
    "layer_times": "placement.cost",
    "layer_worker_times": "placement.cost",
    "StepPrediction": "placement.cost",
    "predict_step": "placement.cost",
    "round_trip_times": "placement.cost",
    "shared_link_times": "placement.cost",
    "step_time": "placement.cost",
    "worker_bytes": "placement.cost",
    "load_profile": "placement.io",
    "probs_from_counts": "placement.io",
    "solve_lp": "placement.lp",
    "PlacementProblem": "placement.problem",
    "SharedLink": "placement.problem",
    "TrainingStep": "placement.problem",
    "build_problem": "placement.problem",
    "node_shared_links": "placement.problem",
    "synthetic_probs": "placement.problem",
    "nearest_routes": "placement.replicas",
    "replicate": "placement.replicas",
    "eplb_routes": "placement.eplb",
    "eplb_copies": "placement.eplb",
    "eplb_slots": "placement.eplb",
    "round_relaxed": "placement.rounding",
    "SequenceTraffic": "placement.sequences",
    "migrate_sequences": "placement.sequences",
    "simulate_sequences": "placement.sequences",
    "SOLVERS": "placement.solvers",
    "Placement": "placement.solvers",
    "sequential_table": "placement.solvers",
    "solve": "placement.solvers",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from placement.cost import (
        CostReport,
        check_table,
        cost_report,
        cross_node_bytes,
        layer_times,
        layer_worker_times,
        StepPrediction,
        predict_step,
        round_trip_times,
        shared_link_times,
        step_time,
        worker_bytes,
    )
    from placement.io import load_profile, probs_from_counts
    from placement.lp import solve_lp
    from placement.problem import (
        PlacementProblem, SharedLink, TrainingStep, build_problem, node_shared_links, synthetic_probs,
    )
    from placement.eplb import eplb_copies, eplb_routes, eplb_slots
    from placement.replicas import nearest_routes, replicate
    from placement.rounding import round_relaxed
    from placement.sequences import SequenceTraffic, migrate_sequences, simulate_sequences
    from placement.solvers import SOLVERS, Placement, sequential_table, solve


def __getattr__(name: str) -> Any:
    """Import a public name from its home module on first use (module docstring)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'placement' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
