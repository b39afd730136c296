"""The GPU battery's exactness part: vela-ray against transformers + peft on one device, in one process.

Per family (debug Mixtral and debug Qwen3-MoE, built here: no hub, no data set), three checks:

    fp32_job      a whole in-process job (`JobRunner` over `InProcessPool`) with the master and every
                  ExpertManager on the device (`cluster.workers_on_master = num_workers`, `master_gpus: 1`
                  on CUDA), its placement solved by the `improved` solver (the greedy start where cvxpy is
                  not installed), against plain peft on the same device over the very batches
                  (`equivalence.peft_losses`): losses equal within `--rtol` (1e-4)
    streamed_job  the same job on the model with 4 decoder layers, the master's backbone streamed from host
                  memory through 2 device slots (`masters.streaming`: pinned host copies, uploads on a side
                  stream, the backward uploading the evicted layers again), its 2 micro-batches in flight passing
                  the slots in step, activations beyond 64 KiB offloaded, against peft the same way
    bf16_factors  a bf16 model, LoRA factors and AdamW state in fp32, `--bf16-steps` (30) at lr 3e-5
                  (`equivalence.build_pair(..., device=)`): the expert factors' updates stay within the spread
                  bf16 rounding gives peft's own (`equivalence.rounding_excess`, as
                  tests/unit/test_bf16_expert_adapters.py holds them on the CPU)

The text both jobs train on is the repository's own README files (plain text, always there with the
source tree); its tokenizer is trained here. The results JSON is rewritten after every check, so a run cut
short keeps what it had; a check that fails records its error and the others go on. Exit status 1 if any
check failed.

    python scripts/gpu_exactness.py --out benchmarks/results/gpu/exactness.json      # on a CUDA machine
    python scripts/gpu_exactness.py --device cpu --families mixtral --out /tmp/e.json # the same on the CPU
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/gpu_exactness.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._harness import benchmark_device, command, parser, run, write_results  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe")
CHECKS = ("fp32_job", "streamed_job", "bf16_factors")
CORPUS = (ROOT / "README.md", ROOT / "deploy" / "README.md")
VOCAB = 256
BF16_LR = 3e-5  # the VELA paper's lr, held constant (tests/unit/test_bf16_expert_adapters.py)


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, what="results JSON (rewritten after every check)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same checks, no GPU")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="debug models to check")
    p.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS), help="checks to run")
    p.add_argument("--steps", type=int, default=4, help="steps of the fp32 job")
    p.add_argument("--rtol", type=float, default=1e-4, help="the fp32 job's losses: relative tolerance to peft's")
    p.add_argument("--bf16-steps", type=int, default=30,
                   help="steps of the bf16 check (30, as tests/unit/test_bf16_expert_adapters.py)")
    return p.parse_args(argv)


# -- the model and the data -------------------------------------------------------------------------------

def write_corpus(path: Path) -> Path:
    """The plain text both jobs train on: the repository's README files, as they are."""
    path.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in CORPUS if p.is_file()), encoding="utf-8")
    return path


def build_checkpoint(family: str, corpus: Path, out: Path, **config) -> tuple[Path, Path]:
    """(model directory, start adapter): `family`'s debug model (`config` overriding its config) with a BPE tokenizer
    trained on `corpus`, and a peft adapter with random A and B (every factor gets gradients from step 0) both
    sides start from."""
    from peft import get_peft_model

    from vela_ray.model.adapters import full_lora_config
    from vela_ray.model.experts import LoraSpec
    from vela_ray.model.families import debug_model
    from vela_ray.training.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(corpus.read_text(encoding="utf-8"), VOCAB)
    model = debug_model(family, seed=0, vocab_size=len(tokenizer), **config)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    lora = full_lora_config(model, LoraSpec(r=4, alpha=8))
    lora.init_lora_weights = False
    torch.manual_seed(5)
    get_peft_model(model, lora).save_pretrained(out / "adapter")
    return out / "model", out / "adapter"


# -- the checks -------------------------------------------------------------------------------------------

