"""One layer's expert shard, forward + backward, computed several ways on the same rows (fp32, CPU).

What `LayerExperts._low_rank` computes (x W + s (x A^T) B^T per stack, the family's gate between) for an
OLMoE-shaped layer (SwiGLU, gate_up [E, 2I, D], down [E, D, I]), with routing skewed over the local experts:

- `per-expert loop (before)`: the baseline, the code this replaced (written out below): rows sorted by
  expert, a Python loop of x W, x A^T B^T per expert;
- `grouped: torch._grouped_mm`: vela-ray now (`vela_ray.model.experts.grouped_mm` on CPU);
- `grouped: per-expert loop fallback`: the same with `native_grouped_mm` forced off (where no kernel runs);
- `grouped: padded bmm (not used)`: the fallback considered and rejected: rows padded to the busiest
  expert's count, one torch.bmm per product;
- `transformers <impl> + peft`: transformers' own OlmoeExperts under `experts_implementation` grouped_mm
  and eager, with peft's `target_parameters` LoRA (peft folds W + s B A into the stacks every call).
  (batched_mm is left out: it gathers one full weight matrix per row, R x 2I x D floats.)

Every way is checked against the baseline (outputs and d rows, relative max error), then timed
round-robin (one repetition of each in turn, so load on the machine hits all alike); the median of
`--repeats` after one warm-up (the check), wall-clock and process CPU time (with --threads 1, CPU time
is the steadier of the two on a shared machine), and the fastest repetition's wall-clock. The defaults are OLMoE's layer halved in width and
rows (about 30 s on one core); OLMoE itself: --hidden 2048 --intermediate 1024 --experts 8 --rows 4096.

    python benchmarks/expert_compute.py --out benchmarks/results/expert_compute.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from transformers import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/expert_compute.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import command, parser, run, write_results  # noqa: E402
from vela_ray.model import experts as experts_mod  # noqa: E402
from vela_ray.model.adapters import fuse_expert_factors  # noqa: E402
from vela_ray.model.experts import LayerExperts, LoraSpec, slot_name  # noqa: E402

Step = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # rows -> (outputs, d rows)


def per_expert_loop(layer: LayerExperts, local_R: torch.Tensor, rows_RD: torch.Tensor) -> torch.Tensor:
    """The baseline: `LayerExperts._low_rank` before grouped matrix multiplies, a Python loop over experts."""
    module = layer.module
    first = "gate_up_proj" if module.has_gate else "up_proj"
    order_R = torch.argsort(local_R, stable=True)
    counts = torch.bincount(local_R, minlength=len(layer.expert_ids)).tolist()
    pieces = []
    for local, x_rD in enumerate(rows_RD[order_R].split(counts)):
        if len(x_rD):
            h = _loop_linear(layer, first, local, x_rD)
            h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
            pieces.append(_loop_linear(layer, "down_proj", local, h))
    return torch.cat(pieces)[torch.argsort(order_R)]


def _loop_linear(layer: LayerExperts, stack: str, local: int, x: torch.Tensor) -> torch.Tensor:
    weight = getattr(layer.module, stack)[local]
    y = x @ weight if layer.transposed else nn.functional.linear(x, weight)
    if getattr(layer.module, "has_bias", False):
        y = y + getattr(layer.module, f"{stack}_bias")[local]
    adapter, slot = layer.adapters[str(layer.expert_ids[local])], slot_name(stack)
    low = nn.functional.linear(nn.functional.linear(x, getattr(adapter, f"lora_A_{slot}")),
                               getattr(adapter, f"lora_B_{slot}"))
    return y + layer.scaling * low


def padded_bmm(x_RK: torch.Tensor, w_nKN: torch.Tensor, offs_n) -> torch.Tensor:
    """`grouped_mm` as one torch.bmm over rows padded to the busiest expert's count."""
    offs_n = offs_n.ends if isinstance(offs_n, experts_mod.GroupOffsets) else offs_n
    counts = torch.diff(offs_n, prepend=offs_n.new_zeros(1)).long()
    most = int(counts.max())
    expert_R = torch.repeat_interleave(torch.arange(len(counts)), counts)
    slot_R = torch.arange(len(x_RK)) - (offs_n.long() - counts)[expert_R]
    flat_R = expert_R * most + slot_R
    padded = x_RK.new_zeros(len(counts) * most, x_RK.shape[1]).index_copy(0, flat_R, x_RK)
    out = torch.bmm(padded.view(len(counts), most, -1), w_nKN)
    return out.reshape(len(counts) * most, -1).index_select(0, flat_R)


def olmoe_config(args: argparse.Namespace, implementation: str) -> OlmoeConfig:
    return OlmoeConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_experts=args.experts,
                       experts_implementation=implementation)


def build_layer(args: argparse.Namespace, generator: torch.Generator) -> LayerExperts:
    """vela-ray's shard layer over `args.experts` OLMoE experts, random weights and non-zero LoRA B."""
    with torch.device("meta"):
        prototype = OlmoeExperts(olmoe_config(args, "grouped_mm"))
    weights = {e: {"gate_up_proj": torch.randn(2 * args.intermediate, args.hidden, generator=generator) * 0.02,
                   "down_proj": torch.randn(args.hidden, args.intermediate, generator=generator) * 0.02}
               for e in range(args.experts)}
    layer = LayerExperts(0, prototype, weights, LoraSpec(r=args.rank, alpha=2.0 * args.rank), seed=0)
    with torch.no_grad():
        for name, param in layer.adapters.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    assert layer.low_rank
    return layer


