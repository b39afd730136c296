"""LUFFY's sequence migration on real routing, at Mixtral-8x7B scale on the paper's 3 x 2 cluster.

Reads top to bottom:
  1. record per-sequence routing: the cached tiny pre-trained Mixtral (4 layers x 8 experts,
     top-2) reads `--sequences` sequences of 512 tokens from each data set of
     benchmarks/paper_scale.py (WikiText-2, GSM8K, the Alpaca seed tasks). The model was trained
     on 128-token rows (it has 256 positions), so it never reads 512 at once. Text: 4 consecutive
     128-token windows of the token stream. Instructions: consecutive examples (each cut at
     256 tokens) laid end to end, the last one cut to fill 512; the rest of it is dropped, and
     the next sequence starts with the next example. That is packing with attention within each
     example. A `RoutingRecorder` counts each forward's top-k choices (one forward per window or
     example, from position 0, so a cut example routes exactly as its prefix would);
  2. scale each sequence to Mixtral as paper_scale maps profiles (its `mixtral_probs`):
     Mixtral layer l takes tiny layer floor(l * 4 / 32), expert ids permuted per layer with the
     same seed. Each sequence keeps its own routing, which is what migration uses;
  3. paper_scale's cluster with a master per node (`masters_problem_for`, shared NICs of
     1.17 GB/s) for capacities 43 and 64, on paper_scale's profile of the data set (its placement):
     "one copy" is `solve(problem, "improved")`, "replicas" is `placement.replicate` of it;
  4. shuffle the sequences (seeded) into steps of 8 (TOKENS = 8 x 512). Each step's sequences
     start on the masters in contiguous shares (3, 3, 2, as `shard_rows` splits rows), then
     `placement.simulate_sequences` runs without migration and with LUFFY's (q = 1, 2). The
     capacity is ceil(4096 / 3) + 512 tokens, so at most 3 sequences per master. Per step:
     cross-node MB (dispatch, gather, residual moves; forward and backward) and NIC seconds (a
     layer waits for its busiest NIC). "q=1, free moves" is LUFFY's own accounting (residual moves
     free and not counted), a bound on what the gather alone could save. The all-reduce of the
     masters' backbone LoRA gradients (paper_scale's `ring_allreduce`) is added for the comparison
     with expert parallelism;
  5. EP: paper_scale's `ep_traffic`, the expected traffic under the same profile.

Run: python benchmarks/sequence_migration.py   (under a minute on 2 cores: ~15 s of routing, then
     the solver and `replicate`, at most --time-budget seconds each per case)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/sequence_migration.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import parser, run, write_results  # noqa: E402
from benchmarks.paper_scale import (  # noqa: E402
    CAPACITIES,
    DATASETS,
    MASTERS,
    NODES,
    PROFILES,
    TOKENS,
    TOP_K,
    ep_traffic,
    masters_problem_for,
    mixtral_probs,
    problem_for,
    ring_allreduce,
)
from placement import shared_link_times, simulate_sequences, solve  # noqa: E402
from vela_ray.data.datasets import instruct_examples, load_instruct_examples, pack_text  # noqa: E402
from vela_ray.data.locality import RoutingRecorder  # noqa: E402
from vela_ray.model.modeling import find_moe_blocks, top_k_of  # noqa: E402
from vela_ray.paths import data_dir  # noqa: E402
from vela_ray.training.tiny_model import cpu_threads, tiny_model_path  # noqa: E402

try:
    from placement import replicate  # noqa: E402
except ImportError:  # another change may not have landed yet: the replicas rows are then skipped
    replicate = None

log = logging.getLogger("sequence_migration")
SEQ_LEN, SEQUENCES_PER_STEP = 512, 8
SOURCES = {"wikitext": ("text", "wikitext-2/valid.txt"), "gsm8k_alpaca": ("instruct", "instruct/gsm8k_alpaca.json"),
           "alpaca": ("instruct", "instruct/alpaca_seed_tasks.jsonl")}
# label: (q, residual rows per moved token); "free moves" is LUFFY's own accounting, which does not count
# the residual (a bound, not a cost vela-ray can reach: its bytes leave the residual out)
MIGRATIONS = {"none": (None, 1.0), "q=1": (1, 1.0), "q=2": (2, 1.0), "q=1, free moves": (1, 0.0)}
RESULTS = ROOT / "benchmarks" / "results" / "sequence_migration.json"
assert SEQ_LEN * SEQUENCES_PER_STEP == TOKENS, "paper_scale's step is 8 x 512 tokens"


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, RESULTS, what="where to save the numbers (JSON)")
    p.add_argument("--sequences", type=int, default=64, help="512-token sequences per data set (whole steps of 8)")
    p.add_argument("--window", type=int, default=128, help="tokens per forward of text (the tiny model's rows)")
    p.add_argument("--example-tokens", type=int, default=256, help="instruction examples are cut at this length")
    p.add_argument("--seed", type=int, default=0, help="expert-id permutations, solver, replicas, step shuffle")
    p.add_argument("--time-budget", type=float, default=10.0, help="seconds for the solver and for replicate")
    return p.parse_args()


# --- 1. routing traces -------------------------------------------------------------------------------


def chunk_plan(tokenizer, name: str, sequences: int, window: int, example_tokens: int) -> list[list[list[int]]]:
    """Per 512-token sequence, the token ids of each forward (module docstring, 1.)."""
    kind, relative = SOURCES[name]
    path = data_dir() / relative
    if kind == "text":
        if SEQ_LEN % window:
            raise ValueError(f"--window {window} must divide {SEQ_LEN}")
        per = SEQ_LEN // window
        rows = pack_text(tokenizer, path, window, max_blocks=sequences * per).input_ids.tolist()
        return [rows[i:i + per] for i in range(0, len(rows) - per + 1, per)]
    examples = instruct_examples(tokenizer, load_instruct_examples(path, limit=sequences * SEQ_LEN // 32))
    plan, current, room = [], [], SEQ_LEN
    for example in examples:
        ids = example.input_ids[:min(example_tokens, room)]
        current.append(ids)
        room -= len(ids)
        if room == 0:
            plan.append(current)
            current, room = [], SEQ_LEN
            if len(plan) == sequences:
                break
    return plan


def record(model, recorder: RoutingRecorder, plan: list[list[list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(counts [S, L_tiny, E] of each sequence's top-k choices, tokens [S])."""
    counts = []
    with torch.inference_mode():
        for chunks in plan:
            total = 0
            for ids in chunks:
                model(input_ids=torch.tensor([ids]))
                total = total + recorder.take_counts()
            counts.append(total.numpy())
    return np.array(counts), np.array([sum(map(len, chunks)) for chunks in plan])


