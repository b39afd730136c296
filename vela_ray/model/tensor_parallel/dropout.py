"""LoRA dropout under tensor parallelism: the ranks draw peft's masks.

Every rank of a group starts a step from its first rank's RNG state (`agree_on_rng`), so a replicated input (a
column-parallel lora_A's) gets the same mask on every rank, drawn as peft draws it; a row-parallel lora_A's
sharded input gets its slice of the full mask (`ShardedDropout` draws the whole input's mask, as peft does, and
keeps its columns), so the ranks' RNG streams stay in step with peft's.

On the host that needs each rank in a process of its own: ranks that are threads of one process (over a group
made with `collective.make_group`) share its one host generator, so each thread's draw advances the stream the
others draw from, and their masks differ from each other's and from peft's. `agree_on_rng` refuses them, in one
line. On GPUs the masks come from each rank's own device's generator: no refusal there.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist
from torch import nn

from vela_ray.model.tensor_parallel.group import collective_device
from vela_ray.model.tensor_parallel.plan import Style, TensorParallelPlan

# with the pid, tells this process from any other: another host's process may have the same pid (a forked one,
# which inherits this token, has another)
_PROCESS_TOKEN = uuid.uuid4().int >> 65


class ShardedDropout(nn.Module):
    """peft's `nn.Dropout` on a row-parallel lora_A's input, of which this rank holds columns [lo, hi) of `width`:
    it draws the mask of the whole [..., width] input, as peft's dropout would (the same RNG calls, so the ranks'
    and peft's streams stay in step), and applies this rank's columns of it.

    The mask is `F.dropout` of ones, so the kept entries hold exactly the factor peft's dropout multiplies by: on
    the host peft's dropout is that product (bernoulli / (1 - p), times the input), the same here. CUDA's fused
    kernel scales in fp32 and rounds once; in fp32 that is this product, in bf16/fp16 within one rounding."""

    def __init__(self, p: float, lo: int, hi: int, width: int):
        super().__init__()
        self.p, self.lo, self.hi, self.width = p, lo, hi, width

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x_local
        whole = x_local.new_ones((*x_local.shape[:-1], self.width))
        mask = torch.nn.functional.dropout(whole, self.p, True)
        return x_local * mask[..., self.lo:self.hi]

    def extra_repr(self) -> str:
        return f"p={self.p}, columns={self.lo}:{self.hi} of {self.width}"


def shard_dropout(module: nn.Module, adapter: str, style: Style, plan: TensorParallelPlan) -> None:
    """A LoRA dropout of `module` (a peft LoraLayer, still whole) under TP: a column-parallel one's input is
    replicated (peft's `nn.Dropout` stays; the shared RNG state makes the ranks' masks agree), a row-parallel one's
    is sharded (`ShardedDropout`)."""
    dropout = module.lora_dropout[adapter]
    if not (isinstance(dropout, nn.Dropout) and dropout.p > 0):
        return
    plan.draws_dropout = True
    if style == "rowwise":
        width = module.in_features
        step = width // plan.size
        module.lora_dropout[adapter] = ShardedDropout(dropout.p, plan.rank * step, (plan.rank + 1) * step, width)


def agree_on_rng(plan: TensorParallelPlan) -> None:
    """Every rank of the group takes its first rank's torch RNG state (the host's, and this GPU's when the group
    runs on GPUs): one all-gather, before a training step, so the ranks draw the same dropout masks (the first
    rank's state is the one a single master has: seeded per step, saved in checkpoints). An all-gather, not a
    broadcast from the first rank: torch's broadcast names its source by global rank, which only a group
    registered with torch.distributed has; the all-gather runs on any (`group`). RuntimeError for ranks on the host
    that are threads of one process (see the module docstring)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # alike on every rank: all on GPUs or none
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if cuda else [])
    process = torch.tensor([_PROCESS_TOKEN, os.getpid()], dtype=torch.int64).view(torch.uint8)
    flat = torch.cat([*states, process]).to(collective_device(plan.group))
    parts = [torch.empty_like(flat) for _ in range(plan.size)]
    dist.all_gather(parts, flat, group=plan.group)
    processes = set() if cuda else {tuple(part[-len(process):].tolist()) for part in parts}  # on the host
    if not cuda and len(processes) < plan.size:
        raise RuntimeError(f"LoRA dropout under tensor parallelism: {plan.size} ranks on the host in "
                           f"{len(processes)} process(es); threads of one process share its host RNG, so they "
                           "cannot draw one mask each: run the ranks as processes, or set lora_dropout: 0")
    first = parts[0].cpu()
    host = len(states[0])
    torch.set_rng_state(first[:host].clone())
    if cuda:
        torch.cuda.set_rng_state(first[host:len(first) - len(process)].clone())
