"""The embedding and LM head over a TP group: vocab-parallel, with torch's own plans.

LoRA does not adapt them, so nothing forces explicit regions here (`regions`): the embedding is vocab-parallel
`RowwiseParallel` and the LM head `ColwiseParallel` gathering the logits, both exact (a sum with zeros and a
concatenation), so transformers' loss sees the full logits. Tied, or with a vocabulary the TP size does not
divide, both stay replicated (`vocab_shardable`; exact too, only their memory is not split); so they do over a
group torch.distributed does not know (`group`): torch's plans are DTensor's, on a DeviceMesh, which needs a
registered group (`parallelize_backbone` decides, and logs why).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vela_ray.model.tensor_parallel.plan import TensorParallelPlan

logger = logging.getLogger(__name__)


def vocab_shardable(model: nn.Module, size: int) -> bool:
    """Whether `shard_vocab` can split `model`'s embedding and LM head over `size` ranks: untied, and a
    vocabulary divisible by `size`. Otherwise both stay replicated (exact too; only their memory is not split)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and head.weight is embed.weight:
        return False
    return all(m is None or m.weight.shape[0] % size == 0 for m in (embed, head))


def shard_vocab(model: nn.Module, mesh: Any, group: dist.ProcessGroup, plan: TensorParallelPlan) -> None:
    """Embedding vocab-parallel and LM head colwise with gathered logits: torch's plans (exact: the embedding's
    all-reduce adds zeros, the LM head's all-gather concatenates)."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        raise ValueError(f"{type(model).__name__}: tied embeddings cannot be vocab-parallel here (torch's plans shard "
                         "the embedding and LM head separately); set shard_vocab: false")
    paths = {id(m): p for p, m in model.named_modules()}
    plans = {}
    styles = (RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
              ColwiseParallel(output_layouts=Replicate()))
    for style in styles:  # every rank holds the same full tensor (or a skeleton it fills afterwards): each keeps its
        style.src_data_rank = None  # own chunk, with no scatter from rank 0
    for module, style in zip((embed, head), styles):
        if module is None or isinstance(module, LoraLayer) or not isinstance(module, (nn.Embedding, nn.Linear)):
            logger.info("not sharding %s (%s): not a plain embedding / linear", type(module).__name__,
                        paths.get(id(module)))
            continue
        vocab = module.weight.shape[0]
        if vocab % plan.size:
            raise ValueError(f"{paths[id(module)]}: vocabulary {vocab} not divisible by the TP size {plan.size}; "
                             "set shard_vocab: false")
        plans[paths[id(module)]] = style
    if mesh is None:
        mesh = DeviceMesh.from_group(group, "cpu" if not torch.cuda.is_available() else "cuda")
    parallelize_module(model, mesh, plans)
    plan.vocab_parallel = list(plans)
