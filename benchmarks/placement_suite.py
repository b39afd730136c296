"""Placement solvers compared on a suite of MoE models and clusters (VELA paper Sec. IV-B).

Reads top to bottom:
  1. build the suite of problems (below);
  2. solve each with every solver (sequential, random, vela, improved) and record
     the expected communication time per step, its ratio to the LP bound and to
     `vela`, and the solve time;
  3. time the paper's direct LP against the class-aggregated one at a larger scale;
  4. print one table (seeds averaged) and save every raw number as JSON.

The suite. Routing profiles are synthetic (`placement.synthetic_probs`): per
layer, expert popularity ~ Dirichlet(concentration), scaled to sum to top_k
with each probability capped at 1. The concentration sets the skew (the
coefficient of variation of popularity is about 1/sqrt(concentration)):
"flat" 8.0, "moderate" 2.0 (Mixtral-like), "steep" 0.5.

- Mixtral-like: 32 layers x 8 experts, top-2, K = 8 x 512 tokens, H = 4096,
  16-bit, on the paper's cluster: 6 workers = 3 nodes x 2 GPUs, master on node 0,
  so 2 workers at 18.3 GB/s (inside the master's node) and 4 at 1.17 GB/s
  (Ethernet). Flat, moderate and steep skew; `--seeds` profiles each.
- Qwen3-30B-A3B-like: 48 x 128, top-8, K = 8 x 4096, H = 2048, on 16 workers =
  4 nodes x 4 GPUs; DeepSeek-V3-like: 58 x 256, top-8, K = 8 x 4096, H = 7168,
  on 64 workers = 8 nodes x 8 GPUs. Both on an H100-class cluster: 150 GB/s
  inside the master's node (NVLink), 50 GB/s across (400 Gb/s NIC per GPU).
  Moderate skew, one profile.

Capacities: "tight" is ceil(L * E / N) per worker: exact for Qwen (384) and
DeepSeek (232); for Mixtral 256 / 6 is not whole, so 43 per worker (2 spare
slots in all). "loose" is ceil(1.5 * L * E / N).

Run: python benchmarks/placement_suite.py   (about a minute on 2 cores;
     --direct-at-scale adds the direct LP at DeepSeek-V3 scale, minutes more)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from placement import SOLVERS, PlacementProblem, solve, solve_lp, synthetic_probs

SKEWS = {"flat": 8.0, "moderate": 2.0, "steep": 0.5}
CAPACITY_FACTORS = {"tight": 1.0, "loose": 1.5}
RESULTS = Path(__file__).resolve().parent / "results" / "placement.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="profiles (seeds) per Mixtral-like case")
    p.add_argument("--time-budget", type=float, default=10.0, help="seconds the improved solver may use per case")
    p.add_argument("--skip-large", action="store_true", help="Mixtral-like cases only")
    p.add_argument("--direct-at-scale", action="store_true",
                   help="also time the direct LP at DeepSeek-V3 scale (58 x 256 on 64 workers; minutes)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where to save the raw numbers (JSON)")
    return p.parse_args()


# --- 1. the suite --------------------------------------------------------------


def cluster_problem(
    probs: np.ndarray, top_k: int, *, nodes: int, per_node: int, near_gb_s: float, far_gb_s: float,
    capacity_factor: float, tokens: int, hidden: int,
) -> PlacementProblem:
    """Workers on `nodes` nodes; the master sits on node 0, so its workers get `near_gb_s`."""
    num_workers = nodes * per_node
    slots = probs.size * capacity_factor / num_workers
    return PlacementProblem(
        probs=probs, top_k=top_k, tokens_per_step=tokens, hidden_size=hidden,
        bandwidths=[1e9 * (near_gb_s if n < per_node else far_gb_s) for n in range(num_workers)],
        capacities=[math.ceil(slots)] * num_workers,
        worker_nodes=[f"node{n // per_node}" for n in range(num_workers)], master_node="node0",
    )


def mixtral_like(skew: str, capacity: str, seed: int) -> PlacementProblem:
    probs = synthetic_probs(32, 8, 2, concentration=SKEWS[skew], seed=seed)
    return cluster_problem(probs, 2, nodes=3, per_node=2, near_gb_s=18.3, far_gb_s=1.17,
                           capacity_factor=CAPACITY_FACTORS[capacity], tokens=8 * 512, hidden=4096)


def qwen3_like(capacity: str, seed: int = 0) -> PlacementProblem:
    probs = synthetic_probs(48, 128, 8, concentration=SKEWS["moderate"], seed=seed)
    return cluster_problem(probs, 8, nodes=4, per_node=4, near_gb_s=150, far_gb_s=50,
                           capacity_factor=CAPACITY_FACTORS[capacity], tokens=8 * 4096, hidden=2048)


def deepseek_v3_like(capacity: str, seed: int = 0) -> PlacementProblem:
    probs = synthetic_probs(58, 256, 8, concentration=SKEWS["moderate"], seed=seed)
    return cluster_problem(probs, 8, nodes=8, per_node=8, near_gb_s=150, far_gb_s=50,
                           capacity_factor=CAPACITY_FACTORS[capacity], tokens=8 * 4096, hidden=7168)


def suite(num_seeds: int, skip_large: bool) -> list[tuple[str, int, PlacementProblem]]:
    """(case name, seed, problem) for every case."""
    cases = [
        (f"mixtral {skew} {capacity}", seed, mixtral_like(skew, capacity, seed))
        for capacity in CAPACITY_FACTORS for skew in SKEWS for seed in range(num_seeds)
    ]
    if not skip_large:
        cases += [(f"qwen3 moderate {c}", 0, qwen3_like(c)) for c in CAPACITY_FACTORS]
        cases += [(f"deepseek-v3 moderate {c}", 0, deepseek_v3_like(c)) for c in CAPACITY_FACTORS]
    return cases


# --- 2. solve ---------------------------------------------------------------------


def run_case(name: str, seed: int, problem: PlacementProblem, time_budget: float) -> list[dict]:
    """One record per solver for one problem."""
    placements = {s: solve(problem, s, seed=seed, time_budget_s=time_budget) for s in SOLVERS}
    lower_bound = placements["vela"].lower_bound
    vela_time = placements["vela"].expected_step_time
    shape = f"{problem.num_layers}x{problem.num_experts} on {problem.num_workers}"
    return [
        {
            "case": name, "seed": seed, "shape": shape, "capacity": problem.capacities[0],
            "solver": solver, "step_time_s": p.expected_step_time, "lower_bound_s": lower_bound,
            "ratio_to_bound": p.expected_step_time / lower_bound,
            "ratio_to_vela": p.expected_step_time / vela_time, "solve_s": p.solve_seconds,
        }
        for solver, p in placements.items()
    ]


# --- 3. direct vs aggregated LP -----------------------------------------------------


def time_lp(problem: PlacementProblem, direct: bool) -> tuple[float, float]:
    """(LP bound, seconds) of one LP formulation."""
    start = time.perf_counter()
    bound, _ = solve_lp(problem, direct=direct)
    return bound, time.perf_counter() - start


def lp_scaling(name: str, problem: PlacementProblem) -> dict:
    direct_bound, direct_s = time_lp(problem, direct=True)
    aggregated_bound, aggregated_s = time_lp(problem, direct=False)
    return {
        "case": name, "direct_s": direct_s, "aggregated_s": aggregated_s,
        "speedup": direct_s / aggregated_s, "direct_bound_s": direct_bound,
        "aggregated_bound_s": aggregated_bound,
        "bound_rel_diff": abs(direct_bound - aggregated_bound) / direct_bound,
    }


# --- 4. report ------------------------------------------------------------------------


def table(records: list[dict]) -> str:
    """One row per (case, solver), seeds averaged; 'worst' is the largest ratio to vela."""
    header = ("case", "shape", "cap", "solver", "step ms", "x LP bound", "x vela", "worst x vela", "solve s")
    rows = []
    keys = list(dict.fromkeys((r["case"], r["solver"]) for r in records))
    for case, solver in keys:
        group = [r for r in records if r["case"] == case and r["solver"] == solver]
        mean = lambda field: float(np.mean([r[field] for r in group]))  # noqa: E731
        rows.append((
            case, group[0]["shape"], str(group[0]["capacity"]), solver,
            f"{1e3 * mean('step_time_s'):.1f}", f"{mean('ratio_to_bound'):.3f}",
            f"{mean('ratio_to_vela'):.3f}", f"{max(r['ratio_to_vela'] for r in group):.3f}",
            f"{mean('solve_s'):.2f}",
        ))
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def improved_summary(records: list[dict]) -> str:
    ratios = {cap: [r["ratio_to_vela"] for r in records if r["solver"] == "improved" and r["case"].endswith(cap)]
              for cap in CAPACITY_FACTORS}
    mixtral_s = [r["solve_s"] for r in records if r["solver"] == "improved" and r["case"].startswith("mixtral")]
    parts = [f"{cap}: mean {np.mean(v) - 1:+.1%}, worst {max(v) - 1:+.1%} over {len(v)} cases"
             for cap, v in ratios.items() if v]
    return (f"improved vs vela: {'; '.join(parts)}; "
            f"Mixtral-scale improved solve time max {max(mixtral_s):.2f} s")


def main() -> int:
    args = parse_args()
    records = []
    cases = suite(args.seeds, args.skip_large)
    for index, (name, seed, problem) in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {name} seed {seed}", file=sys.stderr, flush=True)
        records += run_case(name, seed, problem, args.time_budget)
    print("timing the direct and the aggregated LP ...", file=sys.stderr, flush=True)
    scaling = [lp_scaling("qwen3 moderate tight", qwen3_like("tight"))]
    if args.direct_at_scale:
        scaling.append(lp_scaling("deepseek-v3 moderate tight", deepseek_v3_like("tight")))

    print(table(records))
    print()
    print(improved_summary(records))
    for s in scaling:
        print(f"LP at {s['case']}: direct {s['direct_s']:.2f} s, aggregated {s['aggregated_s']:.2f} s "
              f"({s['speedup']:.0f}x faster), bounds differ by {s['bound_rel_diff']:.1e} (relative)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"records": records, "lp_scaling": scaling}, indent=1) + "\n")
    print(f"raw numbers: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
