"""Find the MoE blocks of a transformers-5 model and describe their experts.

A MoE block is found by structure, not by attribute names: a module whose
`experts` child is an experts module, i.e. a module whose own parameters are
stacks with one row per expert (`gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`,
gpt-oss's transposed `[E, D, 2I]` with biases, ...), called by its block as
`experts(hidden_states, expert_index, expert_weights)`. The router may be named
`gate`, `router` or anything else: the broker replaces only `experts`, so the
block's own routing code runs unchanged. The shards compute with the family's own
experts class (see `vela_ray.model.experts`), so its gate, clamps, biases and
layout need no description here; what cannot be reproduced exactly is refused,
naming the class and the reason.

`find_moe_blocks` returns the blocks in model order; their position in that list
is the *MoE layer index* used by placement, profiles and adapters (a DeepSeek model
with dense first layers has fewer MoE layers than decoder layers).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn

from vela_ray.model.broker import ExpertBroker
from vela_ray.model.checkpoint_replay import recompute_contexts
from vela_ray.model.experts import ExpertsCall, experts_call, weight_stacks
from vela_ray.model.shared_expert import stand_in_shared_expert

def _register_unmapped_causal_lms() -> None:
    """transformers 5.23 defines Mistral4ForCausalLM but leaves it out of AutoModelForCausalLM's mapping
    (`families.unmapped_causal_lms` finds such classes); registering it lets every Auto* call here and in
    peft build the model from its config."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers import Mistral4Config, Mistral4ForCausalLM
    except ImportError:  # another transformers: nothing to register
        return
    AutoModelForCausalLM.register(Mistral4Config, Mistral4ForCausalLM, exist_ok=True)


_register_unmapped_causal_lms()

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertsLayout:
    """One MoE block's experts: E experts of hidden size D, their class and weight stacks."""

    num_experts: int
    hidden_size: int
    dtype: torch.dtype
    experts_class: str
    stacks: tuple[str, ...]  # the 3-D weight parameters LoRA adapts
    call: ExpertsCall = "routed"  # how the block calls them (see `experts.experts_call`)


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


def is_experts_module(module: nn.Module) -> bool:
    """A module holding a layer's experts: 3-D weight stacks of its own with one leading row per expert,
    or an `...Experts` class keeping its weights some other way (found, so it can be refused by name)."""
    if isinstance(module, ExpertBroker):
        return True
    if any(p.dim() == 3 for p in module.parameters(recurse=False)):
        return True
    return type(module).__name__.endswith("Experts") and any(True for _ in module.parameters())


def experts_layout(experts: nn.Module, config, owner: str) -> ExpertsLayout:
    """Describe `experts`, or refuse (ValueError naming `owner` and the class) what vela-ray cannot
    run exactly: another call signature, parameters that are not per expert, nested parameters."""
    if isinstance(experts, ExpertBroker):
        return experts.layout
    cls = type(experts).__name__
    call = experts_call(experts)
    if call is None:
        params = list(inspect.signature(type(experts).forward).parameters)[1:]
        raise ValueError(
            f"{owner}: {cls}.forward({', '.join(params)}) is called neither as experts(hidden_states, "
            "expert_index, expert_weights) nor as experts(rows grouped by expert); vela-ray cannot reproduce it")
    stacks = weight_stacks(experts)
    if not stacks:
        # Dbrx: DbrxExperts.forward slices self.mlp.w1/v1/w2 itself and passes the slices to DbrxExpertGLU.
        # peft 0.21 wraps `mlp` in a ParamWrapper that hides those attributes (AttributeError in forward);
        # tests/unit/test_every_family.py checks this still holds.
        flat = [f"{n} {list(p.shape)}" for n, p in experts.named_parameters()][:3]
        raise ValueError(
            f"{owner}: {cls} keeps its experts in flat 2-D matrices ({', '.join(flat)}) that its forward slices "
            "itself; peft cannot adapt them (its target_parameters wrapper hides them from this forward), so there "
            "is no peft adapter of these experts for vela-ray to reproduce")
    counts = {name: getattr(experts, name).shape[0] for name in stacks}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"{owner}: {cls}'s weight stacks hold different numbers of experts ({counts}); its forward computes the "
            "extra ids another way (e.g. identity 'zero' experts), which vela-ray does not route")
    num_experts = getattr(experts, stacks[0]).shape[0]
    not_per_expert = [n for n, p in experts.named_parameters(recurse=False) if p.dim() == 0 or p.shape[0] != num_experts]
    nested = [n for n, _ in experts.named_parameters() if "." in n]
    if not_per_expert or nested:
        raise ValueError(
            f"{owner}: {cls} has parameters that are not one row per expert ({(not_per_expert + nested)[:3]}); "
            "vela-ray cannot split them over workers")
    if call == "grouped" and any(p.dim() != 3 for p in experts.parameters(recurse=False)):
        raise ValueError(f"{owner}: {cls} is called on rows grouped by expert and has biases; a zero-padded "
                         "row would not give a zero output, so vela-ray cannot pad its groups exactly")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ExpertsLayout(num_experts=num_experts, hidden_size=int(text.hidden_size),
                         dtype=getattr(experts, stacks[0]).dtype, experts_class=cls, stacks=tuple(stacks),
                         call=call)