def traces(args: argparse.Namespace) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{data set: (tiny counts [S, 4, 8], tokens [S])}."""
    model_dir = tiny_model_path()
    torch.set_num_threads(cpu_threads())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if top_k_of(model) != TOP_K:
        raise ValueError(f"the tiny model routes top-{top_k_of(model)}, paper_scale's Mixtral top-{TOP_K}")
    recorder = RoutingRecorder(find_moe_blocks(model), TOP_K, record_confidence=False).attach()
    out = {}
    for name in DATASETS:
        plan = chunk_plan(tokenizer, name, args.sequences, args.window, args.example_tokens)
        plan = plan[:len(plan) // SEQUENCES_PER_STEP * SEQUENCES_PER_STEP]
        started = time.perf_counter()
        out[name] = record(model, recorder, plan)
        log.info("%s: %d sequences of %d tokens in %.0f s", name, len(plan), SEQ_LEN, time.perf_counter() - started)
    recorder.detach()
    return out


# --- 2-5. simulation ------------------------------------------------------------------------------------


def mixtral_counts(tiny_SLE: np.ndarray, seed: int) -> np.ndarray:
    """[S, 32, 8]: each sequence's counts mapped as paper_scale maps profiles (same permutations)."""
    return np.stack([np.rint(mixtral_probs(c.astype(np.float64), seed)).astype(np.int64) for c in tiny_SLE])


def simulate(args: argparse.Namespace, recorded: dict) -> dict:
    """{"<data set> / C=<capacity>": {placement: {migration: per-step numbers}, "ep": ...}}."""
    allreduce_bytes, allreduce_s = ring_allreduce(MASTERS)
    ep_allreduce_s = ring_allreduce(NODES)[1]
    results = {}
    for name, filename in DATASETS.items():
        tiny, tokens = recorded[name]
        counts = mixtral_counts(tiny, args.seed)
        order = np.random.default_rng(args.seed).permutation(len(tokens))
        steps = order.reshape(-1, SEQUENCES_PER_STEP)
        profile = PROFILES / filename
        probs = mixtral_probs(np.load(profile) if profile.is_file() else tiny.sum(0) / tokens.sum(), args.seed)
        for capacity in CAPACITIES.values():
            problem = masters_problem_for(probs, capacity, shared_nic=True)
            table = solve(problem, "improved", seed=args.seed, time_budget_s=args.time_budget).as_array()
            plans = {"one copy": table}
            if replicate is not None:
                plans["replicas"] = replicate(problem, table, seed=args.seed, time_budget_s=args.time_budget)
            rows = {}
            for plan_name, plan in plans.items():
                rows[plan_name] = {"cost_model_nic_s": float(shared_link_times(problem, plan).max(axis=0).sum())}
                for label, (q, residual) in MIGRATIONS.items():
                    reports = [simulate_sequences(problem, counts[step], tokens[step], plan, q=q,
                                                  residual_rows_per_token=residual) for step in steps]
                    rows[plan_name][label] = _mean(reports, allreduce_bytes, allreduce_s)
            ep = ep_traffic(problem_for(probs, capacity))
            rows["ep"] = {"token_mb": ep["token_cross_bytes"] / 1e6, "nic_s": ep["nic_comm_s"] - ep_allreduce_s,
                          "nic_s_with_allreduce": ep["nic_comm_s"], "total_mb": (ep["token_cross_bytes"]
                                                                                 + ep["allreduce_cross_bytes"]) / 1e6}
            rows["steps"], rows["sequences"] = len(steps), len(tokens)
            rows["concentration"] = concentration(tiny, counts, table)
            results[f"{name} / C={capacity}"] = rows
            log.info("%s / C=%d done", name, capacity)
    return results


