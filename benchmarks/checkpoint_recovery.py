"""Recovery from a killed ExpertManager, in place vs stop-and-resume; job setup with migration vs two spawns.

One run on the demo job (tiny pre-trained Mixtral, Tiny Shakespeare, 3 ExpertManagers,
a checkpoint every `--every` steps), all on one local Ray started as `VelaJob` starts it:

  * reference: the job uninterrupted; its losses are what the recovered runs must equal.
  * in place (`fault_tolerance.on_worker_loss: recover`): SIGKILL ExpertManager 1 as soon as the
    checkpoint of step `--every` is published; the run replaces the worker, rolls back to
    that checkpoint, replays and finishes. Kill to next step = `recoveries[0].restored_at`
    minus the kill's `time.time()` (master and benchmark share this machine's clock).
  * stop-and-resume (`on_worker_loss: stop`, the default): the same kill; the run stops with
    WorkerLostError, then `--resume latest` runs to the end. Kill to next step = detection
    plus the resumed run's start to its first step (the final checkpoint's manifest mtime
    minus the resumed run's `train_s`: the training loop ends right after that write).
  * job setup: on a `RayWorkerPool` directly, `start(sequential)` then `start(solved)` (the
    old behaviour: respawn every worker) against `start(sequential)` then `migrate(solved)`
    (move only the experts that change worker), `--repeats` times each. The solved table is
    `placement.solve(improved)` on the Tiny Shakespeare routing profile measured on this
    model (`benchmarks/results/locality/P_shakespeare.npy`) with equal links.

Also the size and write time of one checkpoint. Writes a flat JSON (each figure's meaning
under "what") to `--results`:

    python benchmarks/checkpoint_recovery.py --steps 20 --every 5 --repeats 3
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import ray

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/checkpoint_recovery.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(REPO))

from actors.pool import RayWorkerPool  # noqa: E402
from benchmarks._harness import command, kill_when, parser, run, write_results  # noqa: E402
from placement import sequential_table, solve  # noqa: E402
from vela_ray.api import VelaJob  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.demo import demo_config  # noqa: E402
from vela_ray.errors import WorkerLostError  # noqa: E402
from vela_ray.runtime.placer import placement_problem  # noqa: E402
from vela_ray.runtime.state import Backbone  # noqa: E402
from vela_ray.training import checkpoint  # noqa: E402
from vela_ray.training.summary import LinkRecord, RunSummary  # noqa: E402

PROFILE = REPO / "benchmarks" / "results" / "locality" / "P_shakespeare.npy"
KILLED_WORKER = 1  # kill_when's victim


def main() -> None:
    p = parser(__doc__, "benchmarks/results/checkpoint_recovery.json", flag="--results",
               what="where to write the results JSON")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of the job")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (the kill follows the first)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each job-setup variant")
    p.add_argument("--out", default=None, help="directory for the runs (default: a temp dir)")
    args = p.parse_args()
    if args.every >= args.steps:
        p.error("--every must be below --steps: the kill follows the checkpoint of step --every")
    out = Path(args.out or tempfile.mkdtemp(prefix="vela-recovery-"))

    ray_init_s = _connect()
    try:
        reference_cfg = _job_config(out / "reference", args.steps, args.every)
        start = time.time()
        reference = VelaJob(reference_cfg).run()
        reference_s = time.time() - start
        in_place = _in_place(_job_config(out / "in_place", args.steps, args.every, on_worker_loss="recover"),
                             args.every, reference)
        stop_resume = _stop_and_resume(_job_config(out / "stop_resume", args.steps, args.every), args.every,
                                       reference)
        setup = _setup_times(_job_config(out / "pool", args.steps, args.every), args.repeats)
    finally:
        ray.shutdown()

    start_migration = next((m for m in reference.migrations if m.reason == "start"), None)
    result = {
        "command": command(__file__),
        "steps": args.steps,
        "checkpoint_every": args.every,
        "killed_worker": KILLED_WORKER,
        "cpus": os.cpu_count(),
        "ray_init_seconds": ray_init_s,
        "reference_run_seconds": reference_s,
        "reference_median_step_seconds": reference.median_step_time_s,
        "reference_start_migration_moved": start_migration.moved if start_migration else 0,
        "reference_start_migration_seconds": start_migration.seconds if start_migration else 0.0,
        **in_place,
        **stop_resume,
        "kill_to_next_step_ratio_in_place_over_stop_resume":
            in_place["in_place_kill_to_next_step_seconds"] / stop_resume["recovery_seconds"],
        **setup,
    }
    result["what"] = {key: text for key, text in WHAT.items() if key in result}
    missing = [key for key in result if key not in WHAT and key != "what"]
    assert not missing, f"figures without a 'what': {missing}"
    print(write_results(args.results, result))


WHAT = {
    "command": "the command that produced this file",
    "steps": "optimizer steps of every job run",
    "checkpoint_every": "checkpoint interval (steps); the kill follows the checkpoint of this step",
    "killed_worker": "the ExpertManager SIGKILLed (index in the placement table)",
    "cpus": "CPU cores of the machine (Ray got all of them)",
    "ray_init_seconds": "ray.init of the one local Ray all runs share (not in any figure below; a `vela train "
                        "--resume` on a fresh local Ray pays it on top of resume_to_first_step_seconds)",
    "reference_run_seconds": "wall time of the uninterrupted reference job (VelaJob.run, Ray already up)",
    "reference_median_step_seconds": "median optimizer step time of the reference job",
    "reference_start_migration_moved": "experts the reference job moved at its start (sequential -> solved placement)",
    "reference_start_migration_seconds": "seconds of that start migration inside the job",
    # in place
    "in_place_kill_to_next_step_seconds": "on_worker_loss=recover: kill -> the first replayed step begins "
                                          "(recoveries[0].restored_at - kill time)",
    "in_place_detect_seconds": "kill -> the master starts recovering (restored_at - recoveries[0].seconds - kill)",
    "in_place_recovery_seconds": "recoveries[0].seconds: replacement worker up and every worker + the master "
                                 "restored to the checkpoint",
    "in_place_failed_step": "the step that failed (recoveries[0].step)",
    "in_place_checkpoint_step": "the checkpoint it rolled back to (recoveries[0].checkpoint_step)",
    "in_place_steps_replayed": "steps run again after the recovery (failed step - checkpoint step)",
    "in_place_run_seconds": "wall time of the whole recovering job, kill and replay included",
    "in_place_max_rel_loss_diff": "max over steps of |loss - reference loss| / |reference loss| (0: identical)",
    # stop and resume
    "checkpoint_bytes": "size of the checkpoint resumed from (all files)",
    "checkpoint": "that checkpoint",
    "write_seconds": "time to write it: newest file mtime minus oldest (staging to manifest)",
    "detect_seconds": "on_worker_loss=stop: kill -> VelaJob.run raised WorkerLostError on the driver",
    "resume_to_first_step_seconds": "`--resume latest` VelaJob.run called -> its first step begins (final "
                                    "checkpoint manifest mtime - train_s); Ray already up",
    "resume_total_minus_train_seconds": "the resumed run's wall time minus its train_s (the old, looser figure: "
                                        "also counts export and report after training)",
    "recovery_seconds": "stop-and-resume kill -> next step: detect_seconds + resume_to_first_step_seconds",
    "stop_resume_failed_step": "the step the WorkerLostError names",
    "stop_resume_checkpoint_step": "the checkpoint `--resume latest` continued from",
    "stop_resume_steps_replayed": "steps run again after the resume (failed step - checkpoint step)",
    "resume_run_seconds": "wall time of the resumed run (VelaJob.run, Ray already up)",
    "stop_resume_max_rel_loss_diff": "the resumed run's losses vs the reference's from the checkpoint on: "
                                     "max relative difference",
    "kill_to_next_step_ratio_in_place_over_stop_resume": "in_place_kill_to_next_step_seconds / recovery_seconds",
    # job setup
    "setup_pool": "RayWorkerPool over the demo config (3 ExpertManagers x 0.5 CPU, object-ref transport), "
                  "driven from the driver; the pool is closed after each repetition (not timed)",
    "setup_table_source": "where the solved table comes from",
    "setup_moved_experts": "experts whose worker differs between the sequential and the solved table",
    "setup_experts_per_worker_sequential": "experts per worker, sequential table",
    "setup_experts_per_worker_solved": "experts per worker, solved table",
    "setup_repeats": "repetitions of each variant (interleaved, order alternating)",
    "setup_two_spawns_seconds": "per repeat: pool.start(sequential) + pool.start(solved) (old: respawn all)",
    "setup_spawn_migrate_seconds": "per repeat: pool.start(sequential) + pool.migrate(solved) (new)",
    "setup_respawn_seconds": "per repeat: the second pool.start(solved) alone (closing the first workers included)",
    "setup_migrate_seconds": "per repeat: pool.migrate(solved) alone",
    "setup_two_spawns_median_seconds": "median of setup_two_spawns_seconds",
    "setup_spawn_migrate_median_seconds": "median of setup_spawn_migrate_seconds",
    "setup_respawn_median_seconds": "median of setup_respawn_seconds",
    "setup_migrate_median_seconds": "median of setup_migrate_seconds",
    "setup_ratio_migration_over_two_spawns": "setup_spawn_migrate_median_seconds / setup_two_spawns_median_seconds",
    "setup_ratio_migrate_over_respawn": "setup_migrate_median_seconds / setup_respawn_median_seconds",
    "setup_hosted_checked": "after each migrate, every worker's expert count matched the solved table",
}


def _connect() -> float:
    """Start Ray as `VelaJob` does (vela_ray.api): RAY_ADDRESS if set, else a local Ray on this machine's
    cores. Every run below shares it (VelaJob leaves an initialized Ray alone); returns seconds taken."""
    start = time.perf_counter()
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, runtime_env=env, log_to_driver=True)
    return time.perf_counter() - start


def _job_config(out: Path, steps: int, every: int, **fault_tolerance) -> JobConfig:
    base = demo_config(out, steps=steps)
    return base.model_copy(update={
        "checkpoint": base.checkpoint.model_copy(update={"every": every}),
        "fault_tolerance": base.fault_tolerance.model_copy(update=fault_tolerance),
    })


def _kill_after_checkpoint(config: JobConfig, step: int) -> tuple[threading.Thread, dict]:
    """kill_when: SIGKILL worker KILLED_WORKER once the checkpoint of `step` is published (renamed into place
    after its manifest)."""
    return kill_when(config.output.dir, (config.checkpoint_root / f"step-{step:06d}").is_dir)


def _in_place(config: JobConfig, every: int, reference: RunSummary) -> dict:
    killer, killed = _kill_after_checkpoint(config, every)
    start = time.time()
    summary = VelaJob(config).run()
    run_s = time.time() - start
    killer.join(timeout=10)
    if not killed or not summary.recoveries:
        raise SystemExit("in place: the job finished before the worker was killed; use more --steps")
    recovery = summary.recoveries[0]
    return {
        "in_place_kill_to_next_step_seconds": recovery.restored_at - killed["wall"],
        "in_place_detect_seconds": recovery.restored_at - recovery.seconds - killed["wall"],
        "in_place_recovery_seconds": recovery.seconds,
        "in_place_failed_step": recovery.step,
        "in_place_checkpoint_step": recovery.checkpoint_step,
        "in_place_steps_replayed": recovery.step - recovery.checkpoint_step,
        "in_place_run_seconds": run_s,
        "in_place_max_rel_loss_diff": _max_rel_diff(summary.losses, reference.losses),
    }


def _stop_and_resume(config: JobConfig, every: int, reference: RunSummary) -> dict:
    _, killed = _kill_after_checkpoint(config, every)
    try:
        VelaJob(config).run()
        raise SystemExit("stop-and-resume: the job finished before the worker was killed; use more --steps")
    except WorkerLostError as err:
        stopped = time.time()
        message = err.message
    failed = re.search(r"during step (\d+)", message)
    last = checkpoint.latest(config.checkpoint_root)
    done = int(checkpoint.verify(last, checksums=False)["step"])
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    write_s = _write_seconds(last)
    start = time.time()
    summary = VelaJob(config.with_resume("latest")).run()
    resume_s = time.time() - start
    train_s = float(summary.timings_s["train_s"])
    final_manifest = config.checkpoint_root / f"step-{config.training.steps:06d}" / checkpoint.MANIFEST
    first_step_at = final_manifest.stat().st_mtime - train_s
    detect_s, to_first_step = stopped - killed["wall"], first_step_at - start
    failed_step = int(failed.group(1)) if failed else None
    return {
        "checkpoint_bytes": size,
        "checkpoint": str(last),
        "write_seconds": write_s,
        "detect_seconds": detect_s,
        "resume_to_first_step_seconds": to_first_step,
        "resume_total_minus_train_seconds": resume_s - train_s,
        "recovery_seconds": detect_s + to_first_step,
        "stop_resume_failed_step": failed_step,
        "stop_resume_checkpoint_step": done,
        "stop_resume_steps_replayed": None if failed_step is None else failed_step - done,
        "resume_run_seconds": resume_s,
        "stop_resume_max_rel_loss_diff": _max_rel_diff(summary.losses, reference.losses[done:]),
    }


def _write_seconds(path: Path) -> float:
    """Time to write one checkpoint: its newest file's mtime minus its oldest (staging to manifest)."""
    times = [p.stat().st_mtime for p in path.rglob("*") if p.is_file()]
    return max(times) - min(times)