def find_moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """All MoE blocks of `model` in order; ValueError naming the model class if there are none."""
    owner = type(model).__name__
    config = getattr(model, "config", None)
    blocks: list[MoeBlock] = []
    for path, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or path.endswith("experts") or not is_experts_module(experts):
            continue
        layout = experts_layout(experts, config, owner)
        match = _LAYER_RE.search(path + ".")
        decoder_layer = int(match.group(1)) if match else len(blocks)
        blocks.append(MoeBlock(len(blocks), decoder_layer, path, module, layout))
    moe_like = sorted({type(m).__name__ for m in model.modules() if re.search(r"(Experts|MoE|MoA|Moe|MoeBlock)$", type(m).__name__)})
    if not blocks and moe_like:
        raise ValueError(
            f"{owner}: its MoE modules ({', '.join(moe_like[:3])}) do not keep a layer's experts as an `experts` "
            "child with one weight row per expert, called as experts(hidden_states, expert_index, expert_weights); "
            "vela-ray cannot route rows to them exactly")
    if not blocks:
        raise ValueError(
            f"{owner} has no MoE block (a module with an `experts` child holding one weight row per expert); "
            "vela-ray fine-tunes transformers-5 MoE models such as Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3"
        )
    return blocks


def experts_prototypes(config) -> dict[int, nn.Module]:
    """{MoE layer: the model's experts module} on the meta device: each layer's class, config and
    shapes without any memory, for `ExpertShard.from_weights`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return {b.index: b.block.experts for b in find_moe_blocks(skeleton)}


def top_k_of(model: nn.Module) -> int:
    """Experts per token, under whichever name the family's (text) config gives it."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_top_k"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"{type(model).__name__}: config names no experts per token (num_experts_per_tok)")


def expert_weights(blocks: list[MoeBlock], keys=None) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """{(layer, expert): {parameter name: that expert's slice}} from in-memory experts modules.

    For building shards from a model already in memory (tests, single-process
    runs); the runtime reads experts from the checkpoint instead (`vela_ray.model.loading`).
    """
    wanted = keys if keys is not None else [(b.index, e) for b in blocks for e in range(b.layout.num_experts)]
    by_index = {b.index: b for b in blocks}
    out = {}
    for layer, expert in wanted:
        experts = by_index[layer].block.experts
        tensors = [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]
        out[(layer, expert)] = {name: t[expert].detach() for name, t in tensors}
    return out


def attach_brokers(model: nn.Module, dispatcher, shared_experts: bool = True) -> list[nn.Module]:
    """Replace every MoE block's `experts` with an `ExpertBroker` sharing `dispatcher`; with `shared_experts`
    (`training.overlap.shared_experts`), a block's shared expert computes while its broker's rows are away, its router
    and shared expert made stand-ins of themselves (`shared_expert.stand_in_shared_expert`).

    A model that already checkpoints its activations gets the broker's recompute contexts
    (`enable_activation_checkpointing`): a plain recompute would send every row to the
    workers a second time and overwrite the graph they keep for backward.
    """
    if _checkpointing_enabled(model):
        enable_activation_checkpointing(model)
    blocks = find_moe_blocks(model)
    table_shape = tuple(dispatcher.expert_to_worker.shape)
    if table_shape != (len(blocks), blocks[0].layout.num_experts):
        raise ValueError(
            f"placement table is {table_shape} but {type(model).__name__} has "
            f"{len(blocks)} MoE layers x {blocks[0].layout.num_experts} experts"
        )
    brokers = []
    for block in blocks:
        shared = stand_in_shared_expert(block.block, block.path) if shared_experts else None
        broker = ExpertBroker(block.index, dispatcher, block.layout, shared)
        block.block.experts = broker
        brokers.append(broker)
    return brokers


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer (transformers' own mechanism, torch's non-reentrant checkpoint) with
    the expert broker's recompute contexts: backward recomputes the backbone's activations but replays
    the experts' outputs, so expert rows cross the data plane once per step in each direction."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing in transformers; "
                         "set training.activation_checkpointing: false")
    kwargs = {"use_reentrant": False, "context_fn": recompute_contexts}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' name since the rename
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _checkpointing_enabled(model: nn.Module) -> bool:
    """Whether activation checkpointing is on, read without touching transformers' deprecated alias.

    transformers 5 renamed `is_gradient_checkpointing` to `is_activation_checkpointing`; reading
    the old name emits a FutureWarning, so it is asked only of models that lack the new one.
    """
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
