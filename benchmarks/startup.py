"""Benchmark: time from a job's start to its first step, the workers launched before or after the backbone.

A vela-ray job starts its ExpertManagers (each reads its experts from the checkpoint) and loads the
master's backbone. `JobRunner.run` launches the workers first (`WorkerPool.launch`) and loads the
backbone while they come up; `start` then waits for them. This benchmark runs the same job both
ways, side by side in one Ray session, alternating:

    overlapped   `RayWorkerPool` as shipped: launch, load the backbone, wait for the workers
    in order     the same pool with `launch` deferred to `start`: load the backbone, then start
                 the workers and wait (the order before the overlap)

The model is Mixtral-8x7B's dimensions with `--layers` layers and random weights (bf16, written
once by `benchmarks/big_on_one_gpu.py`'s `write_random_checkpoint`), so the backbone (embeddings,
attention, lm_head) and the experts have their real sizes. The figure is
`summary.timings_s["startup_s"]`: from `run()` to the first step (workers up, placement probed and
solved, start state loaded); one step is trained. Both orders do the same work; only what
overlaps differs.

    python benchmarks/startup.py                       # 2 layers, 2 workers, 2 runs of each order
    python benchmarks/startup.py --layers 1 --repeats 3

Results: a table, and benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/startup.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from actors.pool import RayWorkerPool  # noqa: E402
from benchmarks._harness import SHAKESPEARE, command, parser, run, tiny_job, write_results  # noqa: E402
from benchmarks.big_on_one_gpu import mixtral_config, model_bytes, write_random_checkpoint  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.quiet import silence_known_warnings  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402
from vela_ray.training.tiny_model import train_tokenizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "startup.json"
logger = logging.getLogger("startup")


class InOrderPool(RayWorkerPool):
    """`RayWorkerPool` with nothing started before `start`: the workers load after the backbone."""

    def launch(self, table: np.ndarray) -> None:
        pass  # the runner's early launch is skipped

    def start(self, table: np.ndarray):
        RayWorkerPool.launch(self, table)
        return super().start(table)


ORDERS = {"overlapped": RayWorkerPool, "in order": InOrderPool}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, RESULTS)
    p.add_argument("--layers", type=int, default=2, help="of Mixtral-8x7B's 32 layers")
    p.add_argument("--workers", type=int, default=2, help="ExpertManagers (actors on this machine)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each order, alternating")
    args = p.parse_args(argv)
    args.tiny = False  # mixtral_config's full dimensions
    return args


def write_model(args, folder: Path) -> dict:
    """The random bf16 checkpoint and a small BPE tokenizer (its ids fit Mixtral's 32000)."""
    config = mixtral_config(args)
    folder.mkdir(parents=True)
    written = write_random_checkpoint(config, torch.bfloat16, folder, seed=0)
    train_tokenizer(SHAKESPEARE.read_text()[:200_000], 512).save_pretrained(folder)
    backbone, per_expert = model_bytes(config, torch.bfloat16)
    return {"checkpoint_bytes": written, "backbone_bytes": backbone,
            "expert_bytes": per_expert * config.num_local_experts * config.num_hidden_layers}


def job(args, model: Path, out: Path) -> JobConfig:
    return JobConfig.from_dict(tiny_job(  # its fixed placement: both orders do the same work
        out, model_dir=model, model={"dtype": "bfloat16"}, data={"seq_len": 32, "limit": 64},
        cluster={"num_workers": args.workers, "num_cpus_per_worker": 0.5}, lora={"r": 8, "alpha": 16},
        training={"steps": 1, "batch_size": 1}), source="startup benchmark")


def run_order(args, model: Path, out: Path, order: str) -> dict:
    config = job(args, model, out)
    config.preflight()
    pool = ORDERS[order](config, ray.get_runtime_context().get_node_id())
    start = time.perf_counter()
    summary = JobRunner(config, pool).run()
    timings = summary.timings_s
    logger.info("%s: first step after %.1f s (placement %.1f s), run %.1f s", order, timings["startup_s"],
                timings["placement_s"], time.perf_counter() - start)
    return {"startup_s": timings["startup_s"], "placement_s": timings["placement_s"],
            "run_s": time.perf_counter() - start}


def main(argv=None) -> None:
    args = parse_args(argv)
    silence_known_warnings()
    root = Path(tempfile.mkdtemp(prefix="vela-startup-"))
    try:
        sizes = write_model(args, root / "model")
        ray.init(include_dashboard=False, log_to_driver=False)
        runs: dict[str, list[dict]] = {order: [] for order in ORDERS}
        for repeat in range(args.repeats):
            for order in (list(ORDERS) if repeat % 2 == 0 else list(ORDERS)[::-1]):
                runs[order].append(run_order(args, root / "model", root / f"out-{len(runs[order])}-{order}", order))
        ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {order: statistics.median(r["startup_s"] for r in rs) for order, rs in runs.items()}
    results = {"command": command(__file__, argv), "settings": {k: str(v) for k, v in vars(args).items()},
               "sizes": sizes, "runs": runs, "median_startup_s": medians,
               "overlapped_over_in_order": medians["overlapped"] / medians["in order"]}
    write_results(args.out, results)
    print(f"Mixtral-8x7B dimensions, {args.layers} layer(s), bf16: backbone {sizes['backbone_bytes'] / 2**30:.2f} "
          f"GiB, experts {sizes['expert_bytes'] / 2**30:.2f} GiB over {args.workers} workers")
    print("| order | first step after (median s) | runs |\n|---|---:|---|")
    for order, rs in runs.items():
        each = ", ".join(f"{r['startup_s']:.1f}" for r in rs)
        print(f"| {order} | {medians[order]:.1f} | {each} |")
    print(f"overlapped / in order: {results['overlapped_over_in_order']:.2f}  ->  {args.out}")


if __name__ == "__main__":
    run(main, quiet=["vela_ray"])