def concentration(tiny_SLE: np.ndarray, counts_SLE: np.ndarray, table: np.ndarray) -> dict:
    """What migration can use: how much more a sequence's routing is concentrated than the data set's.

    expert_top1_*: the busiest expert's share of rows (tiny model; per sequence and layer, and of the
    whole data set); node_top1_per_sequence: the busiest node's share of a sequence's rows under the
    one-copy table (1/3 if spread evenly), at Mixtral scale."""
    per_sequence = (tiny_SLE.max(axis=2) / tiny_SLE.sum(axis=2)).mean()
    pooled = tiny_SLE.sum(axis=0)
    node_W = np.array([sorted(set(NODES)).index(n) for n in NODES])
    served_SLN = np.zeros((*counts_SLE.shape[:2], len(set(NODES))))
    for layer, expert in np.ndindex(table.shape):
        served_SLN[:, layer, node_W[table[layer, expert]]] += counts_SLE[:, layer, expert]
    return {"expert_top1_per_sequence": float(per_sequence),
            "expert_top1_data_set": float((pooled.max(axis=1) / pooled.sum(axis=1)).mean()),
            "node_top1_per_sequence": float((served_SLN.max(axis=2) / served_SLN.sum(axis=2)).mean())}


def _mean(reports: list, allreduce_bytes: float, allreduce_s: float) -> dict:
    """Per-step means of the reports' numbers, with the masters' all-reduce added to the totals."""
    mean = lambda values: float(np.mean(values))  # noqa: E731
    token = mean([r.cross_node_bytes for r in reports])
    nic = mean([r.nic_seconds for r in reports])
    return {"token_mb": token / 1e6, "dispatch_mb": mean([sum(r.dispatch_bytes) for r in reports]) / 1e6,
            "gather_mb": mean([sum(r.gather_bytes) for r in reports]) / 1e6,
            "residual_mb": mean([sum(r.residual_bytes) for r in reports]) / 1e6,
            "moved_share": mean([r.moved_share for r in reports]), "nic_s": nic,
            "nic_s_with_allreduce": nic + allreduce_s, "total_mb": (token + allreduce_bytes) / 1e6}


def markdown(results: dict) -> str:
    lines = ["| data set / capacity | placement | migration | token MB/step | vs none | residual MB | moved | "
             "NIC s (tokens) | NIC s + all-reduce | / EP |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, rows in results.items():
        ep = rows["ep"]
        lines.append(f"| {case} | ep | | {ep['token_mb']:.0f} | | | | {ep['nic_s']:.3f} | "
                     f"{ep['nic_s_with_allreduce']:.3f} | 1.00 |")
        for plan in ("one copy", "replicas"):
            if plan not in rows:
                lines.append(f"| {case} | {plan} | skipped: placement.replicate not importable | | | | | | | |")
                continue
            for label in MIGRATIONS:
                r, base = rows[plan][label], rows[plan]["none"]
                lines.append(f"| {case} | {plan} | {label} | {r['token_mb']:.0f} | "
                             f"{r['token_mb'] / base['token_mb'] - 1:+.1%} | {r['residual_mb']:.0f} | "
                             f"{r['moved_share']:.0%} | {r['nic_s']:.3f} | {r['nic_s_with_allreduce']:.3f} | "
                             f"{r['nic_s_with_allreduce'] / ep['nic_s_with_allreduce']:.2f} |")
    legend = ("Per step of 8 x 512 tokens, forward and backward. token MB: cross-node dispatch + gather + residual "
              "moves; moved: share of (sequence, layer) after which the sequence changes master. NIC s: sum over "
              "layers of the busiest 1.17 GB/s NIC. / EP: NIC s + all-reduce over expert parallelism's (its "
              "expected traffic under the same profile, with its own all-reduce). q=1, free moves: LUFFY's own "
              "accounting, residual moves neither counted nor charged (a bound).")
    spread = ["| data set | busiest expert, per sequence | busiest expert, data set | busiest node, per sequence |",
              "|---|---:|---:|---:|"]
    for case, rows in results.items():
        if case.endswith(f"C={min(CAPACITIES.values())}"):
            c = rows["concentration"]
            spread.append(f"| {case.split(' / ')[0]} | {c['expert_top1_per_sequence']:.3f} | "
                          f"{c['expert_top1_data_set']:.3f} | {c['node_top1_per_sequence']:.3f} |")
    return "\n".join([*lines, "", legend, "", "Share of rows (mean over layers; nodes: one copy, "
                      f"C={min(CAPACITIES.values())}; 1/3 = even):", "", *spread])


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    sim = simulate(args, traces(args))
    print(markdown(sim))
    write_results(args.out, {"args": {k: str(v) for k, v in vars(args).items()},
                             "seconds": time.perf_counter() - started, "results": sim})


if __name__ == "__main__":
    run(main)
