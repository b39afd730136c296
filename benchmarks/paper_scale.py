"""Paper-scale simulation: the cost model at Mixtral-8x7B scale on the VELA paper's cluster.

Reads top to bottom:
  1. the problem: 32 MoE blocks x 8 experts, top-2, H = 4096, 16-bit rows,
     K = 8 x 512 tokens per step; 6 workers = 3 nodes x 2 GPUs, master on node 0,
     18.3 GB/s inside a node and 1.17 GB/s across (the paper's measurements);
     capacity per worker "tight" = 43 (ceil(256 / 6)) or "loose" = 64 (1.5x: a 32 GB
     V100 holds ~80 fp16 Mixtral experts of 352 MB, less activations and LoRA state);
  2. profiles measured on our data sets with the tiny pre-trained Mixtral
     (benchmarks/results/locality/P_*.npy, 4 layers x 8 experts). Mapping to 32
     layers: Mixtral layer l takes tiny layer floor(l * 4 / 32) (blocks of 8), with
     its expert ids permuted by a seeded random permutation per layer, since expert
     ids carry no meaning across layers (without it every block of 8 layers would
     share one hot expert id and sequential placement would be unrealistically bad
     or good);
  3. per placement (sequential, random, vela, improved, all solved under the
     paper's model): expected cross-node bytes per node per step and expected
     communication time, both under the paper's model (eq. 7: independent
     master-worker links, a layer waits for its slowest worker) and under a
     shared-NIC model (`placement.node_shared_links`: each node has one 1.17 GB/s
     NIC, so the master's NIC carries all cross-node rows of a layer; the cost
     model waits for it as for a worker). One more row, "improved (NIC-aware)",
     is the improved solver run on the problem with those NICs;
  4. expert parallelism for comparison: each rank holds K/6 tokens, row (token,
     expert) crosses nodes when the expert's owner (e mod 6) is on another node
     than the token's rank; plus the ring all-reduce of the backbone LoRA
     gradients (r = 8 on q, k, v, o of 32 layers, fp32: 27 MB). Its NIC time counts
     the bytes through a NIC in both directions, as the placement cost model counts
     a link's (an earlier version counted only the bytes leaving a NIC for EP, which
     halved EP's time against vela-ray's).

Bytes count forward and backward (dispatch, gather, grad dispatch, grad gather),
as `placement.cost` does with `include_backward` (twice the paper's eq. 5-6).

Run: python benchmarks/paper_scale.py   (seconds; also called by benchmarks/vela_vs_ep.py)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: its placement.py would shadow the package

from placement import PlacementProblem, cost_report, node_shared_links, solve, step_time  # noqa: E402

PROFILES = ROOT / "benchmarks" / "results" / "locality"
DATASETS = {"wikitext": "P_wikitext2.npy", "gsm8k_alpaca": "P_gsm8k.npy", "alpaca": "P_alpaca.npy"}
LAYERS, EXPERTS, TOP_K, HIDDEN, BITS, TOKENS = 32, 8, 2, 4096, 16, 8 * 512
NODES = ["node0", "node0", "node1", "node1", "node2", "node2"]
INTRA, CROSS = 18.3e9, 1.17e9
CAPACITIES = {"tight": math.ceil(LAYERS * EXPERTS / len(NODES)), "loose": math.ceil(1.5 * LAYERS * EXPERTS / len(NODES))}
# backbone LoRA (r=8) on q [4096->4096], k, v [4096->1024], o [4096->4096] of 32 layers, fp32 gradients
BACKBONE_LORA_BYTES = 32 * 8 * ((4096 + 4096) * 2 + (4096 + 1024) * 2) * 4
SOLVERS = ("sequential", "random", "vela", "improved")
NIC_AWARE = "improved (NIC-aware)"
RESULTS = ROOT / "benchmarks" / "results" / "vela_vs_ep" / "paper_scale.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="seed of the expert-id permutations and the solvers")
    p.add_argument("--out", type=Path, default=RESULTS, help="where to save the numbers (JSON)")
    return p.parse_args()


def mixtral_probs(tiny_probs: np.ndarray, seed: int = 0) -> np.ndarray:
    """[32, 8]: tiny layer floor(l * L_tiny / 32) for Mixtral layer l, expert ids permuted per layer."""
    rng = np.random.default_rng(seed)
    rows = [tiny_probs[l * tiny_probs.shape[0] // LAYERS] for l in range(LAYERS)]
    return np.stack([row[rng.permutation(EXPERTS)] for row in rows])


def problem_for(probs: np.ndarray, capacity: int, *, shared_nic: bool = False) -> PlacementProblem:
    """The paper's cluster; with `shared_nic`, one CROSS-bandwidth NIC per node that cross-node rows share."""
    bandwidths = [INTRA if node == NODES[0] else CROSS for node in NODES]
    links = node_shared_links(NODES, NODES[0], CROSS) if shared_nic else []
    return PlacementProblem(probs=probs, top_k=TOP_K, tokens_per_step=TOKENS, hidden_size=HIDDEN,
                            bits_per_element=BITS, bandwidths=bandwidths, capacities=[capacity] * len(NODES),
                            worker_nodes=NODES, master_node=NODES[0], shared_links=links)


