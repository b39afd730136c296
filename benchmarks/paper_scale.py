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
  4. a master per node (3 data-parallel masters, `master_nodes` node0-2, each with
     K/3 tokens; NICs from `node_shared_links(NODES, MASTERS, CROSS)`): "master per
     node" is the improved solver's one-copy table, "master per node + replicas"
     adds copies in spare capacity (`placement.replicate`), and "EPLB replicas" is
     DeepSeek's EPLB (`placement.eplb_routes`: copies balanced by expert load, each
     master using its nearest copy). With one copy per expert, 2/3 of all rows
     cross nodes whatever the table: only copies help, and the tight capacity
     (258 slots for 256 experts) leaves room for 2. Each master's link to a worker
     is INTRA on its own node and CROSS to the others (`master_bandwidths`), so a
     node-local copy's rows go at INTRA; under the shared-NIC model a cross-node
     pair is also held back by the two NICs it crosses. These rows also pay
     the ring all-reduce of the masters' backbone LoRA gradients, counted as EP's
     (below), in bytes and in both time columns;
  5. expert parallelism for comparison: each rank holds K/6 tokens, row (token,
     expert) crosses nodes when the expert's owner (e mod 6) is on another node
     than the token's rank; plus the ring all-reduce of the backbone LoRA
     gradients (r = 8 on q, k, v, o of 32 layers, fp32: 27 MB). Its NIC time (`ep_exchange`):
     every all-to-all is a barrier that lasts its busiest NIC's busier direction (a NIC
     sends and receives at once, full duplex, as the placement cost model counts a shared
     link, `placement.problem.SharedLink`; a node that hosts hot experts receives more than
     it sends). The same model predicts the emulated cluster's EP step in vela_vs_ep.py.