def _max_rel_diff(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        raise SystemExit(f"{len(losses)} losses against {len(reference)} of the reference")
    a, b = np.asarray(losses, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def _tables(config: JobConfig) -> tuple[np.ndarray, np.ndarray, str]:
    """The sequential table and a solved one for the demo model (shape checked against the profile)."""
    backbone = Backbone.load(config)
    probs = np.load(PROFILE)
    if probs.shape != backbone.shape:
        raise SystemExit(f"{PROFILE} is {probs.shape} but the demo model has (layers, experts) = {backbone.shape}")
    workers = config.cluster.num_workers
    equal_links = [LinkRecord(latency_s=0.0, bandwidth_bytes_per_s=1e9)] * workers
    tokens = config.training.batch_size * config.data.seq_len
    problem = placement_problem(tokens, config.torch_dtype, backbone, probs, equal_links,
                                capacities=[probs.size] * workers, worker_nodes=["local"] * workers,
                                master_node="local")
    solved = solve(problem, "improved", seed=config.placement.seed).as_array()
    source = (f"placement.solve(improved, seed {config.placement.seed}) on {PROFILE.relative_to(REPO)} "
              f"(the demo model's Tiny Shakespeare routing, {probs.shape[0]}x{probs.shape[1]}), {workers} workers, "
              "equal links, communication cost model, capacities unbounded")
    return sequential_table(*probs.shape, workers), solved, source


def _setup_times(config: JobConfig, repeats: int) -> dict:
    sequential, solved, source = _tables(config)
    workers = config.cluster.num_workers
    pool = RayWorkerPool(config, ray.get_runtime_context().get_node_id())
    times: dict[str, list[tuple[float, float]]] = {"respawn": [], "migrate": []}
    checked = True

    def respawn() -> None:
        pool.start(solved)

    def migrate() -> None:
        nonlocal checked
        pool.migrate(solved)
        hosted = [r.num_experts for r in ray.get([h.report.remote() for h in pool.cluster.handles])]
        checked &= hosted == np.bincount(solved.ravel(), minlength=workers).tolist()

    variants: dict[str, Callable[[], None]] = {"respawn": respawn, "migrate": migrate}
    try:
        for repeat in range(repeats):
            order = ["respawn", "migrate"] if repeat % 2 == 0 else ["migrate", "respawn"]
            for name in order:
                start = time.perf_counter()
                pool.start(sequential)
                spawned = time.perf_counter()
                variants[name]()
                times[name].append((time.perf_counter() - start, time.perf_counter() - spawned))
                pool.close()
    finally:
        pool.close()
    total = {name: [t for t, _ in runs] for name, runs in times.items()}
    second = {name: [s for _, s in runs] for name, runs in times.items()}
    medians = {name: float(np.median(v)) for name, v in total.items()}
    second_medians = {name: float(np.median(v)) for name, v in second.items()}
    return {
        "setup_pool": f"RayWorkerPool, {workers} ExpertManagers x {config.cluster.num_cpus_per_worker} CPU, "
                      f"transport {config.data_plane.transport}",
        "setup_table_source": source,
        "setup_moved_experts": int((sequential != solved).sum()),
        "setup_experts_per_worker_sequential": np.bincount(sequential.ravel(), minlength=workers).tolist(),
        "setup_experts_per_worker_solved": np.bincount(solved.ravel(), minlength=workers).tolist(),
        "setup_repeats": repeats,
        "setup_two_spawns_seconds": total["respawn"],
        "setup_spawn_migrate_seconds": total["migrate"],
        "setup_respawn_seconds": second["respawn"],
        "setup_migrate_seconds": second["migrate"],
        "setup_two_spawns_median_seconds": medians["respawn"],
        "setup_spawn_migrate_median_seconds": medians["migrate"],
        "setup_respawn_median_seconds": second_medians["respawn"],
        "setup_migrate_median_seconds": second_medians["migrate"],
        "setup_ratio_migration_over_two_spawns": medians["migrate"] / medians["respawn"],
        "setup_ratio_migrate_over_respawn": second_medians["migrate"] / second_medians["respawn"],
        "setup_hosted_checked": bool(checked),
    }


if __name__ == "__main__":
    run(main)
