"""What the tools people run cost a job: each experiment tracker per step, and checkpoints on object storage.

Side by side in one process (JobRunner over in-process ExpertManagers, the cached tiny pre-trained Mixtral on
Tiny Shakespeare, as benchmarks/async_checkpoint.py):
  1. trackers: the same `--steps`-step job with `training.report_to` empty, [tensorboard], [mlflow] (a local
     file store) and [wandb] (offline). Per tracker: the median step time; the training thread's time per
     step for the trackers (`timings_s["trackers_step_s"]`: the workers' compute report and a queued dict,
     the only part a step waits for); the background thread's time per step in the tracker
     (`tracker_<name>_busy_s` / steps), which overlaps the next steps;
  2. storage: the same job checkpointing every `--every` steps to a local directory and to an S3 bucket on a
     local moto server (127.0.0.1, started here): the median training stall per checkpoint
     (`timings_s["checkpoint_stall_s"]`: writes, uploads, manifest), and the resume read of the last
     checkpoint (find the newest verified, download and check every sha256, read the backbone and every
     expert's state), cold: the local copy cache emptied first.

    python benchmarks/trackers_storage.py --steps 100 --every 10

moto is an in-process S3 emulator on loopback: the storage figures show vela-ray's own overhead of going
through an S3 API (multipart uploads, listings, the download-and-verify on resume), not a real bucket's
bandwidth or latency.
"""

from __future__ import annotations

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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import SHAKESPEARE, command, parser, run, tiny_job, write_results  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.runtime.local import InProcessPool  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402
from vela_ray.training import checkpoint  # noqa: E402
from vela_ray.training.summary import RunSummary  # noqa: E402
from vela_ray.training.tiny_model import cpu_threads, tiny_model_path  # noqa: E402

TRACKERS = ["none", "tensorboard", "mlflow", "wandb"]
logger = logging.getLogger("trackers_storage")


