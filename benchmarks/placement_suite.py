"""Placement solvers compared on a suite of MoE models and clusters (VELA paper Sec. IV-B).

Reads top to bottom:
  1. build the suite of problems (below);
  2. solve each with every solver (sequential, random, vela, improved) and record
     the expected communication time per step, its ratio to the LP bound and to
     `vela`, and the solve time;
  3. the shared-NIC model and replicated experts (Mixtral-like cases): every node's
     NIC is a shared link (`placement.node_shared_links`, 1.17 GB/s, the paper's
     Ethernet) and each case is placed twice. With one master on node 0, every
     solver runs on the problem with the NICs. With a master per node (3
     data-parallel masters, each with K/3 tokens) the rows are: `sequential`
     (EP's table, one copy), `improved` (one copy), `improved + replicas`
     (`placement.replicate`: copies in spare capacity, each master using its own)
     and `eplb` (DeepSeek's EPLB, `placement.eplb_routes`: copies that balance
     expert load, not traffic; each master routes to its nearest copy). With a
     master per node every worker link is 18.3 GB/s: each worker has a master on
     its own node, and cross-node rows are held back by the two NICs they cross,
     which the model counts. Records: step time, its ratio to the one-master
     `improved`, cross-node bytes, experts hosted (copies included), solve time;
  4. time the paper's direct LP against the class-aggregated one at a larger scale;
  5. print the tables (seeds averaged) and save every raw number as JSON.

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

Section 3 covers Mixtral-like cases only. The H100-class clusters of the larger
cases have a NIC per GPU rather than one shared per node.

Run: python benchmarks/placement_suite.py   (about 2 minutes on 2 cores;
     --section shared-nic reruns step 3 alone and merges it into the saved JSON;
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/placement_suite.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import parser, run, write_results  # noqa: E402
from placement import (  # noqa: E402
    SOLVERS,
    PlacementProblem,
    cross_node_bytes,
    eplb_routes,
    node_shared_links,
    replicate,
    solve,
    solve_lp,
    step_time,
    synthetic_probs,
)
from placement.cost import experts_per_worker  # noqa: E402

SKEWS = {"flat": 8.0, "moderate": 2.0, "steep": 0.5}
CAPACITY_FACTORS = {"tight": 1.0, "loose": 1.5}
MIXTRAL_NEAR_GB_S, MIXTRAL_FAR_GB_S = 18.3, 1.17
RESULTS = Path(__file__).resolve().parent / "results" / "placement.json"


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, RESULTS, what="where to save the raw numbers (JSON)")
    p.add_argument("--seeds", type=int, default=3, help="profiles (seeds) per Mixtral-like case")
    p.add_argument("--time-budget", type=float, default=10.0, help="seconds the improved solver may use per case")
    p.add_argument("--skip-large", action="store_true", help="Mixtral-like cases only")
    p.add_argument("--replica-budget", type=float, default=10.0, help="seconds `replicate` may use per case")
    p.add_argument("--section", choices=("all", "paper-model", "shared-nic"), default="all",
                   help="run one section only and merge it into the saved JSON (--out)")
    p.add_argument("--direct-at-scale", action="store_true",
                   help="also time the direct LP at DeepSeek-V3 scale (58 x 256 on 64 workers; minutes)")
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
    return cluster_problem(probs, 2, nodes=3, per_node=2, near_gb_s=MIXTRAL_NEAR_GB_S, far_gb_s=MIXTRAL_FAR_GB_S,
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


# --- 3. shared NICs, a master per node, replicas ---------------------------------------


def with_shared_nics(problem: PlacementProblem, masters: list[str] | None = None) -> PlacementProblem:
    """`problem` with a far-bandwidth NIC per node; with `masters`, a master on each of those nodes instead
    of one on node 0, and every worker link near (section 3 of the module docstring)."""
    nodes = problem.worker_nodes
    if masters is None:
        return problem.model_copy(update={"shared_links": node_shared_links(nodes, problem.master_node,
                                                                            1e9 * MIXTRAL_FAR_GB_S)})
    return PlacementProblem(**{
        **dict(problem), "master_node": None, "master_nodes": masters,
        "bandwidths": [1e9 * MIXTRAL_NEAR_GB_S] * problem.num_workers,
        "shared_links": node_shared_links(nodes, masters, 1e9 * MIXTRAL_FAR_GB_S)})


def run_shared_nic_case(name: str, seed: int, problem: PlacementProblem, time_budget: float,
                        replica_budget: float) -> list[dict]:
    """One record per method under the shared-NIC model: one master (every solver), a master per node."""
    one = with_shared_nics(problem)
    plans = {f"1 master / {s}": _timed(lambda s=s: solve(one, s, seed=seed, time_budget_s=time_budget).as_array())
             for s in SOLVERS}
    masters = with_shared_nics(problem, sorted(set(problem.worker_nodes)))
    sequential = _timed(lambda: solve(masters, "sequential").as_array())
    improved, improved_s = _timed(lambda: solve(masters, "improved", seed=seed, time_budget_s=time_budget).as_array())
    replicas, replicas_s = _timed(lambda: replicate(masters, improved, seed=seed, time_budget_s=replica_budget))
    plans |= {"3 masters / sequential": sequential, "3 masters / improved": (improved, improved_s),
              "3 masters / improved + replicas": (replicas, improved_s + replicas_s),
              "3 masters / eplb": _timed(lambda: eplb_routes(masters))}
    reference = step_time(one, plans["1 master / improved"][0])
    records = []
    for method, (plan, seconds) in plans.items():
        where = one if method.startswith("1 master") else masters
        records.append({
            "case": name, "seed": seed, "capacity": problem.capacities[0], "method": method,
            "step_time_s": step_time(where, plan), "ratio_to_one_master_improved": step_time(where, plan) / reference,
            "cross_node_bytes": cross_node_bytes(where, plan)[0],
            "experts_hosted": int(experts_per_worker(where.num_workers, plan).sum()), "solve_s": seconds})
    return records


def _timed(make) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    plan = make()
    return plan, time.perf_counter() - start


# --- 4. direct vs aggregated LP -----------------------------------------------------


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


# --- 5. report ------------------------------------------------------------------------


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


def shared_nic_table(records: list[dict]) -> str:
    """One row per (case, method), seeds averaged; 'worst' is the largest ratio to the one-master improved."""
    header = ("case", "cap", "method", "step ms", "x improved (1 master)", "worst", "cross-node GB", "experts",
              "solve s")
    rows = []
    for case, method in dict.fromkeys((r["case"], r["method"]) for r in records):
        group = [r for r in records if r["case"] == case and r["method"] == method]
        mean = lambda field: float(np.mean([r[field] for r in group]))  # noqa: E731
        rows.append((case, str(group[0]["capacity"]), method, f"{1e3 * mean('step_time_s'):.1f}",
                     f"{mean('ratio_to_one_master_improved'):.3f}",
                     f"{max(r['ratio_to_one_master_improved'] for r in group):.3f}",
                     f"{mean('cross_node_bytes') / 1e9:.2f}", f"{mean('experts_hosted'):.0f}",
                     f"{mean('solve_s'):.2f}"))
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def replicas_summary(records: list[dict]) -> str:
    """Replicas against one copy and against EPLB, a master per node, per capacity (step time ratios)."""
    def times(method: str, capacity: str) -> np.ndarray:
        return np.array([r["step_time_s"] for r in records if r["method"] == method and r["case"].endswith(capacity)])
    parts = []
    for capacity in CAPACITY_FACTORS:
        replicas = times("3 masters / improved + replicas", capacity)
        if len(replicas):
            one_copy = replicas / times("3 masters / improved", capacity)
            eplb = replicas / times("3 masters / eplb", capacity)
            parts.append(f"{capacity}: x{np.mean(one_copy):.3f} of one copy, x{np.mean(eplb):.3f} of EPLB "
                         f"(worst x{max(eplb):.3f})")
    return "a master per node, improved + replicas: " + "; ".join(parts)


def paper_model_section(cases: list, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(records, LP timings) of sections 2 and 4: every solver under the paper's model."""
    records = []
    for index, (name, seed, problem) in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {name} seed {seed}", file=sys.stderr, flush=True)
        records += run_case(name, seed, problem, args.time_budget)
    print("timing the direct and the aggregated LP ...", file=sys.stderr, flush=True)
    scaling = [lp_scaling("qwen3 moderate tight", qwen3_like("tight"))]
    if args.direct_at_scale:
        scaling.append(lp_scaling("deepseek-v3 moderate tight", deepseek_v3_like("tight")))
    return records, scaling