def ep_traffic(problem: PlacementProblem) -> dict:
    """Expected cross-node bytes per step and shared-NIC comm seconds of expert parallelism.

    A NIC's seconds count the bytes through it in both directions against its bandwidth, as
    `placement.cost` counts a link's (rows out and outputs back, each pass): a row between two
    nodes loads both nodes' NICs with all of its bytes.
    """
    ranks, nodes = len(NODES), sorted(set(NODES))
    owner_node = [NODES[e % ranks] for e in range(EXPERTS)]
    tokens_per_node = {n: TOKENS * NODES.count(n) / ranks for n in nodes}
    bytes_per_row = problem.bytes_per_row
    total, nic_time = 0.0, 0.0
    for layer in range(LAYERS):
        through = {n: 0.0 for n in nodes}  # bytes through each node's NIC in this layer, both directions
        for src in nodes:
            for e in range(EXPERTS):
                if owner_node[e] != src:
                    moved = tokens_per_node[src] * problem.probs[layer, e] * bytes_per_row
                    total += moved
                    through[src] += moved
                    through[owner_node[e]] += moved
        nic_time += max(through.values()) / CROSS
    crossings = sum(NODES[r] != NODES[(r + 1) % ranks] for r in range(ranks))
    allreduce = crossings * 2 * (ranks - 1) / ranks * BACKBONE_LORA_BYTES  # cross-node ring bytes, one way
    return {"token_cross_bytes": total, "allreduce_cross_bytes": allreduce,
            "cross_bytes_per_node": (total + allreduce) / len(nodes),
            "nic_comm_s": nic_time + 2 * allreduce / len(nodes) / CROSS}  # each NIC sends and receives its share


def simulate(seed: int = 0) -> dict:
    """{"<data set> / <capacity>": {method: numbers}} for every measured profile and capacity."""
    results = {}
    for name, filename in DATASETS.items():
        path = PROFILES / filename
        if not path.is_file():
            continue
        for cap_name, capacity in CAPACITIES.items():
            probs = mixtral_probs(np.load(path), seed)
            problems = (problem_for(probs, capacity), problem_for(probs, capacity, shared_nic=True))
            results[f"{name} / C={capacity} ({cap_name})"] = _rows(*problems, seed)
    return results


def _rows(paper: PlacementProblem, shared_nic: PlacementProblem, seed: int) -> dict:
    """{method: cross-node bytes per node and comm seconds under both models} for one cluster.

    Every solver places for the paper's model, "improved (NIC-aware)" for the shared-NIC one.
    """
    plans = {solver: solve(paper, solver, seed=seed) for solver in SOLVERS}
    plans[NIC_AWARE] = solve(shared_nic, "improved", seed=seed)
    rows = {}
    for method, plan in plans.items():
        table = plan.as_array()
        report = cost_report(paper, table)
        rows[method] = {"cross_bytes_per_node": report.cross_node_bytes / len(set(NODES)),
                        "paper_model_comm_s": report.step_time, "nic_model_comm_s": step_time(shared_nic, table),
                        "experts_on_master_node": int(np.isin(table, [0, 1]).sum())}
    rows["ep"] = ep_traffic(paper)
    return rows


def markdown(results: dict) -> str:
    lines = ["| data set / capacity | method | cross-node MB/node/step | vs EP | comm s (paper model) | comm s (shared NIC) |",
             "|---|---|---:|---:|---:|---:|"]
    for name, rows in results.items():
        ep = rows["ep"]["cross_bytes_per_node"]
        for method in ("ep", *SOLVERS, NIC_AWARE):
            r = rows[method]
            paper = f"{r['paper_model_comm_s']:.3f}" if "paper_model_comm_s" in r else "n/a"
            nic = r.get("nic_model_comm_s", r.get("nic_comm_s"))
            lines.append(f"| {name} | {method} | {r['cross_bytes_per_node'] / 1e6:.0f} | "
                         f"{r['cross_bytes_per_node'] / ep - 1:+.1%} | {paper} | {nic:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = parse_args()
    sim = simulate(args.seed)
    print(markdown(sim))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(sim, indent=1))
