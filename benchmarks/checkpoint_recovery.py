"""Checkpoint size and write time on the demo model, and recovery after a killed ExpertManager.

Runs the demo job (tiny pre-trained Mixtral, Tiny Shakespeare, 3 workers) with a
checkpoint every `--every` steps, SIGKILLs ExpertManager 1 right after the first
checkpoint, and measures: how long until the run stops with WorkerLostError,
and how long `--resume latest` takes from start to its first training step.

    python benchmarks/checkpoint_recovery.py --steps 20 --every 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import ray

from vela_ray.training import checkpoint
from vela_ray.api import VelaJob
from vela_ray.demo import demo_config
from vela_ray.training.summary import RunSummary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of the job")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="vela-recovery-"))
    base = demo_config(out, steps=args.steps)
    config = base.model_copy(update={"checkpoint": base.checkpoint.model_copy(update={"every": args.every})})
    killed: dict[str, float] = {}
    threading.Thread(target=_kill_after_first_checkpoint, args=(out, killed), daemon=True).start()
    try:
        VelaJob(config).run()
        raise SystemExit("the job finished before the worker was killed; use more --steps")
    except ray.exceptions.RayTaskError as err:
        stopped = time.monotonic()
        assert "WorkerLostError" in type(err).__name__ or "died" in str(err), err
    last = checkpoint.latest(config.checkpoint_root)
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    start = time.monotonic()
    VelaJob(config.with_resume("latest")).run()
    resume_total = time.monotonic() - start
    resume_to_first_step = resume_total - RunSummary.load(out).timings_s["train_s"]
    result = {
        "checkpoint_bytes": size,
        "checkpoint": str(last),
        "detect_seconds": stopped - killed["at"],
        "resume_to_first_step_seconds": resume_to_first_step,
        "recovery_seconds": stopped - killed["at"] + resume_to_first_step,
        "write_seconds": _write_seconds(config.checkpoint_root),
    }
    print(json.dumps(result, indent=1))
    Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/results/checkpoint_recovery.json").write_text(json.dumps(result, indent=1))


def _kill_after_first_checkpoint(out: Path, killed: dict) -> None:
    while True:
        workers = out / "workers.json"
        if workers.is_file() and checkpoint.latest(out / "checkpoints") is not None:
            os.kill(json.loads(workers.read_text())["pids"][1], signal.SIGKILL)
            killed["at"] = time.monotonic()
            return
        time.sleep(0.02)


def _write_seconds(root: Path) -> float:
    """Time to write one checkpoint: its newest file's mtime minus its oldest (staging to manifest)."""
    last = checkpoint.latest(root)
    times = [p.stat().st_mtime for p in last.rglob("*") if p.is_file()]
    return max(times) - min(times)


if __name__ == "__main__":
    main()
