"""Benchmark: sequence migration in a real job, measured: cross-node bytes with it off and on, side by side.

`benchmarks/sequence_migration.py` simulates LUFFY's migration at Mixtral-8x7B scale. This one runs
the job (`JobRunner`, three data-parallel masters) and counts what crossed nodes:

    expert rows     the masters' rows, results and gradients to and from workers on other nodes
                    (`summary.traffic_bytes_by_tier["cross_node"]`, training and eval passes)
    hidden states   what the masters' migrations sent to a master on another node, forward and
                    backward (`summary.sequence_moves["cross_node_bytes"]`)

for `masters.sequence_migration` off, and on with q = 1 and q = 2 candidates, each with the combine on the
new master (LUFFY's, the default: the workers answer a moving sequence's rows to the master it moves to;
the row codes and routing weights that go with them count as hidden-state bytes) and at home (the
outputs return to the old master, which moves the combined hidden state), on the same seed. The
cluster is emulated in one process (`InProcessPool(worker_nodes=...)`): 3 nodes with 2 workers each
and a master on each node, the experts placed by the default solver (links all equal, so it balances
the routing). The model is the briefly pre-trained tiny Mixtral (4 layers, 8 experts, top-2 by default, hidden
128; `vela build-tiny-model`), trained on WikiText-2 in rows of 128 tokens, so the routing is a real
router's. Migration is exact, so the losses must agree; the script checks it.

Also reported: cross-node bytes per step, the median step time (one process on 2 cores: compute, not
network), and for q=1 "LUFFY bound": the expert rows' bytes had every sequence's combine happened on the
node that served most of its rows, moves free and no capacity (LUFFY's own accounting, from the
migration's `combine_*` row counts, on the layers where a decision is taken: all MoE layers but the last):
what gathering straight to the new master could at most save on this routing.

    python benchmarks/sequence_migration_job.py            # 4 steps of 12 sequences (~1 min on 2 cores)
    python benchmarks/sequence_migration_job.py --experts 32 --top-k 8 \
        --out benchmarks/results/sequence_migration_job_top8.json  # top-8 routing (Qwen3-MoE's k)

Results: a table, and benchmarks/results/sequence_migration_job.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/sequence_migration_job.py`: the root, for the harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import WIKITEXT, command, parser, run, tiny_job, write_results  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.quiet import silence_known_warnings  # noqa: E402
from vela_ray.runtime.local import InProcessPool  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "sequence_migration_job.json"
NODES = ["node-0", "node-0", "node-1", "node-1", "node-2", "node-2"]  # worker n's node
AT_HOME = {"sequence_migration_combine": "home"}
SETTINGS = {"off": {"sequence_migration": False},
            "q=1": {"sequence_migration": True}, "q=1 at home": {"sequence_migration": True, **AT_HOME},
            "q=2": {"sequence_migration": True, "sequence_migration_candidates": 2},
            "q=2 at home": {"sequence_migration": True, "sequence_migration_candidates": 2, **AT_HOME}}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, RESULTS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=12, help="sequences per step (one micro-batch, 4 per master)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--experts", type=int, default=8, help="experts per layer of the tiny model (built once, cached)")
    p.add_argument("--top-k", type=int, default=2,
                   help="experts per token: a move costs one row per token, the combine k, so larger k pays more")
    return p.parse_args(argv)


def tiny_model(args: argparse.Namespace) -> Path:
    """The tiny pre-trained Mixtral with `--experts` and `--top-k` (the default build unless they change): the
    experts' hidden size is 512 / k, so every build computes as much per token."""
    from vela_ray.training.tiny_model import TinyModelConfig, tiny_model_path

    if (args.experts, args.top_k) == (8, 2):
        return tiny_model_path()
    build = TinyModelConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=512 // args.top_k)
    return tiny_model_path(build)