def shared_nic_section(cases: list, args: argparse.Namespace) -> list[dict]:
    """Records of section 3 over the Mixtral-like cases."""
    mixtral = [case for case in cases if case[0].startswith("mixtral")]
    records = []
    for index, (name, seed, problem) in enumerate(mixtral, 1):
        print(f"[shared NIC {index}/{len(mixtral)}] {name} seed {seed}", file=sys.stderr, flush=True)
        records += run_shared_nic_case(name, seed, problem, args.time_budget, args.replica_budget)
    return records


def main() -> int:
    args = parse_args()
    results = json.loads(args.out.read_text()) if args.section != "all" and args.out.is_file() else {}
    cases = suite(args.seeds, args.skip_large)
    if args.section in ("all", "paper-model"):
        results["records"], results["lp_scaling"] = paper_model_section(cases, args)
    if args.section in ("all", "shared-nic"):
        results["shared_nic_records"] = shared_nic_section(cases, args)

    if "records" in results:
        print(table(results["records"]))
        print()
        print(improved_summary(results["records"]))
    for s in results.get("lp_scaling", []):
        print(f"LP at {s['case']}: direct {s['direct_s']:.2f} s, aggregated {s['aggregated_s']:.2f} s "
              f"({s['speedup']:.0f}x faster), bounds differ by {s['bound_rel_diff']:.1e} (relative)")
    if "shared_nic_records" in results:
        print("\nShared NICs (1.17 GB/s per node): one master on node 0, and a master per node with replicas\n")
        print(shared_nic_table(results["shared_nic_records"]))
        print()
        print(replicas_summary(results["shared_nic_records"]))
    write_results(args.out, results)
    print(f"raw numbers: {args.out}")
    return 0


if __name__ == "__main__":
    run(main)
