"""Zeroth-order vs first-order training: bytes moved and memory per step, same model and batch.

The cached tiny pre-trained Mixtral (`vela build-tiny-model`), LoRA r=8 on attention and every
expert, its experts on 3 in-process ExpertManagers (sequential placement), one batch of WikiText-2
rows (`--batch-size` x `--seq-len` tokens, one micro-batch). Each method runs `--steps` steps in a
fresh subprocess of its own (nothing allocated by one method can hide in the other's numbers):
first_order is `train_step` (forward, backward, AdamW), zo is `ZoTrainer.step` (two no-grad
forwards, the update fused into the next step's first pass). Per step:

- bytes moved between the master and the workers, by direction, from the broker's counters
  (`vela_ray.model.traffic`): dispatch, gather, grad_dispatch, grad_gather;
- step_peak_MiB: the process's resident-set high-water mark during the step (VmHWM, reset before
  the step through /proc/self/clear_refs) minus its resident set just before it: the memory the
  step itself needed on top of what was already resident (activations, gradients, temporaries,
  optimizer state created in the step). The child runs with MALLOC_MMAP_THRESHOLD_=65536, so
  freed tensors go back to the OS and do not mask the next step's peak; CPU only (no CUDA stats);
- saved_for_backward_MiB: distinct tensor storages autograd kept for backward during the step,
  master and workers alike (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded: the
  activations a first-order step holds; none for zo, which keeps no graph.

Printed as a table and written to `--results`:

    python benchmarks/zo_memory.py --results benchmarks/results/zo_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/zo_memory.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import (  # noqa: E402
    MEASURED_ENV, WIKITEXT, command, parser, reset_peak, run, status_kib, write_results)
from placement import sequential_table  # noqa: E402
from vela_ray.data.config import DataConfig  # noqa: E402
from vela_ray.data.datasets import batch_at, build_dataset  # noqa: E402
from vela_ray.model.experts import LoraSpec  # noqa: E402
from vela_ray.model.modeling import find_moe_blocks  # noqa: E402
from vela_ray.model.traffic import DIRECTIONS  # noqa: E402
from vela_ray.training.schedule import OptimizerConfig  # noqa: E402
from vela_ray.training.master import build_local  # noqa: E402
from vela_ray.training.step import train_step  # noqa: E402
from vela_ray.training.tiny_model import tiny_model_path  # noqa: E402
from vela_ray.training.zo import ZoTrainer  # noqa: E402

METHODS = ("first_order", "zo")
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, Path("benchmarks/results/zo_memory.json"), flag="--results",
               what="where to write the results JSON")
    p.add_argument("--steps", type=int, default=3, help="steps per method (the same batch every step)")
    p.add_argument("--batch-size", type=int, default=8, help="rows of the batch")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--workers", type=int, default=3, help="in-process ExpertManagers")
    p.add_argument("--eps", type=float, default=1e-3, help="ZO perturbation scale (training.zo.eps)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of both methods")
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)  # internal: measure one method here
    return p.parse_args(argv)


# --- memory probes (Linux /proc) ---------------------------------------------------------------------------


class SavedForBackward:
    """Distinct storages autograd saves for backward while active, parameters' own storages excluded."""

    def __init__(self, parameter_ptrs: set[int]):
        self.parameter_ptrs = parameter_ptrs
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameter_ptrs:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


# --- one method, in its own process ------------------------------------------------------------------------