def job(args: argparse.Namespace, out: Path, masters: dict) -> JobConfig:
    return JobConfig.from_dict(tiny_job(
        out, tiny_model(args),
        data={"path": str(WIKITEXT), "seq_len": args.seq_len, "limit": args.steps * args.batch * 4},
        cluster={"num_workers": len(NODES)}, masters={"count": 3, **masters},
        placement=None,  # vela-ray's default: solved on a measured profile
        training={"steps": args.steps, "batch_size": args.batch, "micro_batch_size": args.batch, "eval_every": 0}))


def run_setting(args: argparse.Namespace, name: str, out: Path) -> dict:
    config = job(args, out / name.replace("=", "").replace(" ", "-"), SETTINGS[name])
    start = time.perf_counter()
    summary = JobRunner(config, InProcessPool(config, master_node=NODES[0], worker_nodes=NODES)).run()
    seconds = time.perf_counter() - start
    moves = summary.sequence_moves or {}
    expert = summary.traffic_bytes_by_tier.get("cross_node", 0)
    hidden = moves.get("cross_node_bytes", 0)
    step_times = sorted(record.step_time_s for record in summary.history)
    result = {"losses": summary.losses, "expert_cross_node_bytes": expert, "hidden_cross_node_bytes": hidden,
              "cross_node_bytes": expert + hidden, "cross_node_bytes_per_step": (expert + hidden) / args.steps,
              "step_time_s_median": step_times[len(step_times) // 2], "sequence_moves": moves, "seconds": seconds}
    if moves.get("combine_rows"):
        # LUFFY's combine "where the experts ran" with free moves, no capacity (q = 1, its own accounting): the
        # gathered rows (and, backward, their gradients) that would no longer cross, on the decided layers
        row_bytes = 4 * json.loads((Path(config.model.path) / "config.json").read_text())["hidden_size"]
        kept = moves["combine_cross_node_rows"] - moves["combine_cross_node_rows_best_node"]
        result["luffy_bound_cross_node_bytes"] = expert - 2 * kept * row_bytes
    return result


def main() -> None:
    args = parse_args()
    silence_known_warnings()
    with tempfile.TemporaryDirectory(prefix="vela-migration-") as tmp:
        results = {name: run_setting(args, name, Path(tmp)) for name in SETTINGS}
    off = results["off"]
    for name, r in results.items():
        if max(abs(a - b) for a, b in zip(r["losses"], off["losses"])) > 1e-5 * max(map(abs, off["losses"])):
            raise SystemExit(f"{name}: losses {r['losses']} differ from migration off's {off['losses']}")
        r["vs_off"] = r["cross_node_bytes"] / off["cross_node_bytes"]
    lines = ["| migration | expert rows MB | hidden states MB | cross-node MB | per step MB | vs off | sequences moved"
             " | rows relayed | median step s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        moves = r["sequence_moves"]
        lines.append(f"| {name} | {r['expert_cross_node_bytes'] / 1e6:.2f} | {r['hidden_cross_node_bytes'] / 1e6:.2f}"
                     f" | {r['cross_node_bytes'] / 1e6:.2f} | {r['cross_node_bytes_per_step'] / 1e6:.2f}"
                     f" | {r['vs_off']:.3f} | {moves.get('moves', 0)} | {moves.get('relayed_rows', 0)}"
                     f" | {r['step_time_s_median']:.3f} |")
    bound = results["q=1"].get("luffy_bound_cross_node_bytes")
    if bound is not None:
        results["q=1"]["luffy_bound_vs_off"] = bound / off["cross_node_bytes"]
        lines.append(f"| LUFFY bound (combine where most rows ran, free moves) | {bound / 1e6:.2f} | 0 |"
                     f" {bound / 1e6:.2f} | {bound / args.steps / 1e6:.2f}"
                     f" | {bound / off['cross_node_bytes']:.3f} | | | |")
    print("\n".join(lines))
    write_results(args.out, {"command": command(__file__), "args": {k: str(v) for k, v in vars(args).items()},
                             "nodes": NODES, "results": results, "table": lines})


if __name__ == "__main__":
    run(main, level=logging.WARNING)
