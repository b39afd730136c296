"""Benchmark: one MoE layer's expert round trip through each transport, side by side.

One Mixtral-like layer (hidden D, E experts, top-k routing, T tokens) is split
over N ExpertManagers (expert e on worker e % N). For each transport the
ExpertBroker runs forward (dispatch + experts + gather + combine) and backward
(d(outputs) out, d(rows) back, LoRA grads on the workers) on the same inputs:

    in_process       shards in this process (the model side's InProcessTransport)
    object_refs      Ray actors, one .remote per worker + ray.get (RayObjectRefTransport)
    collective       Ray actors serving rows over torch.distributed point-to-point (gloo)

A second table puts the broker (in-process transport) next to the original
`MixtralExperts` module in one process, with peft LoRA on its fused weights
(the same arithmetic) and frozen (no adapter), on the same inputs.

    python benchmarks/transport_overhead.py                    # defaults below
    python benchmarks/transport_overhead.py --tokens 512 --iters 5

Results: printed tables and benchmarks/results/transport_overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import ray
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/transport_overhead.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from actors.cluster import spawn_expert_managers  # noqa: E402
from actors.transports import RayObjectRefTransport, collective_transport  # noqa: E402
from benchmarks._harness import parser, run, write_results  # noqa: E402
from vela_ray.model.broker import ExpertBroker, ExpertDispatcher  # noqa: E402
from vela_ray.model.experts import ExpertShard, LoraSpec  # noqa: E402
from vela_ray.model.transport import InProcessTransport  # noqa: E402
from vela_ray.training.expert_manager import ExpertManagerSpec  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "transport_overhead.json"


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, RESULTS, what="where to write the JSON results")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size D")
    p.add_argument("--intermediate", type=int, default=512,
                   help="expert intermediate size I (Mixtral's is 3.5*D; smaller keeps CPU compute from hiding "
                        "the transport cost)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer E")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--tokens", type=int, default=2048, help="tokens T in the micro-batch")
    p.add_argument("--workers", type=int, default=3, help="ExpertManagers N")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (alpha = 2r)")
    p.add_argument("--cpus-per-worker", type=int, default=1,
                   help="Ray CPUs per ExpertManager (Ray gives each actor as many torch threads)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of this process (in-process runs); default: --cpus-per-worker, so one "
                        "shard computes with the same threads wherever it runs")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per transport")
    p.add_argument("--iters", type=int, default=7, help="timed iterations per transport (median reported)")
    p.add_argument("--settle-s", type=float, default=5.0, help="idle seconds after spawning, before timing")
    return p.parse_args()


# -- the layer and its inputs ------------------------------------------------------------------

def make_experts(args) -> MixtralExperts:
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = "grouped_mm"  # what a model built by from_config/from_pretrained runs
    experts = MixtralExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.02)
    return experts.requires_grad_(False)


def make_inputs(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, D], top_k_index [T, K], top_k_weights [T, K], d(output) [T, D]."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    logits = torch.randn(args.tokens, args.experts, generator=g)
    weights, index = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    return hidden, index, weights / weights.sum(-1, keepdim=True), torch.randn(args.tokens, args.hidden, generator=g)


def expert_weights(experts: MixtralExperts) -> dict:
    return {(0, e): {"gate_up_proj": experts.gate_up_proj[e].clone(), "down_proj": experts.down_proj[e].clone()}
            for e in range(experts.num_experts)}


def peft_experts(experts: MixtralExperts, lora: LoraSpec) -> nn.Module:
    """The original module with peft LoRA on its fused weights, as the reference fine-tune runs it."""
    holder = nn.Module()
    holder.experts = experts
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    return inject_adapter_in_model(config, holder).experts


# -- timing ------------------------------------------------------------------------------------

def time_layer(run: Callable, inputs, warmup: int, iters: int) -> dict[str, float]:
    """Median forward and backward wall time (ms) of `run(hidden, index, weights)`."""
    hidden, index, weights, grad = inputs
    fwd, bwd = [], []
    for i in range(warmup + iters):
        x = hidden.detach().requires_grad_()
        t0 = time.perf_counter()
        out = run(x, index, weights)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(1e3 * (t1 - t0))
            bwd.append(1e3 * (t2 - t1))
    f, b = statistics.median(fwd), statistics.median(bwd)
    return {"forward_ms": f, "backward_ms": b, "total_ms": f + b}


def time_broker(transport, table: torch.Tensor, inputs, args) -> dict[str, float]:
    dispatcher = ExpertDispatcher(table, transport)
    result = time_layer(ExpertBroker(0, dispatcher), inputs, args.warmup, args.iters)
    result["mb_moved_per_iter"] = dispatcher.traffic().total_bytes() / (args.warmup + args.iters) / 2**20
    return result


# -- transports --------------------------------------------------------------------------------

def ray_cluster(weights: dict, table: torch.Tensor, lora: LoraSpec, experts: MixtralExperts, args):
    specs = []
    for n in range(args.workers):
        part = {k: w for k, w in weights.items() if int(table[k]) == n}
        specs.append(ExpertManagerSpec(worker=n, keys=sorted(part), weights=part, hf_config=experts.config, lora=lora))
    return spawn_expert_managers(specs, num_cpus_per_worker=args.cpus_per_worker)


def run_transports(weights: dict, table: torch.Tensor, lora: LoraSpec, experts: MixtralExperts, inputs, args
                   ) -> dict[str, dict]:
    shards = [ExpertShard.from_weights({k: w for k, w in weights.items() if int(table[k]) == n}, lora,
                                       experts, seed=0) for n in range(args.workers)]
    cluster = ray_cluster(weights, table, lora, experts, args)
    try:
        time.sleep(args.settle_s)  # let Ray's start-up work finish before timing anything
        results = {"in_process": time_broker(InProcessTransport(shards), table, inputs, args)}
        tiers = cluster.worker_tiers()
        results["object_refs"] = time_broker(RayObjectRefTransport(cluster.handles, tiers), table, inputs, args)
        collective = collective_transport(cluster.handles, tiers)
        try:
            results["collective"] = time_broker(collective, table, inputs, args)
        finally:
            collective.close()
    finally:
        cluster.shutdown()
    base = results["in_process"]["total_ms"]
    for row in results.values():
        row["ratio"] = row["total_ms"] / base
    return results


def run_module_baselines(experts: MixtralExperts, weights: dict, lora: LoraSpec, inputs, args) -> dict[str, dict]:
    table = torch.tensor([[0] * args.experts])
    shard = ExpertShard.from_weights(weights, lora, experts, seed=0)
    with_lora = peft_experts(copy.deepcopy(experts), lora)
    results = {
        "MixtralExperts + peft LoRA": time_layer(with_lora, inputs, args.warmup, args.iters),
        "MixtralExperts (frozen, no LoRA)": time_layer(experts, inputs, args.warmup, args.iters),
        "ExpertBroker, in-process": time_broker(InProcessTransport([shard]), table, inputs, args),
    }
    base = results["MixtralExperts + peft LoRA"]["total_ms"]
    for row in results.values():
        row["ratio"] = row["total_ms"] / base
    return results


def print_table(title: str, rows: dict[str, dict], against: str) -> None:
    print(f"\n{title}")
    print(f"{'':34s} {'forward ms':>11s} {'backward ms':>12s} {'total ms':>9s} {'ratio':>6s}")
    for name, r in rows.items():
        print(f"{name:34s} {r['forward_ms']:11.1f} {r['backward_ms']:12.1f} {r['total_ms']:9.1f} {r['ratio']:6.2f}")
    print(f"(ratio: total time / {against})")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads or args.cpus_per_worker)
    torch.manual_seed(0)
    lora = LoraSpec(r=args.rank, alpha=2.0 * args.rank)
    experts = make_experts(args)
    weights = expert_weights(experts)
    inputs = make_inputs(args)
    table = torch.tensor([[e % args.workers for e in range(args.experts)]])
    ray.init(num_cpus=max(os.cpu_count() or 1, args.workers * args.cpus_per_worker), include_dashboard=False,
             log_to_driver=False)
    try:
        transports = run_transports(weights, table, lora, experts, inputs, args)
    finally:
        ray.shutdown()
    modules = run_module_baselines(experts, weights, lora, inputs, args)

    print(f"\nOne MoE layer: D={args.hidden}, I={args.intermediate}, E={args.experts}, top-{args.top_k}, "
          f"T={args.tokens} tokens, {args.workers} workers, LoRA r={args.rank}; median of {args.iters}")
    print_table("Broker round trip per transport", transports, "in_process")
    print(f"MB moved per iteration (all workers, 4 directions): {transports['in_process']['mb_moved_per_iter']:.1f}")
    print_table("Broker vs the original experts module, one process", modules, "MixtralExperts + peft LoRA")
    machine = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
               "ray": ray.__version__, "torch": torch.__version__}
    write_results(args.out, {"config": vars(args), "machine": machine, "transports": transports,
                             "modules": modules})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    run(main)
