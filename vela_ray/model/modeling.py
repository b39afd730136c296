"""Find the MoE blocks of a transformers-5 model and describe their experts.

Every transformers-5 MoE family (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3,
GLM4-MoE, ...) stores a block's experts in one `experts` submodule with fused
3-D weights and calls it as `experts(hidden_states, top_k_index, top_k_weights)`:

    gate_up_proj: [E, 2*I, D]   rows [0, I) are the gate, [I, 2I) the up projection
    down_proj:    [E, D, I]
    out = down(act(gate(x)) * up(x))

`find_moe_blocks` returns those blocks in model order; their position in that
list is the *MoE layer index* used by placement, profiles and adapters (a
DeepSeek model with dense first layers has fewer MoE layers than decoder layers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vela_ray.model.broker import ExpertBroker

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertsLayout:
    """Shapes and activation of one MoE block's experts (E experts, D hidden, I intermediate)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: str
    dtype: torch.dtype


@dataclass(frozen=True)
class MoeBlock:
    """One MoE block: `index` is its MoE layer index, `decoder_layer` its transformer layer."""

    index: int
    decoder_layer: int
    path: str  # module path of the block, e.g. "model.layers.3.mlp"
    block: nn.Module
    layout: ExpertsLayout

    @property
    def experts_path(self) -> str:
        return f"{self.path}.experts"


def experts_layout(experts: nn.Module, config, owner: str) -> ExpertsLayout:
    """Check that `experts` uses the fused gated layout vela-ray supports and describe it.

    Raises ValueError naming `owner` (the model class) for any other layout
    (biases, transposed or interleaved weights, non-gated experts).
    """
    if isinstance(experts, ExpertBroker):
        return experts.layout
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    unsupported = {
        "has_bias": getattr(experts, "has_bias", False),
        "is_transposed": getattr(experts, "is_transposed", False),
        "has_post_expert_norm": getattr(experts, "has_post_expert_norm", False),
        "not is_concatenated": not getattr(experts, "is_concatenated", True),
        "not has_gate": not getattr(experts, "has_gate", True),
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or bad:
        raise ValueError(
            f"{owner}: unknown experts layout in {type(experts).__name__} "
            f"({', '.join(bad) or 'no 3-D gate_up_proj/down_proj parameters'}); vela-ray supports "
            "fused gated experts (gate_up_proj [E, 2I, D], down_proj [E, D, I], no bias)"
        )
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{owner}: experts weights must be 3-D [E, ...], got {tuple(gate_up.shape)}")
    num_experts, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"{owner}: down_proj shape {tuple(down.shape)} does not match gate_up_proj "
            f"{tuple(gate_up.shape)}; expected {(num_experts, hidden, two_i // 2)}"
        )
    return ExpertsLayout(
        num_experts=num_experts,
        hidden_size=hidden,
        intermediate_size=two_i // 2,
        activation=getattr(config, "hidden_act", "silu"),
        dtype=gate_up.dtype,
    )


def find_moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """All MoE blocks of `model` in order; ValueError naming the model class if there are none."""
    owner = type(model).__name__
    config = getattr(model, "config", None)
    blocks: list[MoeBlock] = []
    for path, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or path.endswith("experts"):
            continue
        if not hasattr(module, "gate"):
            continue
        layout = experts_layout(experts, getattr(experts, "config", config), owner)
        match = _LAYER_RE.search(path + ".")
        decoder_layer = int(match.group(1)) if match else len(blocks)
        blocks.append(MoeBlock(len(blocks), decoder_layer, path, module, layout))
    if not blocks:
        raise ValueError(
            f"{owner} has no MoE block (a module with `gate` and `experts` submodules); "
            "vela-ray fine-tunes transformers-5 MoE models such as Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3"
        )
    return blocks


def top_k_of(model: nn.Module) -> int:
    """Experts per token (`num_experts_per_tok`) from the model config."""
    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None)
    if not top_k:
        raise ValueError(f"{type(model).__name__}: config has no num_experts_per_tok")
    return int(top_k)


def expert_weights(blocks: list[MoeBlock], keys=None) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, expert): (gate_up [2I, D], down [D, I])} sliced from in-memory fused experts.

    For building shards from a model already in memory (tests, single-process
    runs); the runtime reads experts from the checkpoint instead (`vela_ray.model.loading`).
    """
    wanted = keys if keys is not None else [(b.index, e) for b in blocks for e in range(b.layout.num_experts)]
    by_index = {b.index: b for b in blocks}
    out = {}
    for layer, expert in wanted:
        experts = by_index[layer].block.experts
        out[(layer, expert)] = (experts.gate_up_proj[expert].detach(), experts.down_proj[expert].detach())
    return out


def attach_brokers(model: nn.Module, dispatcher) -> list[nn.Module]:
    """Replace every MoE block's `experts` with an `ExpertBroker` sharing `dispatcher`.

    Gradient checkpointing is refused: recomputing a block in backward would
    dispatch its rows to the workers a second time and overwrite the graph they
    keep for that backward.
    """
    if _checkpointing_enabled(model):
        new_name = hasattr(model, "activation_checkpointing_disable")  # transformers' name since the rename
        disable = "activation_checkpointing_disable" if new_name else "gradient_checkpointing_disable"
        raise ValueError(
            f"{type(model).__name__} has gradient (activation) checkpointing enabled; vela-ray's expert broker "
            f"does not support it (experts run remotely). Call model.{disable}()"
        )
    blocks = find_moe_blocks(model)
    table_shape = tuple(dispatcher.expert_to_worker.shape)
    if table_shape != (len(blocks), blocks[0].layout.num_experts):
        raise ValueError(
            f"placement table is {table_shape} but {type(model).__name__} has "
            f"{len(blocks)} MoE layers x {blocks[0].layout.num_experts} experts"
        )
    brokers = []
    for block in blocks:
        broker = ExpertBroker(block.index, dispatcher, block.layout)
        block.block.experts = broker
        brokers.append(broker)
    return brokers


def _checkpointing_enabled(model: nn.Module) -> bool:
    """Whether activation checkpointing is on, read without touching transformers' deprecated alias.

    transformers 5 renamed `is_gradient_checkpointing` to `is_activation_checkpointing`; reading
    the old name emits a FutureWarning, so it is asked only of models that lack the new one.
    """
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
