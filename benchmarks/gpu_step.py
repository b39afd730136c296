"""Benchmark: one LoRA training step of a real-size MoE on one GPU, three ways side by side.

    peft              transformers + peft, the whole model on the GPU: experts_implementation="grouped_mm",
                      LoRA on attention and on the experts (peft's `target_parameters`, as
                      `vela_ray.model.adapters.full_lora_config` writes it)
    vela_gpu          vela-ray with every expert on the master's GPU: one in-process ExpertManager on
                      CUDA, rows by direct call (`cluster.workers_on_master = num_workers`)
    vela_cpu_workers  vela-ray: the master (backbone, its LoRA and AdamW) on the GPU, the experts on 2 CPU
                      ExpertManagers (Ray actors, `--worker-cpus` each) over the collective data plane (gloo)
    vela_gpu_overlap  vela_gpu with its `--micro-batches` in flight at once (`training.overlap`: each on a thread
                      and CUDA stream of its own), against vela_gpu's serial step over the same micro-batches

Models with real dimensions and random weights, built here from transformers configs (no hub):

    olmoe   OLMoE-1B-7B: its 16 layers (or `--layers`), 64 experts top-8, hidden 2048, expert intermediate 1024
    qwen3   Qwen3-30B-A3B: 12 of its 48 layers (or `--layers`), 128 experts top-8, hidden 2048, expert
            intermediate 768

The same step for all: `--batch` x `--seq` tokens (8 x 1024) in `--micro-batches` micro-batches (1), bf16 weights,
LoRA r=8 alpha=16, forward, backward, global grad-norm clipping to 1.0, AdamW (vela-ray's
`train_step`, and its clipping and AdamW code for peft). Reported: tokens/s (median step over
`--steps` after `--warmup`) and peak GPU memory of the steps (allocated, after the build). A setup
that runs out of GPU memory, or fails in any other way, is reported as such (its error's first line) and
the others go on; the results JSON is rewritten after every setup, so a crash keeps what ran before it. Expert weights are drawn once
per layer and shared by its experts (the arithmetic does not depend on the values), so no copy of the
experts sits on the master or in Ray's object store while the workers build theirs.

    python benchmarks/gpu_step.py                                  # both models, all setups (one GPU)
    python benchmarks/gpu_step.py --models qwen3 --layers 16
    python benchmarks/gpu_step.py --models olmoe --layers 4 --setups peft vela_gpu   # the battery's
    python benchmarks/gpu_step.py --device cpu --tiny --out /tmp/smoke.json   # toy sizes, no GPU

Results: a table, and benchmarks/results/gpu_step.json on a GPU (with the command). Without CUDA and
without `--device cpu` it exits 2 with one line saying so (a GPU check must not pass on a machine without one).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/gpu_step.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._harness import benchmark_device, command, parser, run, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu_step.json"
MODELS = ("olmoe", "qwen3")
SETUPS = ("peft", "vela_gpu", "vela_cpu_workers", "vela_gpu_overlap")
MAX_LAYERS = {"olmoe": 16, "qwen3": 48}  # the real models'
LAYERS = {"olmoe": 16, "qwen3": 12}  # run by default: OLMoE whole, 12 of Qwen3's 48 (peft fits an H100)
LR, MAX_GRAD_NORM = 1e-4, 1.0


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, what=f"results JSON (default on a GPU: {RESULTS.relative_to(ROOT)})")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to run")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="setups to run")
    p.add_argument("--layers", type=int, default=None,
                   help=f"layers of each model (default {LAYERS}; peft needs the most GPU memory)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches the batch is split into (every setup; vela_gpu_overlap runs them at once)")
    p.add_argument("--rank", type=int, default=8, help="LoRA r (alpha = 2r)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weights' dtype")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (kernel selection, allocator)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setup")
    p.add_argument("--worker-cpus", type=int, default=max(1, ((os.cpu_count() or 2) - 2) // 2),
                   help="CPUs (torch threads) of each CPU ExpertManager in vela_cpu_workers")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="toy dimensions (2 layers, hidden 64) and batch 2 x 32")
    p.add_argument("--seed", type=int, default=0, help="weights, LoRA init and tokens")
    p.add_argument("--profile", type=Path, default=None,
                   help="also profile one more step of each setup (torch.profiler, after the timed ones) and "
                        "write its top operators by device and host time to PROFILE/<model>_<setup>.txt")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 32)
    for model in args.models:  # here, not in model_config: a typo fails the command, not each setup
        if args.layers is not None and not 1 <= args.layers <= MAX_LAYERS[model]:
            p.error(f"--layers {args.layers}: {model} has {MAX_LAYERS[model]} layers; give 1 to {MAX_LAYERS[model]}")
    return args


# -- models ---------------------------------------------------------------------------------------------

def model_config(name: str, args: argparse.Namespace):
    """The transformers config of `name` at its real dimensions (or toy ones with --tiny)."""
    from transformers import OlmoeConfig, Qwen3MoeConfig

    common = dict(attn_implementation="sdpa", experts_implementation="grouped_mm", use_cache=False,
                  tie_word_embeddings=False)
    layers = args.layers or LAYERS[name]
    if args.tiny:
        tiny = dict(vocab_size=512, bos_token_id=None, eos_token_id=None, pad_token_id=None, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=256, **common)
        if name == "olmoe":
            return OlmoeConfig(intermediate_size=32, num_key_value_heads=4, **tiny)
        return Qwen3MoeConfig(moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, norm_topk_prob=True, **tiny)
    if name == "olmoe":  # allenai/OLMoE-1B-7B-0924's config.json, with `layers` of its 16
        return OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=layers,
                           num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                           max_position_embeddings=4096, rms_norm_eps=1e-5, norm_topk_prob=False, **common)
    return Qwen3MoeConfig(  # Qwen/Qwen3-30B-A3B's config.json, with `layers` of its 48
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6, **common)


def random_model(config, dtype: torch.dtype, device: torch.device, with_experts: bool, seed: int) -> nn.Module:
    """The causal LM with random weights on `device`, by the model's own init (std 0.02, norms 1, rotary
    tables); without its experts, which stay on the meta device for the brokers to replace."""
    from transformers import AutoModelForCausalLM

    from vela_ray.model.modeling import find_moe_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unallocated = set() if with_experts else {id(m) for b in find_moe_blocks(model) for m in b.block.experts.modules()}
    for module in model.modules():
        if id(module) not in unallocated:
            module.to_empty(device=device, recurse=False)
    torch.manual_seed(seed)
    model.initialize_weights()  # on meta tensors (the experts left out) a no-op
    return model


def expert_specs(config, dtype: torch.dtype, num_workers: int, device: str, args: argparse.Namespace) -> tuple:
    """(placement table [L, E], one ExpertManagerSpec per worker): expert e on worker e mod N; every expert
    of a layer shares one random slice per weight (the workers stack their own copies)."""
    from vela_ray.model.experts import LoraSpec
    from vela_ray.model.modeling import experts_prototypes
    from vela_ray.training.expert_manager import ExpertManagerSpec
    from vela_ray.training.schedule import OptimizerConfig

    prototypes = experts_prototypes(config)
    generator = torch.Generator().manual_seed(args.seed)
    shared = {layer: {name: (torch.randn(t.shape[1:], generator=generator) * 0.02).to(device, dtype)
                      for name, t in [*proto.named_parameters(recurse=False), *proto.named_buffers(recurse=False)]}
              for layer, proto in prototypes.items()}
    table = torch.arange(config.num_experts).remainder(num_workers).repeat(len(prototypes), 1)
    lora = LoraSpec(r=args.rank, alpha=2.0 * args.rank)

    def spec(worker: int) -> ExpertManagerSpec:
        keys = [(layer, e) for layer in prototypes for e in range(config.num_experts) if table[layer, e] == worker]
        return ExpertManagerSpec(worker=worker, keys=keys, weights={k: shared[k[0]] for k in keys}, hf_config=config,
                                 lora=lora, optim=OptimizerConfig(lr=LR), seed=args.seed, device=device)
    return table, [spec(n) for n in range(num_workers)]


# -- setups: each returns the step and what to release -------------------------------------------------

@dataclass
class Setup:
    step: Callable[[dict], float]  # one training step on a batch; returns the loss
    close: Callable[[], None] = lambda: None


def build_peft(config, dtype, device, args) -> Setup:
    from peft import get_peft_model

    from vela_ray.model.adapters import full_lora_config
    from vela_ray.model.experts import LoraSpec
    from vela_ray.training.optim import apply_step, clip_coefficient, grad_sq_norm, make_adamw
    from vela_ray.training.schedule import OptimizerConfig

    model = random_model(config, dtype, device, with_experts=True, seed=args.seed)
    model = get_peft_model(model, full_lora_config(model, LoraSpec(r=args.rank, alpha=2.0 * args.rank)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(params, OptimizerConfig(lr=LR))

    def step(micro_batches: list[dict]) -> float:  # what train_step does for a lone master, on the whole model
        total = 0.0
        for batch in micro_batches:
            loss = model(**batch).loss / len(micro_batches)
            loss.backward()
            total += float(loss.detach())
        apply_step(optimizer, LR, clip_coefficient(grad_sq_norm(params), MAX_GRAD_NORM))
        return total
    return Setup(step)


def build_vela(config, dtype, device, args, cpu_workers: bool, in_flight: int = 1) -> Setup:
    from vela_ray.model.experts import LoraSpec
    from vela_ray.model.transport import InProcessTransport
    from vela_ray.training.expert_manager import ExpertManager
    from vela_ray.training.schedule import OptimizerConfig
    from vela_ray.training.expert_workers import ExpertWorkers
    from vela_ray.training.master import build_master
    from vela_ray.training.step import train_step

    close: Callable[[], None] = lambda: None
    if cpu_workers:
        table, specs = expert_specs(config, dtype, 2, "cpu", args)
        workers, transport, close = ray_workers(specs, args.worker_cpus)
    else:
        table, specs = expert_specs(config, dtype, 1, device.type, args)
        managers = [ExpertManager(spec) for spec in specs]
        workers, transport = ExpertWorkers.in_process(managers), InProcessTransport(managers)
    model = random_model(config, dtype, device, with_experts=False, seed=args.seed)
    master = build_master(model, table, transport, LoraSpec(r=args.rank, alpha=2.0 * args.rank),
                          OptimizerConfig(lr=LR))
    master.peft_model.to(device)  # as the runner does; everything but the brokers is there already
    return Setup(lambda micro_batches: train_step(master, workers, micro_batches, LR, MAX_GRAD_NORM,
                                                  in_flight=in_flight), close)


def ray_workers(specs: list, worker_cpus: int) -> tuple:
    """(control plane, collective data plane, close) over one ExpertManager actor per spec."""
    import ray

    from actors.cluster import spawn_expert_managers
    from actors.transports import collective_transport
    from actors.workers import actor_workers

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(os.cpu_count() or 1, len(specs) * worker_cpus), include_dashboard=False,
                 log_to_driver=False)
    cluster = spawn_expert_managers(specs, num_cpus_per_worker=worker_cpus)
    transport = collective_transport(cluster.handles, cluster.worker_tiers())

    def close() -> None:
        transport.close()
        cluster.shutdown()
        if started:
            ray.shutdown()
    return actor_workers(cluster.handles), transport, close


BUILDERS = {"peft": build_peft, "vela_gpu": lambda *a: build_vela(*a, cpu_workers=False),
            "vela_cpu_workers": lambda *a: build_vela(*a, cpu_workers=True),
            "vela_gpu_overlap": lambda *a: build_vela(*a, cpu_workers=False, in_flight=a[-1].micro_batches)}


# -- measuring -------------------------------------------------------------------------------------------

def error_line(exc: BaseException) -> str:
    """`Type: first line of the message`: what a results table and JSON can hold of any error."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_setup(name: str, model: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Build `name` for `model`, run its steps; tokens/s and GPU memory, or the error that stopped it."""
    from vela_ray.model.dtypes import torch_dtype

    dtype = torch_dtype(args.dtype)
    cuda = device.type == "cuda"
    setup, seconds, losses = None, [], []
    try:
        config = model_config(model, args)
        generator = torch.Generator().manual_seed(args.seed)
        input_ids = torch.randint(config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
        batch = [{"input_ids": ids, "labels": ids} for ids in input_ids.chunk(args.micro_batches)]
        build_start = time.perf_counter()
        setup = BUILDERS[name](config, dtype, device, args)
        build_s = time.perf_counter() - build_start
        if cuda:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            losses.append(setup.step(batch))  # float(loss) waits for the GPU
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                seconds.append(time.perf_counter() - start)
        if args.profile is not None:
            profile_step(setup, batch, args.profile / f"{model}_{name}.txt", cuda)
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of GPU memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # noqa: BLE001  a setup that breaks is reported, and the others go on
        print(traceback.format_exc(), file=sys.stderr)
        return {"error": error_line(exc)}
    finally:
        if setup is not None:
            setup.close()
        del setup
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    median = statistics.median(seconds)
    gib = 2.0 ** 30
    return {"tokens_per_s": args.batch * args.seq / median, "median_step_s": median, "step_s": seconds,
            "losses": losses, "build_s": build_s,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / gib if cuda else None,
            "resident_gpu_gib": resident / gib if cuda else None}


def profile_step(setup: Setup, batch: dict, out: Path, cuda: bool) -> None:
    """One more step under torch.profiler: the top operators by self device time and by self host time (where
    a step spends its time, and which host work the GPU waits on), outside the timed steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        setup.step(batch)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    tables = [events.table(sort_by=key, row_limit=30, max_name_column_width=60)
              for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(tables))


def print_table(results: dict) -> None:
    print(f"\n{'model':<8}{'setup':<18}{'tokens/s':>10}{'step s':>9}{'peak GPU GiB':>14}{'/ peft tok/s':>14}")
    for model, by_setup in results.items():
        for name, r in by_setup.items():
            if "error" in r:
                print(f"{model:<8}{name:<18}  {r['error'][:70]}")
                continue
            peak = f"{r['peak_gpu_gib']:.1f}" if r["peak_gpu_gib"] is not None else "-"
            base = by_setup.get("peft", {}).get("tokens_per_s")
            ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
            print(f"{model:<8}{name:<18}{r['tokens_per_s']:>10.0f}{r['median_step_s']:>9.2f}{peak:>14}{ratio:>14}")


def main(argv=None) -> int:
    from vela_ray.quiet import silence_known_warnings

    args = parse_args(argv)
    silence_known_warnings()
    device = benchmark_device(args.device, "gpu_step")
    if device is None:
        return 2
    out = args.out or (RESULTS if device.type == "cuda" else None)
    results: dict[str, dict] = {}
    for model in args.models:
        for name in args.setups:
            print(f"{model} {name} ...", flush=True)
            results.setdefault(model, {})[name] = run_setup(name, model, args, device)
            if out:  # after every setup: a later crash (or timeout) keeps what ran
                write_results(out, {
                    "command": command(__file__, argv), "args": vars(args),
                    "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                               else platform.processor() or "cpu"),
                    "torch": torch.__version__, "results": results})
    print_table(results)
    return 0


if __name__ == "__main__":
    run(main)