def peft_experts(args: argparse.Namespace, layer: LayerExperts, implementation: str) -> nn.Module:
    """transformers' OlmoeExperts holding the same weights, with peft's LoRA holding the same factors."""
    holder = nn.Module()
    holder.experts = OlmoeExperts(olmoe_config(args, implementation))
    with torch.no_grad():
        for stack in ("gate_up_proj", "down_proj"):
            getattr(holder.experts, stack).copy_(getattr(layer.module, stack))
    config = LoraConfig(r=args.rank, lora_alpha=2.0 * args.rank, target_modules=[],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    holder = inject_adapter_in_model(config, holder)
    with torch.no_grad():
        for wrapper in (m for m in holder.modules() if isinstance(m, ParamWrapper)):
            slot = slot_name(wrapper.parameter_name)
            lora_A, lora_B = fuse_expert_factors([
                (getattr(a, f"lora_A_{slot}"), getattr(a, f"lora_B_{slot}")) for a in layer.adapters.values()])
            wrapper.lora_A["default"].weight.copy_(lora_A)
            wrapper.lora_B["default"].weight.copy_(lora_B)
    return holder.experts


def backward_step(forward: Callable[[torch.Tensor], torch.Tensor], grad_RD: torch.Tensor) -> Step:
    """Forward and backward of `forward` on fresh leaf rows, as `ExpertShard.forward_rows`/`backward_rows` do."""
    def step(rows_RD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows_RD = rows_RD.detach().requires_grad_()
        out_RD = forward(rows_RD)
        out_RD.backward(grad_RD)
        return out_RD.detach(), rows_RD.grad
    return step


def patched(step: Step, *patches: mock._patch) -> Step:
    def run(rows_RD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for p in patches:
            p.start()
        try:
            return step(rows_RD)
        finally:
            for p in patches:
                p.stop()
    return run


def ways(args: argparse.Namespace, layer: LayerExperts, local_R: torch.Tensor,
         grad_RD: torch.Tensor) -> tuple[dict[str, Step], list[nn.Module]]:
    """{name: step} of every way, and the modules whose LoRA gradients they accumulate."""
    grouped = backward_step(lambda rows: layer(local_R, rows), grad_RD)
    ones_R1 = torch.ones(len(local_R), 1)
    out = {
        "per-expert loop (before)": backward_step(lambda rows: per_expert_loop(layer, local_R, rows), grad_RD),
        "grouped: torch._grouped_mm": grouped,
        "grouped: per-expert loop fallback": patched(
            grouped, mock.patch.object(experts_mod, "native_grouped_mm", lambda x, w: False)),
        "grouped: padded bmm (not used)": patched(grouped, mock.patch.object(experts_mod, "grouped_mm", padded_bmm)),
    }
    modules: list[nn.Module] = [layer]
    for implementation in args.transformers:
        modules.append(peft_experts(args, layer, implementation))
        out[f"transformers {implementation} + peft"] = backward_step(
            lambda rows, m=modules[-1]: m(rows, local_R[:, None], ones_R1), grad_RD)
    return out, modules


def skewed_routing(args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    """Local expert of each row: P(e) ~ (e+1)^-skew, shuffled."""
    p = torch.arange(1, args.experts + 1, dtype=torch.float64) ** -args.skew
    return torch.multinomial(p / p.sum(), args.rows, replacement=True, generator=generator)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=1024, help="D (OLMoE: 2048)")
    p.add_argument("--intermediate", type=int, default=512, help="expert intermediate size I (OLMoE: 1024)")
    p.add_argument("--experts", type=int, default=8, help="local experts of the layer")
    p.add_argument("--rows", type=int, default=2048, help="rows routed to the shard (OLMoE-scale: 4096)")
    p.add_argument("--rank", type=int, default=8, help="LoRA r (alpha = 2r)")
    p.add_argument("--skew", type=float, default=1.0, help="routing P(e) ~ (e+1)^-skew")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions of each way (after one warm-up)")
    p.add_argument("--transformers", nargs="*", default=["grouped_mm", "eager"],
                   help="transformers experts implementations to run with peft")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    layer = build_layer(args, generator)
    local_R = skewed_routing(args, generator)
    rows_RD = torch.randn(args.rows, args.hidden, generator=generator)
    grad_RD = torch.randn(args.rows, args.hidden, generator=generator)
    steps, modules = ways(args, layer, local_R, grad_RD)

    want = steps["per-expert loop (before)"](rows_RD)
    errors = {name: [relative_error(g, w) for g, w in zip(step(rows_RD), want)] for name, step in steps.items()}
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            for module in modules:
                module.zero_grad(set_to_none=True)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step(rows_RD)
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)

    base_wall, base_cpu = (statistics.median(t["per-expert loop (before)"]) for t in (wall, cpu))
    result = {
        "command": command(__file__),
        "setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "dtype": "float32", "device": "cpu",
                  "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                  "rows_per_expert": torch.bincount(local_R, minlength=args.experts).tolist()},
        "ways": {name: {"median_wall_s": statistics.median(wall[name]),
                        "median_cpu_s": statistics.median(cpu[name]),
                        "wall_over_baseline": statistics.median(wall[name]) / base_wall,
                        "cpu_over_baseline": statistics.median(cpu[name]) / base_cpu,
                        "min_wall_over_baseline": min(wall[name]) / min(wall["per-expert loop (before)"]),
                        "wall_s": wall[name], "cpu_s": cpu[name],
                        "max_rel_error_out_vs_baseline": errors[name][0],
                        "max_rel_error_d_rows_vs_baseline": errors[name][1]}
                 for name in steps},
    }
    print(write_results(args.out, result))


if __name__ == "__main__":
    run(main)