def parse_args(argv=None):
    p = parser(__doc__, Path("benchmarks/results/trackers_storage.json"), flag="--results",
               what="where to write the results JSON")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per tracker run")
    p.add_argument("--storage-steps", type=int, default=20, help="optimizer steps per storage run")
    p.add_argument("--every", type=int, default=5, help="storage runs: checkpoint every N steps")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (the checkpoint's size)")
    return p.parse_args(argv)


def _job(out: Path | str, steps: int, lora_r: int, **sections) -> JobConfig:
    return JobConfig.from_dict(tiny_job(
        out, data={"seq_len": 64, "limit": 1000}, lora={"r": lora_r, "alpha": 2 * lora_r},
        training={"steps": steps, "batch_size": 4, "optimizer": {"lr": 3e-4}, **sections.pop("training", {})},
        **sections), source="trackers_storage")


def _run(config: JobConfig) -> RunSummary:
    return JobRunner(config, InProcessPool(config)).run()


def tracker_rows(args, root: Path) -> dict[str, dict]:
    os.environ.update({"MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
                       "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    rows = {}
    for name in TRACKERS:
        report_to = [] if name == "none" else [name]
        summary = _run(_job(root / f"tracker-{name}", args.steps, args.lora_r, training={"report_to": report_to}))
        timings = summary.timings_s
        on_step = timings.get("trackers_step_s", [0.0] * args.steps)
        rows[name] = {
            "step_time_median_ms": 1e3 * float(np.median([h.step_time_s for h in summary.history])),
            "training_thread_per_step_median_ms": 1e3 * float(np.median(on_step)),
            "background_per_step_ms": 1e3 * float(timings.get(f"tracker_{name}_busy_s", 0.0)) / args.steps,
        }
        logger.info("%s: %s", name, rows[name])
    base = rows["none"]["step_time_median_ms"]
    for row in rows.values():
        row["step_time_ratio_to_none"] = row["step_time_median_ms"] / base
    return rows


def _moto_s3() -> tuple[object, str]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"})
    boto3.client("s3").create_bucket(Bucket="bench")
    return server, "s3://bench"


def _resume_read_s(root: str | Path) -> float:
    """Seconds to find the newest verified checkpoint under `root` and read what a resume reads, cold."""
    from vela_ray.paths import cache_dir

    shutil.rmtree(cache_dir() / "checkpoints", ignore_errors=True)
    start = time.perf_counter()
    local = checkpoint.resolve("latest", root)
    checkpoint.read_tensors(local / "backbone.safetensors")
    manifest = checkpoint.verify(local, checksums=False)
    keys = [tuple(int(x) for x in key.split(".")) for key in manifest["experts"]]
    checkpoint.read_expert_states_at(checkpoint.source_of(local), keys)
    return time.perf_counter() - start


def storage_rows(args, root: Path) -> dict[str, dict]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    server, bucket = _moto_s3()
    try:
        rows = {}
        for name, out in (("local disk", root / "storage-local"), ("S3 (moto, 127.0.0.1)", f"{bucket}/run")):
            summary = _run(_job(out, args.storage_steps, args.lora_r, checkpoint={"every": args.every, "keep": 2}))
            stalls = summary.timings_s["checkpoint_stall_s"]
            ckpt_root = f"{out}/checkpoints" if isinstance(out, str) else out / "checkpoints"
            rows[name] = {"checkpoints": len(stalls), "stall_per_checkpoint_median_s": float(np.median(stalls)),
                          "resume_read_s": _resume_read_s(ckpt_root),
                          "step_time_median_s": float(np.median([h.step_time_s for h in summary.history]))}
            logger.info("%s: %s", name, rows[name])
        local, s3 = rows["local disk"], rows["S3 (moto, 127.0.0.1)"]
        s3["stall_ratio_to_local"] = s3["stall_per_checkpoint_median_s"] / local["stall_per_checkpoint_median_s"]
        s3["resume_ratio_to_local"] = s3["resume_read_s"] / local["resume_read_s"]
        return rows
    finally:
        server.stop()


def table(trackers: dict, storage: dict) -> str:
    lines = ["| tracker | step time (median) | on the training thread per step | background per step |",
             "|---|---:|---:|---:|"]
    for name, r in trackers.items():
        lines.append(f"| {name} | {r['step_time_median_ms']:.1f} ms ({r['step_time_ratio_to_none']:.2f}x) | "
                     f"{r['training_thread_per_step_median_ms']:.2f} ms | {r['background_per_step_ms']:.2f} ms |")
    lines += ["", "| checkpoints to | stall per checkpoint (median) | resume read (cold) |", "|---|---:|---:|"]
    for name, r in storage.items():
        lines.append(f"| {name} | {r['stall_per_checkpoint_median_s']:.3f} s | {r['resume_read_s']:.3f} s |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(cpu_threads())
    root = Path(tempfile.mkdtemp(prefix="vela-trackers-storage-"))
    start = time.perf_counter()
    try:
        trackers = tracker_rows(args, root)
        storage = storage_rows(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "command": command(__file__, argv), "settings": vars(args), "model": str(tiny_model_path()),
        "data": str(SHAKESPEARE), "pool": "in-process (InProcessPool)", "cpus": os.cpu_count(),
        "load_average_1min_at_end": os.getloadavg()[0], "benchmark_wall_s": time.perf_counter() - start,
        "trackers": trackers, "storage": storage,
        "what": {
            "training_thread_per_step_median_ms": "what a step waits for: the workers' compute report and the "
                                                  "queued metrics (median over steps)",
            "background_per_step_ms": "the tracker's own time per step on the background thread (overlaps the "
                                      "next steps)",
            "stall_per_checkpoint_median_s": "seconds training stood still per checkpoint (sync writes)",
            "resume_read_s": "find the newest verified checkpoint, download it and check every sha256 (S3), read "
                             "the backbone and every expert's state; local copy cache emptied first",
        },
    }
    write_results(args.results, results)
    print(table(trackers, storage))


if __name__ == "__main__":
    run(main, quiet=["vela_ray"])
