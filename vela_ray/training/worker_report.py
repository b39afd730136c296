"""What an ExpertManager reports about itself (`ExpertManager.report`): one `WorkerReport`.

Where it runs and what the placement sizes it by (free memory, bytes per expert, and when asked the
compute seconds per row), and its counters so far (`WorkerCounters`: also what every step answers, so the
trackers and the tiers' metrics read them without a round trip of their own: `ExpertWorkers.counters`).
The pools (`vela_ray.runtime.local`, `actors.pool`) read capacities, compute and pids from the reports:

    reports = [manager.report() for manager in managers]
    capacity_from_memory([r.free_bytes for r in reports], hosted_bytes_per_expert(reports),
                         [r.memory_pool for r in reports])
"""

from __future__ import annotations

import sys
from itertools import chain
from typing import Sequence

import psutil
import torch
from pydantic import BaseModel, ConfigDict, Field

from vela_ray.model.experts import ExpertKey, ExpertShard
from vela_ray.model.traffic import LOCAL_NODE
from vela_ray.training.tiered import TieredExperts, seconds_per_row
from vela_ray.training.tiers import TierCounters

# Per LoRA parameter the worker keeps the value, its gradient and AdamW's two moments.
_LORA_COPIES = 4


class WorkerCounters(BaseModel):
    """One ExpertManager's running counters: its answer to every step (`ExpertManager.step`, `zo_apply`), and
    part of its `report`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    received_bytes: int = Field(description="rows and gradients received so far, as counted on this side")
    compute_s: float = Field(description="wall seconds of expert forward/backward so far (CUDA: as launched)")
    tiers: TierCounters | None = Field(description="APTMoE's tier counters so far; None when untiered")


class WorkerReport(WorkerCounters):
    """One ExpertManager's answer to `report`: its counters, and where it runs and what it is sized by."""

    worker: int
    node_id: str = Field(description="the Ray node this worker runs on, or LOCAL_NODE outside Ray")
    pid: int
    num_experts: int = Field(description="experts hosted now")
    bytes_per_expert: int | None = Field(description="mean bytes one hosted expert needs: frozen weights + "
                                                     "LoRA with its gradient and AdamW moments; None: hosts none")
    free_bytes: int = Field(description="free memory where the experts are kept (see `free_bytes`)")
    memory_pool: str = Field(description="names that memory: workers with the same name split it")
    seconds_per_row: float | None = Field(description="one row's forward + backward, when `report` was "
                                                      "asked to time it and the worker hosts an expert")


def hosted_bytes_per_expert(reports: Sequence[WorkerReport]) -> int:
    """Bytes per expert as the first worker that hosts experts measured them."""
    return next(r.bytes_per_expert for r in reports if r.num_experts)


def node_id() -> str:
    """The Ray node this process runs on, or `LOCAL_NODE` outside Ray. A process that never imported Ray
    is not in a Ray cluster, so Ray is not imported here (in-process runs need not have it installed)."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else LOCAL_NODE


def bytes_per_expert(shard: ExpertShard) -> int | None:
    """Mean bytes one of the shard's experts needs: frozen weights + LoRA with its gradient and AdamW
    moments; None without experts. The frozen bytes are summed over each layer's stacks (one slice per
    expert), not expert by expert: a tiered worker reports every step, and may host thousands."""
    num_experts = len(shard.keys)
    if not num_experts:
        return None
    frozen = sum(t.numel() * t.element_size() for layer in shard.layers.values()
                 for t in chain(layer.module.parameters(recurse=False), layer.module.buffers(recurse=False)))
    lora = sum(p.numel() * p.element_size() for p in shard.lora_parameters())
    return (frozen + _LORA_COPIES * lora) // num_experts


def free_bytes(device: torch.device, tiered: bool) -> int:
    """Free memory where a worker keeps its experts: its GPU's, or host memory on a CPU worker and on a
    tiered one (APTMoE: frozen weights, LoRA and AdamW in host memory, only the bounded cache on the
    device). Workers that share that memory each see all of it: `memory_pool` says which do."""
    if device.type == "cuda" and not tiered:
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def memory_pool(device: torch.device, tiered: bool, node: str) -> str:
    """Names the memory `free_bytes` measured: workers with the same name split it (`capacity_from_memory`)."""
    if device.type == "cuda" and not tiered:
        return f"{node}/cuda:{torch.cuda.get_device_properties(device).uuid}"
    return f"{node}/host"


def measured_seconds_per_row(shard: ExpertShard, keys: list[ExpertKey], tiers: TieredExperts | None,
                             num_rows: int, repeats: int = 3) -> float | None:
    """Wall seconds of one row's forward + backward through a hosted expert, best of `repeats`.

    The placement cost model's compute term (`PlacementProblem.compute_seconds_per_row`). Random rows;
    gradients are returned, not accumulated, so training state is untouched. None without experts. A
    tiered worker answers for its tiers (`TieredExperts.request_seconds_per_row`).
    """
    if not keys:
        return None
    layer, expert = keys[0]
    if tiers is None:
        return seconds_per_row(shard.layers[str(layer)], expert, num_rows, repeats)
    return tiers.request_seconds_per_row(layer, num_rows, len(keys))
