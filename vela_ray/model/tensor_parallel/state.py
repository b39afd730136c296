"""Full tensors whatever the TP size: peft's adapter gathered from the shards (and loaded back into them), and a
checkpoint's state (`master.master_state`: parameters and optimizer slots) merged from every rank's on rank 0
and split again on load, so a run saved at one TP size resumes at another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vela_ray.model.tensor_parallel.plan import TensorParallelPlan


def _gather(tensor: torch.Tensor, dim: int, plan: TensorParallelPlan) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(plan.size)]
    dist.all_gather(parts, tensor.contiguous(), group=plan.group)
    return torch.cat(parts, dim=dim)


def gather_lora_state_dict(model: nn.Module, plan: TensorParallelPlan | None = None,
                           adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """peft's `get_peft_model_state_dict(model)` of the *unsharded* model, on every rank: sharded LoRA factors
    all-gathered along their dim (one all-gather each), so the result is independent of the TP size and loads
    into plain peft (or `load_lora_state_dict` at another TP size)."""
    from peft import get_peft_model_state_dict

    plan = plan or model._vela_tp_plan  # type: ignore[assignment]
    state = model.state_dict()
    for name in sorted(plan.sharded):  # same order on every rank
        if ".lora_" in name:
            state[name] = _gather(state[name].detach(), plan.sharded[name], plan)
    return {k: v.detach().clone() for k, v in
            get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter_name).items()}


def load_lora_state_dict(model: nn.Module, full: dict[str, torch.Tensor], plan: TensorParallelPlan | None = None,
                         adapter_name: str = "default") -> None:
    """Load peft's full adapter `full` (keys as `get_peft_model_state_dict`) into the sharded `model`: each
    sharded factor takes its rank's chunk. KeyError if a LoRA factor of the model has no entry in `full`."""
    plan = plan or model._vela_tp_plan  # type: ignore[assignment]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" not in name:
                continue
            key = name.replace(f".{adapter_name}", "", 1)
            value = full[key]
            if name in plan.sharded:
                value = value.chunk(plan.size, plan.sharded[name])[plan.rank]
            param.copy_(value)


def _sharded_dim(key: str, value: torch.Tensor, plan: TensorParallelPlan) -> int | None:
    """The dim `key` (a parameter name, or "<parameter>.<optimizer slot>") is sharded on, None if replicated."""
    if key in plan.sharded:
        return plan.sharded[key]
    owner, _, slot = key.rpartition(".")
    if owner in plan.sharded and value.dim() > 0:  # AdamW's moments shard with their parameter; `step` is a scalar
        return plan.sharded[owner]
    return None


def merge_shards(states: list[dict[str, torch.Tensor]], plan: TensorParallelPlan) -> dict[str, torch.Tensor]:
    """One state (parameters and optimizer slots by name, e.g. `master.master_state`) of the unsharded model from
    every rank's, in rank order: sharded tensors concatenated along their dim, replicated ones taken from rank 0.
    What a checkpoint holds, so it resumes at any TP size (`shard_of`)."""
    if len(states) != plan.size:
        raise ValueError(f"merging {len(states)} states of a TP group of {plan.size}")
    full = {}
    for key, value in states[0].items():
        dim = _sharded_dim(key, value, plan)
        full[key] = value if dim is None else torch.cat([state[key] for state in states], dim)
    return full


def shard_of(full: dict[str, torch.Tensor], plan: TensorParallelPlan) -> dict[str, torch.Tensor]:
    """This rank's share of a full state (`merge_shards`'s, or one written at another TP size)."""
    out = {}
    for key, value in full.items():
        dim = _sharded_dim(key, value, plan)
        out[key] = value if dim is None else value.chunk(plan.size, dim)[plan.rank]
    return out
