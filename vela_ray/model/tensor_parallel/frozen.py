"""The frozen backbone sharded over data-parallel masters (FSDP2; `masters.shard_frozen_backbone`): with several
data-parallel masters, every decoder layer's frozen weights are split over "dp", LoRA left whole.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its first ModuleList named `layers` (every transformers causal LM's)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return module
    raise ValueError(f"{type(model).__name__}: no decoder `layers` to shard")


def shard_frozen(model: nn.Module, dp_mesh: Any) -> int:
    """FSDP2 (`fully_shard`) on every decoder layer over the data-parallel mesh `dp_mesh`, its trainable (LoRA)
    parameters left out: each rank keeps 1/dp of the layer's frozen weights (of its TP shard, under tensor
    parallelism) and all-gathers the layer to run it, forward and again backward. LoRA stays whole on every rank,
    its gradients summed as the masters sum them (`Replicas.sync_grads`), so nothing else changes. The embedding
    and LM head stay as they are (under TP, DTensors of the TP mesh). Exact: an all-gather concatenates.
    Returns the layers sharded."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    for layer in layers:
        trainable = {p for p in layer.parameters() if p.requires_grad}
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True, ignored_params=trainable)
    logger.info("frozen weights of %d decoder layers sharded over %d data-parallel ranks", len(layers),
                dp_mesh.size())
    return len(layers)
