"""Token condensation (LUFFY §V; lossy): traffic saved against loss lost, exact run vs condensed runs.

The same job several times in one process (vela-ray's JobRunner over in-process ExpertManagers:
the broker counts the same bytes whatever the transport, and no Ray start-up eats the budget):
the cached tiny pre-trained Mixtral (`vela build-tiny-model`) fine-tuned with LoRA on WikiText-2
(`../shared/data/wikitext-2/valid.txt`, 128-token rows), same seed, data and schedule, once exact
and once per condensation setting (`--thresholds`: `adaptive` is LUFFY's Eq. 2, numbers are fixed
thresholds on the clamped-cosine scale). Per run: rows condensed, bytes saved (and the check that
the exact run's traffic minus the run's equals them), pairs decided by history, the master's
selection seconds, final training loss (last step and mean of the last 5), eval loss (exact
forwards on held-out rows), and the differences against the exact run. Printed as a table and
written to `--results`:

    python benchmarks/condensation.py --steps 40 --results benchmarks/results/condensation.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/condensation.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import WIKITEXT, command, parser, run, tiny_job, write_results  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.runtime.local import InProcessPool  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402
from vela_ray.training.summary import RunSummary  # noqa: E402
from vela_ray.training.tiny_model import cpu_threads, tiny_model_path  # noqa: E402

logger = logging.getLogger("condensation")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, Path("benchmarks/results/condensation.json"), flag="--results",
               what="where to write the results JSON")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--thresholds", default="adaptive,0.9,0.7",
                   help="comma-separated condensation settings to compare with the exact run")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--limit", type=int, default=1200, help="rows of WikiText-2 (5%% held out for eval loss)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (3 warmup steps, then constant)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches of the final eval loss")
    return p.parse_args(argv)


def job(args, out: Path, threshold: str | None) -> JobConfig:
    """The job; `threshold` None: condensation off (exact)."""
    training = {"steps": args.steps, "batch_size": args.batch_size, "eval_batches": args.eval_batches,
                "optimizer": {"lr": args.lr, "warmup_steps": 3}}
    if threshold is not None:
        training["condensation"] = {"enabled": True,
                                    "threshold": threshold if threshold == "adaptive" else float(threshold)}
    # tiny_job's fixed placement: both runs move the same rows to the same workers, so bytes compare directly
    return JobConfig.from_dict(tiny_job(out, data={"path": str(WIKITEXT), "seq_len": args.seq_len, "limit": args.limit},
                                        training=training), source=f"condensation {threshold or 'off'}")


def run_setting(args, label: str, threshold: str | None, root: Path) -> dict:
    config = job(args, root / label, threshold)
    start = time.perf_counter()
    summary = JobRunner(config, InProcessPool(config)).run()
    wall = time.perf_counter() - start
    logger.info("%s: loss %.4f, eval %.4f, %.0f s", label, summary.losses[-1], summary.eval_loss, wall)
    return {"summary": summary, "wall_s": wall}


def view(summary: RunSummary, exact: RunSummary, wall_s: float) -> dict:
    """One run's figures, with its differences against the exact run."""
    c = summary.condensation
    traffic = sum(summary.traffic_bytes_by_tier.values())
    exact_traffic = sum(exact.traffic_bytes_by_tier.values())
    losses, exact_losses = np.asarray(summary.losses), np.asarray(exact.losses)
    return {
        "condensation": c.threshold_policy if c.enabled else "off",
        "rows_condensed_pct": 100 * c.condensed_fraction,
        "rows_seen": c.rows_seen,
        "bytes_saved": c.bytes_saved_total,
        "bytes_saved_by_direction": c.bytes_saved,
        "traffic_bytes": traffic,
        "traffic_saved_pct": 100 * (exact_traffic - traffic) / exact_traffic,
        "traffic_drop_equals_bytes_saved": exact_traffic - traffic == c.bytes_saved_total,
        "final_threshold": c.final_threshold,
        "pairs_from_history_pct": 100 * c.pairs_from_history / max(1, c.pairs_from_history + c.pairs_computed),
        "select_s": c.select_s,
        "train_s": summary.timings_s.get("train_s"),
        "wall_s": wall_s,
        "final_train_loss": float(losses[-1]),
        "train_loss_last5": float(losses[-5:].mean()),
        "eval_loss": summary.eval_loss,
        "train_loss_last5_diff": float(losses[-5:].mean() - exact_losses[-5:].mean()),
        "eval_loss_diff": summary.eval_loss - exact.eval_loss,
        "eval_loss_rel_diff_pct": 100 * (summary.eval_loss - exact.eval_loss) / exact.eval_loss,
        "max_abs_train_loss_diff": float(np.abs(losses - exact_losses).max()),
        "losses": summary.losses,
    }


def table(rows: dict[str, dict]) -> str:
    head = ("| run | rows condensed | bytes saved (MB) | traffic saved | final threshold | pairs from history | "
            "train loss (last 5) | vs exact | eval loss | vs exact |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows.items():
        threshold = "" if r["final_threshold"] is None else f"{r['final_threshold']:.3f}"
        lines.append(f"| {label} | {r['rows_condensed_pct']:.1f}% | {r['bytes_saved'] / 1e6:.1f} | "
                     f"{r['traffic_saved_pct']:.1f}% | {threshold} | {r['pairs_from_history_pct']:.1f}% | "
                     f"{r['train_loss_last5']:.4f} | {r['train_loss_last5_diff']:+.4f} | {r['eval_loss']:.4f} | "
                     f"{r['eval_loss_diff']:+.4f} ({r['eval_loss_rel_diff_pct']:+.2f}%) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(cpu_threads())
    root = Path(tempfile.mkdtemp(prefix="vela-condensation-"))
    settings = {"exact": None, **{f"condensed {t}": t for t in args.thresholds.split(",")}}
    start = time.perf_counter()
    runs = {label: run_setting(args, label, threshold, root) for label, threshold in settings.items()}
    exact = runs["exact"]["summary"]
    rows = {label: view(r["summary"], exact, r["wall_s"]) for label, r in runs.items()}
    results = {"command": command(__file__, argv), "settings": vars(args),
               "model": str(tiny_model_path()), "data": str(WIKITEXT), "torch_threads": torch.get_num_threads(),
               "benchmark_wall_s": time.perf_counter() - start, "runs": rows}
    write_results(args.results, results)
    print(table(rows))


if __name__ == "__main__":
    run(main, quiet=["vela_ray"])  # vela_ray: one line per run, not per step
