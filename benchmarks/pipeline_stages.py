"""A master's layers in pipeline stages (`masters.pipeline_stages`): what each stage holds, and the step, side by side.

One model (a debug Mixtral widened to `--hidden`, `--layers` decoder layers, float32, the tiny model's tokenizer) and
one job (`--micro-batches` micro-batches of 2 x `--seq` tokens a step over 3 in-process ExpertManagers, a fixed
placement) run with 1 (one master), 2 and 4 stages (`--stages`), each stage a thread of this process with its own
model (`runtime.local.ThreadRanks`; through Ray each is a process). Reported per setup: the frozen backbone bytes
each stage holds (`summary.json`'s `stage_bytes`: its layers, and the embedding, norm and head every stage keeps),
the largest stage's share of one master's (and of its decoder layers' bytes alone: the embedding and head, a
large share of so small a model, stay on every stage), each stage's expert traffic, the median step seconds and
its ratio to one master's, and the losses (every setup's equal one master's: the stages move hidden states, never
change them).

What the figures leave out: the step times are a CPU stand-in's (the stages share this machine's cores with each
other and with the workers, and cross their group by a thread barrier, not PCIe or NVLink), so they say what the
schedule costs in bookkeeping here, not what stages on GPUs of their own gain; the bytes are those a GPU stage holds
on its device (without `masters.streaming`). The ExpertManagers' memory is outside these figures: the stages do not
change it.

    python benchmarks/pipeline_stages.py --out benchmarks/results/pipeline_stages.json
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/pipeline_stages.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import SHAKESPEARE, command, parser, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pipeline_stages.json"
MiB = 2**20


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, RESULTS)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=6, help="steps per setup; the first is left out of the median")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vela-pipeline-") as tmp:
        model_dir = make_model(Path(tmp) / "model", args.layers, args.hidden)
        shared = shared_bytes(model_dir)
        results = {f"stages_{s}": run_setup(model_dir, Path(tmp) / f"out{s}", s, args) for s in args.stages}
    base = results[f"stages_{args.stages[0]}"]
    for result in results.values():
        result["step_vs_first"] = result["median_step_s"] / base["median_step_s"]
        result["largest_stage_vs_first"] = max(result["stage_bytes"]) / sum(base["stage_bytes"])
        result["largest_stage_layers_vs_first"] = (max(result["stage_bytes"]) - shared) / (sum(base["stage_bytes"])
                                                                                             - shared)
        result["losses_equal_first"] = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(result["losses"],
                                                                                      base["losses"]))
    payload = {"command": command(__file__, argv), "model": {"family": "mixtral", "layers": args.layers,
                                                             "hidden": args.hidden, "dtype": "float32",
                                                             "embedding_norm_head_mib": shared / MiB},
               "micro_batches": args.micro_batches, "tokens_per_micro_batch": 2 * args.seq, "steps": args.steps,
               "setups": results}
    print(table(results))
    write_results(args.out, payload)
    return payload


def make_model(out: Path, layers: int, hidden: int) -> Path:
    """The debug Mixtral at `hidden` with `layers` decoder layers (no router aux loss), the tiny model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from vela_ray.training.tiny_model import tiny_model_path

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                           vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path() / name, out / name)
    return out


def shared_bytes(model_dir: Path) -> int:
    """The checkpoint's bytes outside the decoder layers (embedding, final norm, head), which every stage holds."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(4 * math.prod(f.get_slice(n).get_shape()) for n in f.keys() if "layers." not in n)


def run_setup(model_dir: Path, out: Path, stages: int, args) -> dict:
    from vela_ray.config import JobConfig
    from vela_ray.runtime.local import InProcessPool
    from vela_ray.runtime.runner import JobRunner

    job = JobConfig.from_dict({
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(SHAKESPEARE), "seq_len": args.seq, "limit": 400},
        "cluster": {"num_workers": 3},
        "masters": {"pipeline_stages": stages},
        "placement": {"solver": "sequential", "profile": "uniform"},
        "training": {"steps": args.steps, "batch_size": 2 * args.micro_batches, "micro_batch_size": 2,
                     "eval_every": 0, "optimizer": {"lr": 1e-4}},
        "output": {"dir": str(out)},
    })
    summary = JobRunner(job, InProcessPool(job)).run()
    result = {"median_step_s": statistics.median(h.step_time_s for h in summary.history[1:]),
              "stage_bytes": summary.stage_bytes, "stage_mib": [b / MiB for b in summary.stage_bytes],
              "traffic_mib_by_stage": [b / MiB for b in summary.traffic_bytes_by_master],
              "losses": summary.losses}
    print(f"{stages} stage(s): {result['median_step_s']:.3f} s/step, stages hold "
          f"{', '.join(f'{m:.1f}' for m in result['stage_mib'])} MiB", flush=True)
    return result


def table(results: dict) -> str:
    lines = [f"{'setup':<12}{'s/step':>8}{'x first':>9}{'largest stage':>15}{'its layers':>12}{'stage MiB':>24}"
             f"{'last loss':>11}"]
    for name, r in results.items():
        lines.append(f"{name:<12}{r['median_step_s']:>8.3f}{r['step_vs_first']:>9.2f}"
                     f"{r['largest_stage_vs_first']:>15.2f}{r['largest_stage_layers_vs_first']:>12.2f}"
                     f"{' '.join(f'{m:.1f}' for m in r['stage_mib']):>24}"
                     f"{r['losses'][-1]:>11.5f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
