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
  3. per placement (sequential, random, vela, improved): expected cross-node bytes
     per node per step and expected communication time, both under the paper's
     model (eq. 7: independent master-worker links, a layer waits for its slowest
     worker) and under a shared-NIC model (each node has one 1.17 GB/s NIC per
     direction, so the master's NIC carries all cross-node rows of a layer);
  4. expert parallelism for comparison: each rank holds K/6 tokens, row (token,
     expert) crosses nodes when the expert's owner (e mod 6) is on another node
     than the token's rank; plus the ring all-reduce of the backbone LoRA
     gradients (r = 8 on q, k, v, o of 32 layers, fp32: 27 MB).

Bytes count forward and backward (dispatch, gather, grad dispatch, grad gather),
as `placement.cost` does with `include_backward` (twice the paper's eq. 5-6).

Run: python benchmarks/paper_scale.py   (seconds; also called by benchmarks/vela_vs_ep.py)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: its placement.py would shadow the package

from placement import PlacementProblem, cost_report, solve  # noqa: E402

PROFILES = ROOT / "benchmarks" / "results" / "locality"
DATASETS = {"wikitext": "P_wikitext2.npy", "gsm8k_alpaca": "P_gsm8k.npy", "alpaca": "P_alpaca.npy"}
LAYERS, EXPERTS, TOP_K, HIDDEN, BITS, TOKENS = 32, 8, 2, 4096, 16, 8 * 512
NODES = ["node0", "node0", "node1", "node1", "node2", "node2"]
INTRA, CROSS = 18.3e9, 1.17e9
CAPACITIES = {"tight": math.ceil(LAYERS * EXPERTS / len(NODES)), "loose": math.ceil(1.5 * LAYERS * EXPERTS / len(NODES))}
# backbone LoRA (r=8) on q [4096->4096], k, v [4096->1024], o [4096->4096] of 32 layers, fp32 gradients
BACKBONE_LORA_BYTES = 32 * 8 * ((4096 + 4096) * 2 + (4096 + 1024) * 2) * 4
SOLVERS = ("sequential", "random", "vela", "improved")


def mixtral_probs(tiny_probs: np.ndarray, seed: int = 0) -> np.ndarray:
    """[32, 8]: tiny layer floor(l * L_tiny / 32) for Mixtral layer l, expert ids permuted per layer."""
    rng = np.random.default_rng(seed)
    rows = [tiny_probs[l * tiny_probs.shape[0] // LAYERS] for l in range(LAYERS)]
    return np.stack([row[rng.permutation(EXPERTS)] for row in rows])


def problem_for(probs: np.ndarray, capacity: int) -> PlacementProblem:
    bandwidths = [INTRA if node == NODES[0] else CROSS for node in NODES]
    return PlacementProblem(probs=probs, top_k=TOP_K, tokens_per_step=TOKENS, hidden_size=HIDDEN,
                            bits_per_element=BITS, bandwidths=bandwidths, capacities=[capacity] * len(NODES),
                            worker_nodes=NODES, master_node=NODES[0])


def nic_time_vela(problem: PlacementProblem, expert_to_worker: np.ndarray) -> float:
    """Shared-NIC comm seconds per step: per layer, max(master NIC's cross rows, each intra link's rows)."""
    mass_NL = np.zeros((len(NODES), LAYERS))
    np.add.at(mass_NL, (expert_to_worker, np.arange(LAYERS)[:, None].repeat(EXPERTS, 1)), problem.probs)
    seconds_per_mass = problem.bytes_per_row * TOKENS
    cross = np.array([node != NODES[0] for node in NODES])
    nic = mass_NL[cross].sum(axis=0) * seconds_per_mass / CROSS
    intra = (mass_NL[~cross] * seconds_per_mass / INTRA).max(axis=0)
    return float(np.maximum(nic, intra).sum())


def ep_traffic(problem: PlacementProblem) -> dict:
    """Expected cross-node bytes per step and shared-NIC comm seconds of expert parallelism."""
    ranks, nodes = len(NODES), sorted(set(NODES))
    owner_node = [NODES[e % ranks] for e in range(EXPERTS)]
    tokens_per_node = {n: TOKENS * NODES.count(n) / ranks for n in nodes}
    bytes_per_row = problem.bytes_per_row
    total, nic_time = 0.0, 0.0
    for layer in range(LAYERS):
        out = {n: 0.0 for n in nodes}  # bytes leaving each node's NIC in this layer (both phases summed)
        for src in nodes:
            for e in range(EXPERTS):
                if owner_node[e] != src:
                    moved = tokens_per_node[src] * problem.probs[layer, e] * bytes_per_row
                    total += moved
                    out[src] += moved / 2  # rows (and grads of outputs) leave the source
                    out[owner_node[e]] += moved / 2  # outputs (and grads of rows) leave the owner
        nic_time += max(out.values()) / CROSS
    crossings = sum(NODES[r] != NODES[(r + 1) % ranks] for r in range(ranks))
    allreduce = crossings * 2 * (ranks - 1) / ranks * BACKBONE_LORA_BYTES
    return {"token_cross_bytes": total, "allreduce_cross_bytes": allreduce,
            "cross_bytes_per_node": (total + allreduce) / len(nodes),
            "nic_comm_s": nic_time + allreduce / len(nodes) / CROSS}


def simulate(seed: int = 0) -> dict:
    """{"<data set> / <capacity>": {method: numbers}} for every measured profile and capacity."""
    results = {}
    for name, filename in DATASETS.items():
        path = PROFILES / filename
        if not path.is_file():
            continue
        for cap_name, capacity in CAPACITIES.items():
            problem = problem_for(mixtral_probs(np.load(path), seed), capacity)
            results[f"{name} / C={capacity} ({cap_name})"] = _rows(problem, seed)
    return results


def _rows(problem: PlacementProblem, seed: int) -> dict:
    """{method: cross-node bytes per node and comm seconds under both models} for one problem."""
    rows = {}
    for solver in SOLVERS:
        plan = solve(problem, solver, seed=seed)
        table = np.asarray(plan.expert_to_worker)
        report = cost_report(problem, table)
        rows[solver] = {"cross_bytes_per_node": report.cross_node_bytes / len(set(NODES)),
                        "paper_model_comm_s": report.step_time, "nic_model_comm_s": nic_time_vela(problem, table),
                        "experts_on_master_node": int(np.isin(table, [0, 1]).sum())}
    rows["ep"] = ep_traffic(problem)
    return rows


def markdown(results: dict) -> str:
    lines = ["| data set / capacity | method | cross-node MB/node/step | vs EP | comm s (paper model) | comm s (shared NIC) |",
             "|---|---|---:|---:|---:|---:|"]
    for name, rows in results.items():
        ep = rows["ep"]["cross_bytes_per_node"]
        for method in ("ep", *SOLVERS):
            r = rows[method]
            paper = f"{r['paper_model_comm_s']:.3f}" if "paper_model_comm_s" in r else "n/a"
            nic = r.get("nic_model_comm_s", r.get("nic_comm_s"))
            lines.append(f"| {name} | {method} | {r['cross_bytes_per_node'] / 1e6:.0f} | "
                         f"{r['cross_bytes_per_node'] / ep - 1:+.1%} | {paper} | {nic:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sim = simulate()
    print(markdown(sim))
    out = ROOT / "benchmarks" / "results" / "vela_vs_ep"
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_scale.json").write_text(json.dumps(sim, indent=1))