def setup(args):
    """Model, master + in-process workers, the batch, and the storages of every parameter and buffer."""
    model_dir = tiny_model_path(build=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = DataConfig(kind="text", path=WIKITEXT, seq_len=args.seq_len, limit=4 * args.batch_size)
    data = build_dataset(text, tokenizer)
    batch = batch_at(data, 0, args.batch_size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    blocks = find_moe_blocks(model)
    table = sequential_table(len(blocks), blocks[0].layout.num_experts, args.workers)
    master, workers = build_local(model, table, LoraSpec(8, 16), OptimizerConfig(lr=args.lr), seed=0)
    tensors = [*master.peft_model.parameters(), *master.peft_model.buffers()]
    for manager in master.dispatcher.transport.shards:
        tensors += [*manager.shard.parameters(), *manager.shard.buffers()]
    return master, workers, batch, {t.untyped_storage().data_ptr() for t in tensors}


def measure(args) -> dict:
    torch.set_num_threads(1)
    master, workers, batch, parameter_ptrs = setup(args)
    dispatcher, zo = master.dispatcher, ZoTrainer(args.eps, seed=0)
    steps = []
    for step in range(args.steps):
        before, saved = dispatcher.traffic(), SavedForBackward(parameter_ptrs)
        rss_before = status_kib("VmRSS")
        reset_peak()
        start = time.perf_counter()
        with saved.hooks:
            if args.child == "zo":
                loss = zo.step(master, workers, [batch], args.lr, step).loss
            else:
                loss = train_step(master, workers, [batch], args.lr, max_grad_norm=1.0)
        seconds = time.perf_counter() - start
        peak = status_kib("VmHWM")
        moved = np.asarray((dispatcher.traffic() - before).bytes).sum(axis=(0, 1))
        steps.append({"loss": loss, "seconds": seconds, "rss_before_MiB": rss_before / 1024,
                      "step_peak_MiB": (peak - rss_before) / 1024, "saved_for_backward_MiB": saved.nbytes / MiB,
                      "bytes": {d: int(b) for d, b in zip(DIRECTIONS, moved)}})
    zo.settle(master, workers)
    return {"method": args.child, "steps": steps, "process_peak_MiB": status_kib("VmHWM") / 1024}


# --- both, side by side ------------------------------------------------------------------------------------


def run_child(argv: list[str], method: str) -> dict:
    env = {**os.environ, **MEASURED_ENV}
    done = subprocess.run([sys.executable, __file__, *argv, "--child", method], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def view(run: dict) -> dict:
    """Per-method figures: the steps after the first (which also builds AdamW's state and warms caches)."""
    later = run["steps"][1:] or run["steps"]
    bytes_by_direction = later[-1]["bytes"]
    return {
        "bytes_per_step": sum(bytes_by_direction.values()),
        "bytes_per_step_by_direction": bytes_by_direction,
        "step_peak_MiB": max(s["step_peak_MiB"] for s in later),
        "first_step_peak_MiB": run["steps"][0]["step_peak_MiB"],
        "saved_for_backward_MiB": max(s["saved_for_backward_MiB"] for s in later),
        "resident_before_step_MiB": later[-1]["rss_before_MiB"],
        "process_peak_MiB": run["process_peak_MiB"],
        "median_step_s": float(np.median([s["seconds"] for s in later])),
        "losses": [s["loss"] for s in run["steps"]],
    }


def table(rows: dict[str, dict]) -> str:
    lines = ["| method | MiB moved/step | of it grad_* | step peak MiB (first step) | saved for backward MiB | "
             "resident before step MiB | process peak MiB | s/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for method, r in rows.items():
        grads = r["bytes_per_step_by_direction"]["grad_dispatch"] + r["bytes_per_step_by_direction"]["grad_gather"]
        lines.append(f"| {method} | {r['bytes_per_step'] / MiB:.1f} | {grads / MiB:.1f} | {r['step_peak_MiB']:.1f} "
                     f"({r['first_step_peak_MiB']:.1f}) | {r['saved_for_backward_MiB']:.1f} | "
                     f"{r['resident_before_step_MiB']:.1f} | {r['process_peak_MiB']:.1f} | {r['median_step_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return
    tiny_model_path()  # build it once here (a few minutes) if the cache lacks it, not in each child
    start = time.perf_counter()
    runs = {method: run_child(argv, method) for method in METHODS}
    rows = {method: view(run) for method, run in runs.items()}
    results = {"command": command(__file__, argv), "settings": {k: v for k, v in vars(args).items() if k != "child"},
               "model": str(tiny_model_path(build=False)), "data": str(WIKITEXT), "torch_threads": 1,
               "benchmark_wall_s": time.perf_counter() - start, "methods": rows, "raw": runs}
    write_results(args.results, results)
    print(table(rows))


if __name__ == "__main__":
    run(main)
