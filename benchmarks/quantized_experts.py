"""Quantized frozen weights (`model.quantization`): bytes per expert, expert compute time, loss, and what the
bytes buy the placement.

Three parts, each side by side against the bf16 baseline in one run:

1. Jobs: the cached tiny pre-trained Mixtral (`vela build-tiny-model`: hidden 128, 8 experts of [256, 128] stacks)
   fine-tuned with LoRA on WikiText-2 in bf16 (`model.dtype: bfloat16`), once at full width and once per format
   (`--formats`), same seed, data, schedule and placement, in one process (vela-ray's JobRunner over in-process
   ExpertManagers). Per run: the frozen bytes of one expert (what a worker holds for it), the bytes one hosted
   expert needs with its LoRA, gradient and AdamW moments (`RunSummary.bytes_per_expert`, what the placement's
   capacity is sized by), the experts' bytes on the busiest worker, median step time, final training loss (mean
   of the last 10 steps), eval loss, and each against bf16's.
2. Expert compute: one layer's experts (all 8, one shard) forward + backward over `--rows` rows routed top-2, best
   of 5, in bf16 and in each format: the cost of dequantizing at each use (CPU here; `--device cuda` on a GPU).
3. Placement: `benchmarks/paper_scale.py`'s Mixtral-8x7B cluster (3 nodes x 2 GPUs, one master, 18.3 / 1.17 GB/s),
   its worker memory held fixed and filled with experts of each format's bytes (an fp16 expert is 352 MB; the
   "loose" budget holds 64 of them per GPU, "tight" 43): more experts per worker, and the cross-node bytes per node
   per step of the improved placement on each measured routing profile.

What the figures leave out: the master's memory (its backbone's linears are held in the format too in part 1, but
only the workers' bytes are reported), activations, and the page cache of the checkpoint read.

    python benchmarks/quantized_experts.py --steps 100    # ~10 min on 2 cores
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
if str(ROOT) not in sys.path:  # run as `python benchmarks/quantized_experts.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks import paper_scale  # noqa: E402
from benchmarks._harness import WIKITEXT, command, parser, run, tiny_job, write_results  # noqa: E402
from placement import cost_report, solve  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.model.experts import ExpertShard, LoraSpec  # noqa: E402
from vela_ray.model.loading import checkpoint_prototypes, read_experts  # noqa: E402
from vela_ray.model.quantization import FORMATS  # noqa: E402
from vela_ray.model.quantized_model import (  # noqa: E402
    QuantizationSpec, frozen_bytes_per_expert, quantize_expert_params,
)
from vela_ray.runtime.local import InProcessPool  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402
from vela_ray.training.tiny_model import tiny_model_path  # noqa: E402

logger = logging.getLogger("quantized_experts")
RESULTS = ROOT / "benchmarks" / "results" / "quantized_experts" / "results.json"
BASELINE = "bf16"
# Mixtral-8x7B's expert: gate_up [2 x 14336, 4096] and down [4096, 14336]
MIXTRAL_STACKS = ((2 * 14336, 4096), (4096, 14336))
FP16_EXPERT_BYTES = sum(o * i for o, i in MIXTRAL_STACKS) * 2


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, RESULTS)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per job")
    p.add_argument("--formats", default="fp8,int8,nf4", help="comma-separated formats to compare with bf16")
    p.add_argument("--rows", type=int, default=2048, help="rows through one layer's experts in part 2")
    p.add_argument("--device", default="cpu", help="where part 2 computes (cpu or cuda)")
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def job(out: Path, fmt: str, steps: int, lr: float) -> JobConfig:
    quantization = {"format": "none" if fmt == BASELINE else fmt}
    raw = tiny_job(out, model={"dtype": "bfloat16", "quantization": quantization},
                   data={"path": str(WIKITEXT), "seq_len": 128, "limit": 1200},
                   training={"steps": steps, "batch_size": 8, "eval_batches": 8, "log_every": 10,
                             "optimizer": {"lr": lr, "warmup_steps": 3}})
    return JobConfig.from_dict(raw, source=f"quantized_experts {fmt}")


def frozen_expert_bytes(fmt: str, prototype) -> int:
    """Bytes a worker holds for one expert's frozen tensors: bf16, or the format's parts."""
    return frozen_bytes_per_expert(prototype, None if fmt == BASELINE else fmt, torch.bfloat16)


def jobs(args, formats: list[str], root: Path) -> dict:
    prototype = checkpoint_prototypes(tiny_model_path())[0]
    out = {}
    for fmt in formats:
        config = job(root / fmt, fmt, args.steps, args.lr)
        start = time.perf_counter()
        summary = JobRunner(config, InProcessPool(config)).run()
        wall = time.perf_counter() - start
        hosted = np.bincount(np.asarray(summary.placement.expert_to_worker).ravel())
        out[fmt] = {
            "frozen_bytes_per_expert": frozen_expert_bytes(fmt, prototype),
            "bytes_per_expert_with_lora_state": summary.bytes_per_expert,
            "experts_on_busiest_worker": int(hosted.max()),
            "frozen_bytes_on_busiest_worker": int(hosted.max()) * frozen_expert_bytes(fmt, prototype),
            "median_step_s": summary.median_step_time_s,
            "final_loss": float(np.mean(summary.losses[-10:])),
            "eval_loss": summary.eval_loss,
            "wall_s": wall,
        }
        logger.info("%s: %d B/expert, loss %.4f, eval %.4f, %.3f s/step", fmt, out[fmt]["frozen_bytes_per_expert"],
                    out[fmt]["final_loss"], summary.eval_loss, summary.median_step_time_s)
    base = out[BASELINE]
    for row in out.values():
        row["frozen_bytes_vs_bf16"] = row["frozen_bytes_per_expert"] / base["frozen_bytes_per_expert"]
        row["final_loss_vs_bf16"] = row["final_loss"] / base["final_loss"] - 1
        row["eval_loss_vs_bf16"] = row["eval_loss"] / base["eval_loss"] - 1
        row["step_time_vs_bf16"] = row["median_step_s"] / base["median_step_s"]
    return out


def expert_compute(args, formats: list[str]) -> dict:
    """One layer's 8 experts, forward + backward over `args.rows` rows, best of 5, per format."""
    model_dir = tiny_model_path()
    prototypes = checkpoint_prototypes(model_dir)
    num_experts = next(iter(prototypes[0].parameters())).shape[0]
    weights = read_experts(model_dir, [(0, e) for e in range(num_experts)], dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:2] for _ in range(args.rows)]).ravel()
    device = torch.device(args.device)
    hidden = prototypes[0].gate_up_proj.shape[-1] if not getattr(prototypes[0], "is_transposed", False) \
        else prototypes[0].gate_up_proj.shape[1]
    rows = torch.randn(len(ids), hidden, generator=generator).to(device, torch.bfloat16)
    out = {}
    for fmt in formats:
        held = weights if fmt == BASELINE else {k: quantize_expert_params(w, prototypes[0], QuantizationSpec(fmt))
                                                 for k, w in weights.items()}
        shard = ExpertShard.from_weights(held, LoraSpec(r=8, alpha=16), prototypes, seed=0,
                                         dtype=torch.bfloat16).to(device)
        timings = []
        for attempt in range(6):
            start = time.perf_counter()
            shard.forward_rows(0, ids, rows, key=attempt)
            shard.backward_rows(attempt, torch.ones_like(rows))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timings.append(time.perf_counter() - start)
        out[fmt] = {"seconds": min(timings[1:]), "rows": len(ids)}
    for row in out.values():
        row["vs_bf16"] = row["seconds"] / out[BASELINE]["seconds"]
    return out