Bytes count forward and backward (dispatch, gather, grad dispatch, grad gather),
as `placement.cost` does with `include_backward` (twice the paper's eq. 5-6).

The table's last column is each row's shared-NIC seconds over EP's.

Run: python benchmarks/paper_scale.py   (under a minute on 2 cores, mostly `replicate`, at
     most 10 s per case; also called by benchmarks/vela_vs_ep.py)

Real routing instead of 2.'s tiling (issue 38, item 2), `--routing`:
  * `untiled`: the tiny model's own per-layer statistics, no permutation: Mixtral layer l
    takes tiny layer floor(l * 4 / 32) with its expert ids as measured (each measured layer
    stands for 8 consecutive blocks, and its hot expert keeps its id);
  * `real32`: a 32-layer, 8-expert, top-2 Mixtral of the tiny model's debug width
    (`TinyModelConfig(num_layers=32)`), pre-trained the way the tiny model is (same corpus,
    tokenizer, recipe; `--pretrain-steps`, default the tiny model's 500), then profiled on
    WikiText-2 and the Alpaca-format data (seed tasks + GSM8K, as vela_vs_ep.py --paper;
    `--profile-batches` batches of 16 x 128 tokens each). Its [32, 8] profiles are used as
    they are: every Mixtral layer's routing is a real layer's. Profiles are saved beside the
    results (P_<data set>_32L.npy).
  Results: benchmarks/results/paper_scale_real/<routing>.json and .md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/paper_scale.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import WIKITEXT, alpaca_mix, parser, run, write_results  # noqa: E402
from placement import (  # noqa: E402
    PlacementProblem,
    cost_report,
    cross_node_bytes,
    eplb_routes,
    node_shared_links,
    replicate,
    sequential_table,
    solve,
    step_time,
)
from placement.cost import experts_per_worker  # noqa: E402

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
MASTERS = ["node0", "node1", "node2"]
PER_NODE, REPLICAS, EPLB = "master per node", "master per node + replicas", "EPLB replicas"
RESULTS = ROOT / "benchmarks" / "results" / "vela_vs_ep" / "paper_scale.json"
REAL_RESULTS = ROOT / "benchmarks" / "results" / "paper_scale_real"
LEGEND = ("ep: expert parallelism, 6 ranks. sequential to improved: one master on node0, placed for the paper's model; "
          "improved (NIC-aware): placed for the shared-NIC model. master per node: 3 data-parallel masters (node0-2), "
          "one copy per expert; + replicas: copies in spare capacity (`placement.replicate`); EPLB replicas: "
          "DeepSeek's EPLB copies, each master using its nearest. The master-per-node rows include the masters' "
          "backbone all-reduce; each master's links are 18.3 GB/s to its own node's workers, 1.17 GB/s to the "
          "others. Last column: shared-NIC seconds over EP's.")


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, RESULTS, what="where to save the numbers (JSON)")
    p.add_argument("--seed", type=int, default=0, help="seed of the expert-id permutations and the solvers")
    p.add_argument("--routing", choices=["tiled", "untiled", "real32"], default="tiled",
                   help="tiled: tiny profiles tiled to 32 layers with random expert-id permutations (the "
                        "default, as before); untiled: the tiny profiles without permutation; real32: profiles "
                        "of a 32-layer tiny-width Mixtral pre-trained and profiled here")
    p.add_argument("--pretrain-steps", type=int, default=500, help="real32: pre-training steps (tiny model: 500)")
    p.add_argument("--profile-batches", type=int, default=32, help="real32: batches of 16 rows profiled per data set")
    p.add_argument("--threads", type=int, default=None, help="real32: torch threads (default: all cores)")
    args = p.parse_args()
    if args.routing != "tiled" and args.out == RESULTS:
        args.out = REAL_RESULTS / f"{args.routing}.json"
    return args


def mixtral_probs(tiny_probs: np.ndarray, seed: int = 0, permute: bool = True) -> np.ndarray:
    """[32, 8]: tiny layer floor(l * L_tiny / 32) for Mixtral layer l, expert ids permuted per layer
    (`permute`; without, as measured). A profile that already has 32 layers is returned as it is."""
    if tiny_probs.shape[0] == LAYERS:
        return np.asarray(tiny_probs, dtype=float)
    rng = np.random.default_rng(seed)
    rows = [tiny_probs[l * tiny_probs.shape[0] // LAYERS] for l in range(LAYERS)]
    return np.stack([row[rng.permutation(EXPERTS)] if permute else row for row in rows])


def real32_profiles(out: Path, pretrain_steps: int = 500, profile_batches: int = 32,
                    threads: int | None = None) -> dict[str, Path]:
    """Pre-train (cached) a 32-layer tiny-width Mixtral and profile WikiText-2 and the Alpaca-format mix
    with it; {data set: saved [32, 8] profile}. Module docstring, `real32`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vela_ray.data.config import DataConfig
    from vela_ray.data.datasets import build_dataset, sequential_batches
    from vela_ray.data.locality import profile_model
    from vela_ray.model.modeling import find_moe_blocks
    from vela_ray.training.tiny_model import TinyModelConfig, cpu_threads, tiny_model_path

    config = TinyModelConfig(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, steps=pretrain_steps)
    model_dir = tiny_model_path(config, num_threads=threads)
    torch.set_num_threads(threads or cpu_threads())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = find_moe_blocks(model)
    data = {"wikitext": DataConfig(kind="text", path=WIKITEXT, seq_len=128),
            "alpaca": DataConfig(kind="instruct", path=alpaca_mix(), seq_len=128, limit=1500)}
    out.mkdir(parents=True, exist_ok=True)
    saved = {}
    for name, data_config in data.items():
        dataset = build_dataset(data_config, tokenizer)
        profile = profile_model(model, sequential_batches(dataset, 16, max_batches=profile_batches), blocks=blocks,
                                source=f"{name}, 32-layer tiny Mixtral ({config.digest()})")
        saved[name] = out / f"P_{name}_32L.npy"
        profile.save(out / f"profile_{name}_32L.json", saved[name])
    return saved


def problem_for(probs: np.ndarray, capacity: int, *, shared_nic: bool = False) -> PlacementProblem:
    """The paper's cluster; with `shared_nic`, one CROSS-bandwidth NIC per node that cross-node rows share."""
    bandwidths = [INTRA if node == NODES[0] else CROSS for node in NODES]
    links = node_shared_links(NODES, NODES[0], CROSS) if shared_nic else []
    return PlacementProblem(probs=probs, top_k=TOP_K, tokens_per_step=TOKENS, hidden_size=HIDDEN,
                            bits_per_element=BITS, bandwidths=bandwidths, capacities=[capacity] * len(NODES),
                            worker_nodes=NODES, master_node=NODES[0], shared_links=links)


def masters_problem_for(probs: np.ndarray, capacity: int, *, shared_nic: bool = False) -> PlacementProblem:
    """A master on every node; with `shared_nic`, one CROSS-bandwidth NIC per node (module docstring, 4.)."""
    links = node_shared_links(NODES, MASTERS, CROSS) if shared_nic else []
    per_master = [[INTRA if at == node else CROSS for node in NODES] for at in MASTERS]
    return PlacementProblem(probs=probs, top_k=TOP_K, tokens_per_step=TOKENS, hidden_size=HIDDEN,
                            bits_per_element=BITS, bandwidths=[CROSS] * len(NODES), master_bandwidths=per_master,
                            capacities=[capacity] * len(NODES), worker_nodes=NODES, master_nodes=MASTERS,
                            shared_links=links)


def ring_allreduce(rank_nodes: list[str], grad_bytes: float = BACKBONE_LORA_BYTES,
                   nic_bytes_per_s: float = CROSS) -> tuple[float, float]:
    """(cross-node bytes, shared-NIC seconds) of one ring all-reduce of `grad_bytes` (default: the backbone LoRA
    gradients at paper scale).

    rank_nodes: the node of each rank, in ring order. Bytes are those sent across nodes (each
    rank sends 2 (R-1)/R of the gradients to the next); each NIC sends its share while it receives as much
    (full duplex, as `placement.cost` counts a shared link).
    """
    ranks = len(rank_nodes)
    if ranks < 2:
        return 0.0, 0.0
    crossings = sum(rank_nodes[r] != rank_nodes[(r + 1) % ranks] for r in range(ranks))
    cross = crossings * 2 * (ranks - 1) / ranks * grad_bytes
    return cross, cross / len(set(rank_nodes)) / nic_bytes_per_s


def ep_exchange(probs: np.ndarray, table: np.ndarray, rank_nodes: list[str], rank_tokens: list[float],
                bytes_per_row: float) -> dict:
    """Expert parallelism's all-to-alls over a step, expected from routing probabilities.

    probs: [L, E] routing probability of each expert (top-k mass per token); table: [L, E] the rank that owns
    each expert; rank_tokens: the tokens each rank holds; bytes_per_row: a (token, expert) row's bytes over
    its four transfers (`PlacementProblem.bytes_per_row`: rows out and outputs back, forward and backward).

    Each transfer is an all-to-all every rank waits for. In it, a NIC sends the rows its node's ranks send to
    other nodes while it receives the rows sent to its node's ranks, both directions at once (full duplex, as
    `placement.cost` counts a shared link), so the transfer lasts the busiest NIC's busier direction; the
    transfers back (outputs, gradients) are the same rows the other way. A node's ranks exchange with each other
    over its loopback, one interface for both directions.

    Returns "cross_bytes" (every row between nodes, all four transfers), "nic_bytes" (summed over layers: the
    busiest NIC's busier direction, all four transfers) and "loopback_bytes" (summed over layers: the busiest
    node's same-node rows between different ranks): divided by a NIC's and a loopback's bandwidth, the seconds
    the all-to-alls take.
    """
    nodes = sorted(set(rank_nodes))
    cross, nic, loopback = 0.0, 0.0, 0.0
    for layer in range(probs.shape[0]):
        out, into, loop = ({n: 0.0 for n in nodes} for _ in range(3))
        for src, tokens in enumerate(rank_tokens):
            for expert, owner in enumerate(table[layer]):
                rows = tokens * probs[layer, expert]
                a, b = rank_nodes[src], rank_nodes[owner]
                if a != b:
                    out[a] += rows
                    into[b] += rows
                elif owner != src:
                    loop[a] += rows
        cross += sum(out.values()) * bytes_per_row
        nic += max(max(out[n], into[n]) for n in nodes) * bytes_per_row
        loopback += max(loop.values()) * bytes_per_row
    return {"cross_bytes": cross, "nic_bytes": nic, "loopback_bytes": loopback}


def ep_traffic(problem: PlacementProblem) -> dict:
    """Expected cross-node bytes per step and shared-NIC comm seconds of expert parallelism (`ep_exchange`: each
    all-to-all lasts its busiest NIC's busier direction), plus the ring all-reduce of the backbone gradients."""
    ranks = len(NODES)
    exchange = ep_exchange(problem.probs, sequential_table(LAYERS, EXPERTS, ranks), NODES, [TOKENS / ranks] * ranks,
                           problem.bytes_per_row)
    allreduce, allreduce_s = ring_allreduce(NODES)
    return {"token_cross_bytes": exchange["cross_bytes"], "allreduce_cross_bytes": allreduce,
            "cross_bytes_per_node": (exchange["cross_bytes"] + allreduce) / len(set(NODES)),
            "nic_comm_s": exchange["nic_bytes"] / CROSS + allreduce_s}


def simulate(seed: int = 0, profiles: dict[str, Path] | None = None, permute: bool = True) -> dict:
    """{"<data set> / <capacity>": {method: numbers}} for every measured profile and capacity.

    `profiles`: {data set: .npy} (default: the tiny model's, DATASETS under PROFILES); a 32-layer
    profile is used as it is, a shorter one tiled (`mixtral_probs`, `permute`)."""
    results = {}
    for name, path in (profiles or {n: PROFILES / f for n, f in DATASETS.items()}).items():
        if not path.is_file():
            continue
        for cap_name, capacity in CAPACITIES.items():
            probs = mixtral_probs(np.load(path), seed, permute=permute)
            problems = (problem_for(probs, capacity), problem_for(probs, capacity, shared_nic=True))
            masters = (masters_problem_for(probs, capacity), masters_problem_for(probs, capacity, shared_nic=True))
            results[f"{name} / C={capacity} ({cap_name})"] = {**_rows(*problems, seed), **_master_rows(*masters, seed)}
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


def _master_rows(paper: PlacementProblem, shared_nic: PlacementProblem, seed: int) -> dict:
    """{method: numbers} for a master per node (module docstring, 4.), placed for the shared-NIC model."""
    table = solve(shared_nic, "improved", seed=seed).as_array()
    plans = {PER_NODE: table, REPLICAS: replicate(shared_nic, table, seed=seed), EPLB: eplb_routes(shared_nic)}
    allreduce, allreduce_s = ring_allreduce(MASTERS)
    rows = {}
    for method, plan in plans.items():
        rows[method] = {"cross_bytes_per_node": (cross_node_bytes(shared_nic, plan)[0] + allreduce) / len(set(NODES)),
                        "paper_model_comm_s": step_time(paper, plan) + allreduce_s,
                        "nic_model_comm_s": step_time(shared_nic, plan) + allreduce_s,
                        "allreduce_cross_bytes": allreduce,
                        "experts_hosted": int(experts_per_worker(len(NODES), plan).sum())}
    return rows


def markdown(results: dict) -> str:
    lines = ["| data set / capacity | method | cross-node MB/node/step | vs EP | comm s (paper model) | "
             "comm s (shared NIC) | / EP (shared NIC) |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        ep, ep_nic = rows["ep"]["cross_bytes_per_node"], rows["ep"]["nic_comm_s"]
        for method in ("ep", *SOLVERS, NIC_AWARE, PER_NODE, REPLICAS, EPLB):
            if method not in rows:  # results saved before the master-per-node rows
                continue
            r = rows[method]
            paper = f"{r['paper_model_comm_s']:.3f}" if "paper_model_comm_s" in r else "n/a"
            nic = r.get("nic_model_comm_s", r.get("nic_comm_s"))
            lines.append(f"| {name} | {method} | {r['cross_bytes_per_node'] / 1e6:.0f} | "
                         f"{r['cross_bytes_per_node'] / ep - 1:+.1%} | {paper} | {nic:.3f} | {nic / ep_nic:.2f} |")
    return "\n".join([*lines, "", LEGEND])


ROUTING_NOTE = {
    "tiled": "Routing: the tiny model's 4-layer profiles tiled to 32 layers with seeded random expert-id "
             "permutations (synthetic).",
    "untiled": "Routing: the tiny model's own per-layer statistics (4 layers, measured), each standing for 8 "
               "consecutive Mixtral blocks with expert ids as measured (no permutation).",
    "real32": "Routing: real, every one of the 32 layers: a 32-layer, 8-expert, top-2 Mixtral of the tiny "
              "model's debug width pre-trained the tiny model's way, profiled on each data set.",
}


def main() -> None:
    args = parse_args()
    profiles, info = None, {"routing": args.routing}
    if args.routing == "real32":
        profiles = real32_profiles(args.out.parent, args.pretrain_steps, args.profile_batches, args.threads)
        info.update(pretrain_steps=args.pretrain_steps, profile_batches=args.profile_batches,
                    profiles={n: str(p) for n, p in profiles.items()})
    elif args.routing == "untiled":
        profiles = {n: PROFILES / DATASETS[n] for n in ("wikitext", "alpaca", "gsm8k_alpaca")}
    sim = simulate(args.seed, profiles, permute=args.routing == "tiled")
    text = "\n\n".join([ROUTING_NOTE[args.routing], markdown(sim)])
    print(text)
    if args.routing == "tiled":
        write_results(args.out, sim)
    else:
        write_results(args.out, {"info": info, "results": sim}, markdown=text)


if __name__ == "__main__":
    run(main)
