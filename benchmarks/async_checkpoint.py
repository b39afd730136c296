"""Training stall per checkpoint, synchronous vs asynchronous (`checkpoint.asynchronous`, ZO-Offloading §5.5).

The same job run with synchronous and with asynchronous checkpoints, side by side in one process
(vela-ray's JobRunner over in-process ExpertManagers, as benchmarks/condensation.py: the expert
workers' writes then share this process and its cores with training, the harder case for
asynchronous writes; on Ray each worker writes in its own process): the cached tiny pre-trained
Mixtral (`vela build-tiny-model`) on Tiny Shakespeare, LoRA rank `--lora-r` on every linear layer
and expert (the checkpoint's size grows with it), a checkpoint every `--every` steps, the two modes
interleaved `--repeats` times. The stall of a checkpoint is `summary.timings_s["checkpoint_stall_s"]`:
the seconds the training loop stood still for it, the whole write (files, fsync, sha256 manifest,
rename) when synchronous, the host copy plus any later wait for the write when asynchronous. The
run's last checkpoint is reported apart: the run waits for it at its end in both modes. Also the
step times and train seconds (background writes compete with training for the cores), and whether
both modes wrote byte-identical tensor files (manifest sha256) and the same losses. Printed as a
table and written to `--results`:

    python benchmarks/async_checkpoint.py --steps 24 --every 2 --lora-r 128 --repeats 2
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/async_checkpoint.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import SHAKESPEARE, command, parser, run, tiny_job, write_results  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.runtime.local import InProcessPool  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402
from vela_ray.training import checkpoint  # noqa: E402
from vela_ray.training.summary import RunSummary  # noqa: E402
from vela_ray.training.tiny_model import cpu_threads, tiny_model_path  # noqa: E402

MODES = {"sync": False, "async": True}
logger = logging.getLogger("async_checkpoint")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, Path("benchmarks/results/async_checkpoint.json"), flag="--results",
               what="where to write the results JSON")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps (and at the end)")
    p.add_argument("--lora-r", type=int, default=128, help="LoRA rank: sets the checkpoint's size")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    return p.parse_args(argv)


def job(args, out: Path, asynchronous: bool) -> JobConfig:
    return JobConfig.from_dict(tiny_job(
        out, data={"seq_len": args.seq_len, "limit": 1000}, lora={"r": args.lora_r, "alpha": 2 * args.lora_r},
        training={"steps": args.steps, "batch_size": args.batch_size, "optimizer": {"lr": 3e-4}},
        checkpoint={"every": args.every, "keep": args.steps, "asynchronous": asynchronous},
    ), source=f"async_checkpoint {'async' if asynchronous else 'sync'}")


def run_mode(args, out: Path, asynchronous: bool) -> RunSummary:
    config = job(args, out, asynchronous)
    summary = JobRunner(config, InProcessPool(config)).run()
    stalls = summary.timings_s["checkpoint_stall_s"]
    logger.info("%s: %d checkpoints, median stall %.3f s, train %.1f s", out.name, len(stalls),
                float(np.median(stalls[:-1])), summary.timings_s["train_s"])
    return summary


def tensor_files(root: Path) -> dict[str, dict]:
    """{step dir: {file: sha256}} of every checkpoint's tensor files (trainer.json holds the config)."""
    return {path.name: {name: entry["sha256"] for name, entry in checkpoint.verify(path)["files"].items()
                        if name.endswith(".safetensors")}
            for path in checkpoint.step_dirs(root)}


def view(summaries: list[RunSummary]) -> dict:
    """One mode's figures over its repeats; the last checkpoint of each run apart from the others."""
    periodic = [s for summary in summaries for s in summary.timings_s["checkpoint_stall_s"][:-1]]
    last = [summary.timings_s["checkpoint_stall_s"][-1] for summary in summaries]
    steps = [h.step_time_s for summary in summaries for h in summary.history]
    return {
        "checkpoints_per_run": len(summaries[0].timings_s["checkpoint_stall_s"]),
        "stall_per_checkpoint_s": periodic,
        "stall_per_checkpoint_median_s": float(np.median(periodic)),
        "stall_per_checkpoint_mean_s": float(np.mean(periodic)),
        "stall_last_checkpoint_s": last,
        "step_time_median_s": float(np.median(steps)),
        "train_s": [summary.timings_s["train_s"] for summary in summaries],
        "train_median_s": float(np.median([summary.timings_s["train_s"] for summary in summaries])),
    }


def table(rows: dict[str, dict], size_mb: float) -> str:
    lines = [f"checkpoint size {size_mb:.1f} MB",
             "| mode | stall per checkpoint (median) | (mean) | last checkpoint | step time (median) | train s |",
             "|---|---:|---:|---:|---:|---:|"]
    for mode, r in rows.items():
        lines.append(f"| {mode} | {r['stall_per_checkpoint_median_s']:.3f} s | {r['stall_per_checkpoint_mean_s']:.3f} s"
                     f" | {np.median(r['stall_last_checkpoint_s']):.3f} s | {r['step_time_median_s']:.3f} s | "
                     f"{r['train_median_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(cpu_threads())
    root = Path(tempfile.mkdtemp(prefix="vela-async-checkpoint-"))
    start = time.perf_counter()
    summaries: dict[str, list[RunSummary]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            summaries[mode].append(run_mode(args, root / f"{mode}-{repeat}", MODES[mode]))
    files = {mode: tensor_files(root / f"{mode}-0" / "checkpoints") for mode in MODES}
    last = checkpoint.step_dirs(root / "sync-0" / "checkpoints")[-1]
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    rows = {mode: view(runs) for mode, runs in summaries.items()}
    shutil.rmtree(root)  # every checkpoint of every run: gigabytes at the default rank
    results = {
        "command": command(__file__, argv),
        "settings": vars(args),
        "model": str(tiny_model_path()), "data": str(SHAKESPEARE), "pool": "in-process (InProcessPool)",
        "cpus": os.cpu_count(), "load_average_1min_at_end": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "checkpoint_bytes": size,
        "same_tensor_files": files["sync"] == files["async"],
        "same_losses": all(a.losses == b.losses for a, b in zip(summaries["sync"], summaries["async"])),
        "stall_median_ratio_async_over_sync":
            rows["async"]["stall_per_checkpoint_median_s"] / rows["sync"]["stall_per_checkpoint_median_s"],
        "benchmark_wall_s": time.perf_counter() - start,
        "modes": rows,
        "what": {
            "stall_per_checkpoint_s": "every checkpoint but each run's last, all repeats: seconds the training loop "
                                      "stood still for it (sync: the whole write; async: host copy + later waits)",
            "stall_last_checkpoint_s": "each run's last checkpoint: the run waits for it to be published",
            "step_time_median_s": "median optimizer step time (async: steps overlap background writes)",
            "train_s": "per run: the training loop's wall time, checkpoints included",
            "same_tensor_files": "the first sync and async runs wrote the same sha256 for every tensor file",
            "load_average_1min_at_end": "1-minute load average when done (other work on the machine)",
        },
    }
    write_results(args.results, results)
    print(table(rows, size / 1e6))


if __name__ == "__main__":
    run(main, quiet=["vela_ray"])  # vela_ray: one line per run, not per step