def placement_effect(formats: list[str]) -> dict:
    """paper_scale's cluster with each GPU's expert memory held fixed: experts per worker and cross-node bytes."""
    out = {}
    for budget_name, fp16_experts in paper_scale.CAPACITIES.items():
        memory = fp16_experts * FP16_EXPERT_BYTES
        for data_set, file in paper_scale.DATASETS.items():
            probs = paper_scale.mixtral_probs(np.load(paper_scale.PROFILES / file))
            key = f"{data_set} / {budget_name} ({memory / 1e9:.1f} GB per GPU)"
            out[key] = {}
            for fmt in formats:
                expert_bytes = FP16_EXPERT_BYTES if fmt == BASELINE else sum(
                    FORMATS[fmt].nbytes(s) for s in MIXTRAL_STACKS)
                capacity = min(int(memory // expert_bytes), paper_scale.LAYERS * paper_scale.EXPERTS)
                problem = paper_scale.problem_for(probs, capacity)
                table = solve(problem, "improved", seed=0).as_array()
                report = cost_report(problem, table)
                out[key][fmt] = {"expert_mb": expert_bytes / 1e6, "experts_per_worker": capacity,
                                 "cross_node_mb_per_node": report.cross_node_bytes / len(set(paper_scale.NODES)) / 1e6,
                                 "experts_on_master_node": int(np.isin(table, [0, 1]).sum())}
            base = out[key][BASELINE]["cross_node_mb_per_node"]
            for row in out[key].values():
                row["cross_node_vs_bf16"] = row["cross_node_mb_per_node"] / base if base else None
    return out


def markdown(results: dict) -> str:
    lines = ["## Jobs: tiny pre-trained Mixtral, bf16 compute, " f"{results['steps']} steps", "",
             "| format | frozen B/expert | vs bf16 | B/expert with LoRA state | experts' bytes, busiest worker | "
             "step s | vs bf16 | final loss | vs bf16 | eval loss | vs bf16 |", "|---" * 11 + "|"]
    for fmt, row in results["jobs"].items():
        lines.append(f"| {fmt} | {row['frozen_bytes_per_expert']} | {row['frozen_bytes_vs_bf16']:.3f} | "
                     f"{row['bytes_per_expert_with_lora_state']} | {row['frozen_bytes_on_busiest_worker']} | "
                     f"{row['median_step_s']:.3f} | {row['step_time_vs_bf16']:.2f} | {row['final_loss']:.4f} | "
                     f"{row['final_loss_vs_bf16']:+.2%} | {row['eval_loss']:.4f} | {row['eval_loss_vs_bf16']:+.2%} |")
    lines += ["", f"## One layer's experts, forward + backward, {results['device']}", "",
              "| format | rows | s | vs bf16 |", "|---|---|---|---|"]
    for fmt, row in results["expert_compute"].items():
        lines.append(f"| {fmt} | {row['rows']} | {row['seconds']:.4f} | {row['vs_bf16']:.2f} |")
    lines += ["", "## Placement on paper_scale's Mixtral-8x7B cluster (improved solver, one master)", "",
              "| data set / memory | format | MB/expert | experts/worker | experts on master's node | "
              "cross-node MB/node/step | vs bf16 |", "|---" * 7 + "|"]
    for key, rows in results["placement"].items():
        for fmt, row in rows.items():
            ratio = "" if row["cross_node_vs_bf16"] is None else f"{row['cross_node_vs_bf16']:.2f}"
            lines.append(f"| {key} | {fmt} | {row['expert_mb']:.0f} | {row['experts_per_worker']} | "
                         f"{row['experts_on_master_node']} | {row['cross_node_mb_per_node']:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    formats = [BASELINE, *[f for f in args.formats.split(",") if f]]
    unknown = [f for f in formats[1:] if f not in FORMATS]
    if unknown:
        print(f"--formats: {unknown} unknown; use {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results = {"command": command(__file__, argv), "steps": args.steps, "device": args.device,
               "placement": placement_effect(formats), "expert_compute": expert_compute(args, formats)}
    with tempfile.TemporaryDirectory(prefix="vela-quantized-") as root:
        results["jobs"] = jobs(args, formats, Path(root))
    write_results(args.out, results, markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    run(main, quiet=("vela_ray",))