def fp32_job(family: str, device: torch.device, args: argparse.Namespace, work: Path, masters: dict | None = None,
             overlap: dict | None = None, **model_config) -> dict:
    """A whole job in this process, every ExpertManager on `device`, against peft on `device`."""
    from vela_ray.config import JobConfig
    from vela_ray.runtime.local import InProcessPool
    from vela_ray.runtime.runner import JobRunner

    model_dir, adapter = build_checkpoint(family, write_corpus(work / "corpus.txt"), work, **model_config)
    config = JobConfig.from_dict({
        "masters": masters or {},
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(work / "corpus.txt"), "seq_len": 32, "limit": 200},
        "cluster": {"num_workers": 2, "workers_on_master": 2, "master_gpus": int(device.type == "cuda")},
        "lora": {"r": 4, "alpha": 8, "init_adapter": str(adapter)},
        "placement": {"solver": "improved", "profile": "measure", "profile_batches": 2},
        "training": {"steps": args.steps, "batch_size": 4, "micro_batch_size": 2,
                     "optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}, "overlap": overlap or {}},
        "output": {"dir": str(work / "run")},
    })
    config.preflight()
    summary = JobRunner(config, InProcessPool(config, device=device.type)).run()
    reference, _ = peft_reference(config, device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(summary.losses, reference))
    result = {"losses": summary.losses, "peft_losses": reference, "max_rel_diff": worst, "rtol": args.rtol,
              "placement_solver": summary.placement.solver, "lower_bound_s": summary.placement.lower_bound_s}
    if not worst <= args.rtol:
        result["error"] = f"losses {worst:.2e} off peft's (rtol {args.rtol:g})"
    return result


def streamed_job(family: str, device: torch.device, args: argparse.Namespace, work: Path) -> dict:
    """`fp32_job` with 4 decoder layers streamed through 2 device slots: every layer evicted and uploaded again; the
    step's 2 micro-batches in flight, passing the slots in step, their activations beyond 64 KiB in host memory."""
    return fp32_job(family, device, args, work, num_hidden_layers=4, overlap={"micro_batches_in_flight": 2},
                    masters={"streaming": {"buffer_blocks": 2, "activation_budget_bytes": 64 * 1024}})


def peft_reference(config, device: torch.device) -> tuple[list[float], dict]:
    """Plain peft on `device` over the job's very batches (`equivalence.peft_losses`)."""
    from transformers import AutoTokenizer

    from vela_ray.data.datasets import batch_at, build_dataset, micro_batches
    from vela_ray.training.equivalence import peft_losses

    train = config.training
    train_set, _ = build_dataset(config.data, AutoTokenizer.from_pretrained(config.model.path)).split(
        train.eval_fraction, train.seed)
    steps = [micro_batches(batch_at(train_set, step, train.batch_size, train.seed), train.micro_batch_size)
             for step in range(train.steps)]
    return peft_losses(config.model.path, config.lora.init_adapter, steps, train.optimizer, device)


def bf16_factors(family: str, device: torch.device, args: argparse.Namespace, work: Path) -> dict:
    """bf16 weights, fp32 factors: vela-ray's expert updates within what bf16 rounding does to peft's own."""
    from vela_ray.model.families import debug_model
    from vela_ray.training.equivalence import build_pair, expert_drifts, rounding_excess
    from vela_ray.training.schedule import OptimizerConfig

    make_model = functools.partial(debug_model, family, seed=0)
    pair = build_pair(make_model, dtype=torch.bfloat16, optim=OptimizerConfig(lr=BF16_LR, schedule="constant"),
                      device=device)
    drifts = expert_drifts(pair, make_model, torch.bfloat16, args.bf16_steps)
    result = {"steps": args.bf16_steps, "lr": BF16_LR, "drift": drifts.summary()}
    if problems := rounding_excess(drifts):
        result["error"] = "; ".join(problems)
    return result


CHECK_FNS: dict[str, Callable[..., dict]] = {"fp32_job": fp32_job, "streamed_job": streamed_job,
                                             "bf16_factors": bf16_factors}


def run_check(name: str, family: str, device: torch.device, args: argparse.Namespace) -> dict:
    """One check's result (with `seconds`), or the error that stopped it."""
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix=f"vela-{name}-") as work:
            result = CHECK_FNS[name](family, device, args, Path(work))
    except Exception as exc:  # noqa: BLE001  a check that breaks is recorded, and the others go on
        print(traceback.format_exc(), file=sys.stderr)
        result = {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"}
    result.update(status="failed" if "error" in result else "ok", seconds=round(time.perf_counter() - start, 1))
    return result


def main(argv=None) -> int:
    from vela_ray.quiet import silence_known_warnings

    args = parse_args(argv)
    silence_known_warnings()
    device = benchmark_device(args.device, "gpu_exactness")
    if device is None:
        return 2
    results: dict[str, dict] = {}
    for family in args.families:
        for name in args.checks:
            print(f"gpu_exactness: {family} {name} ...", flush=True)
            outcome = results.setdefault(family, {})[name] = run_check(name, family, device, args)
            print(f"gpu_exactness: {family} {name} {outcome['status']} in {outcome['seconds']} s "
                  f"{outcome.get('error', '')}", flush=True)
            write_results(args.out, {
                "command": command(__file__, argv),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "versions": {name: version(name) for name in ("torch", "transformers", "peft")},
                "results": results})
    failed = [f"{family}/{name}" for family, checks in results.items() for name, r in checks.items() if "error" in r]
    checks = sum(map(len, results.values()))
    print(f"gpu_exactness: {len(failed)} of {checks} checks failed {' '.join(failed)}".rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    run(main)
