"""Sharding the backbone: `parallelize_backbone` splits a (peft-wrapped) transformers causal LM over a TP group in
place, in the Megatron layout (thesis §3.1.1), and `check_tensor_parallel` says beforehand whether it can.

In each attention block Q/K/V are column-parallel (a rank keeps whole heads) and O is row-parallel; in each dense
or shared-expert MLP gate/up are column-parallel and down is row-parallel, each block a TP region (`regions`).
LoRA follows the thesis's rule (§3.2): on a column-parallel W, `lora_A` is replicated and `lora_B` sharded on its
output dim; on a row-parallel W, `lora_A` is sharded on its input dim and `lora_B` replicated. peft's own
`LoraLayer`s are what is sharded (their parameters become the local shards, their forward is peft's).

Multi-head Latent Attention (DeepSeek-V3)
-----------------------------------------
Sharded by heads: `q_b_proj` (or `q_proj` without a q LoRA rank) and `kv_b_proj` colwise (their outputs are
head-major: heads x (nope + rope) and heads x (nope + v)), `o_proj` rowwise. Replicated inside the region:
`q_a_proj` and `kv_a_proj_with_mqa` with their layernorms, because their outputs are latents every head reads
(the q/kv compression and the single rope key shared by all heads, MQA-style); splitting them would need a
collective before the b-projections. They run on the full x on every rank; their (and their LoRA factors')
gradients are partial per rank and summed by `f` like any replicated factor's.

Refused (ValueError, one line naming the reason): head counts, KV head counts, MLP widths or the vocabulary
not divisible by the TP size; an attention whose norms span several heads (OLMoE's q_norm/k_norm normalize
over all heads' features at once, which a head shard cannot compute without another collective); DoRA, LoRA
biases; tied embeddings with vocab sharding.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from vela_ray.model.tensor_parallel.dropout import shard_dropout
from vela_ray.model.tensor_parallel.group import group_of, is_registered
from vela_ray.model.tensor_parallel.plan import Style, TensorParallelConfig, TensorParallelPlan
from vela_ray.model.tensor_parallel.regions import Region
from vela_ray.model.tensor_parallel.vocab import shard_vocab

logger = logging.getLogger(__name__)

_QKV = ("q_proj", "k_proj", "v_proj")
_MLA_COLWISE = ("q_proj", "q_b_proj", "kv_b_proj")
_MLA_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _lora_layer_cls():
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _base_linear(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear a (peft-wrapped) projection computes with, or None if it is something else."""
    if isinstance(module, _lora_layer_cls()):
        module = module.get_base_layer()
    return module if isinstance(module, nn.Linear) else None


def _check_lora(module: nn.Module, owner: str) -> None:
    """Refuse the LoRA variants whose sharded math is not the plain one (one line, naming the reason)."""
    if not isinstance(module, _lora_layer_cls()):
        return
    for adapter in module.lora_A:
        if module.use_dora.get(adapter, False):
            raise ValueError(f"{owner}: DoRA is not supported under tensor parallelism (its magnitude needs the "
                             "norm of whole weight rows, which a row-parallel shard does not hold)")
        if getattr(module, "lora_bias", {}).get(adapter, False):
            raise ValueError(f"{owner}: LoRA biases are not supported under tensor parallelism (a replicated "
                             "lora_B bias of a row-parallel layer would be added once per rank)")


def _shard(module: nn.Module, name: str, dim: int, rank: int, size: int) -> None:
    """Replace `module.<name>` by its `rank`-th of `size` equal chunks along `dim` (a new Parameter)."""
    param = getattr(module, name)
    if param is None:
        return
    chunk = param.detach().chunk(size, dim)[rank].clone()
    setattr(module, name, nn.Parameter(chunk, requires_grad=param.requires_grad))


def _shard_linear(path: str, module: nn.Module, style: Style, plan: TensorParallelPlan, prefix: str) -> None:
    """Shard one projection (a peft LoraLayer or a plain nn.Linear) in `style`, its LoRA by the thesis's rule."""
    base = _base_linear(module)
    assert base is not None, path
    _check_lora(module, path)
    rank, size = plan.rank, plan.size
    dim = base.out_features if style == "colwise" else base.in_features
    if dim % size:
        raise ValueError(f"{path}: {style} sharding needs {'out' if style == 'colwise' else 'in'}_features={dim} "
                         f"divisible by the TP size {size}")
    base_path = f"{prefix}{path}" + (".base_layer" if base is not module else "")
    if style == "colwise":
        _shard(base, "weight", 0, rank, size)
        _shard(base, "bias", 0, rank, size)
        base.out_features //= size
    else:
        _shard(base, "weight", 1, rank, size)
        if base.bias is not None and base.bias.requires_grad:
            raise ValueError(f"{base_path}: a trainable bias of a row-parallel layer is not supported (it is added "
                             "on one rank only, so its gradient would be summed over ranks it is not used on)")
        if base.bias is not None and rank != 0:  # added once: rank 0's partial carries it into the all-reduce
            with torch.no_grad():
                base.bias.zero_()
        base.in_features //= size
    for pname, p in base.named_parameters(recurse=False):
        if p.requires_grad and (pname == "weight" or style == "colwise"):
            plan.sharded[f"{base_path}.{pname}"] = 0 if style == "colwise" else 1
    if base is not module:  # peft's LoraLayer: its factors follow the thesis's rule
        factors = module.lora_B if style == "colwise" else module.lora_A
        tag = "lora_B" if style == "colwise" else "lora_A"
        for adapter, lin in factors.items():
            shard_dropout(module, adapter, style, plan)
            _shard(lin, "weight", 0 if style == "colwise" else 1, rank, size)
            if style == "colwise":
                lin.out_features //= size
            else:
                lin.in_features //= size
            if lin.weight.requires_grad:
                plan.sharded[f"{prefix}{path}.{tag}.{adapter}.weight"] = 0 if style == "colwise" else 1
        if style == "colwise":
            module.out_features //= size
        else:
            module.in_features //= size
    plan.styles[f"{prefix}{path}"] = style


def _attention_plan(path: str, attn: nn.Module, size: int) -> tuple[dict[str, Style], dict[str, int]]:
    """({child: style}, {head-count attribute: local value}) for an attention block, or ValueError."""
    owner = f"{type(attn).__name__} at {path}"
    children = dict(attn.named_children())
    linears = {n for n, m in children.items() if _base_linear(m) is not None}
    if "kv_b_proj" in children:  # MLA
        heads_from = "q_b_proj" if "q_b_proj" in children else "q_proj"
        head_dim = int(getattr(attn, "qk_head_dim"))
        heads = _base_linear(children[heads_from]).out_features // head_dim  # type: ignore[union-attr]
        kv_heads = heads
        styles: dict[str, Style] = {n: "colwise" for n in _MLA_COLWISE if n in linears}
        replicated = {n for n in _MLA_REPLICATED if n in children}
    elif set(_QKV) <= linears:
        head_dim = int(getattr(attn, "head_dim"))
        heads = _base_linear(children["q_proj"]).out_features // head_dim  # type: ignore[union-attr]
        kv_heads = _base_linear(children["k_proj"]).out_features // head_dim  # type: ignore[union-attr]
        styles = {n: "colwise" for n in _QKV}
        replicated = set()
        for name in ("q_norm", "k_norm"):  # per-head norms (Qwen3) are fine; norms over all heads are not
            norm = children.get(name)
            if norm is not None and sum(p.numel() for p in norm.parameters()) not in (0, head_dim):
                width = sum(p.numel() for p in norm.parameters())
                raise ValueError(f"{owner}: {name} normalizes over {width} features (all heads at once, not one "
                                 f"head's {head_dim}), which a head shard cannot compute without another collective")
            if norm is not None:
                replicated.add(name)
    else:
        raise ValueError(f"{owner}: neither q/k/v/o projections nor MLA (q_b/kv_b/o) projections; "
                         "vela-ray does not know how to shard it by heads")
    if "o_proj" not in linears:
        raise ValueError(f"{owner}: no o_proj linear to make row-parallel")
    styles["o_proj"] = "rowwise"
    unknown = [n for n, m in children.items() if n not in styles and n not in replicated
               and any(True for _ in m.parameters())]
    if unknown:
        raise ValueError(f"{owner}: parameterized children {unknown} that vela-ray does not know how to shard")
    if heads % size or kv_heads % size:
        raise ValueError(f"{owner}: {heads} attention heads and {kv_heads} KV heads must both be divisible by the "
                         f"TP size {size} (a rank keeps whole heads)")
    counts = {"num_heads": heads // size, "num_attention_heads": heads // size,
              "num_key_value_heads": kv_heads // size}
    return styles, {k: v for k, v in counts.items() if isinstance(getattr(attn, k, None), int)}


def _is_attention(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return "o_proj" in children and any(n in children for n in ("q_proj", "q_b_proj", "q_a_proj"))


def _is_dense_mlp(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return all(n in children and _base_linear(children[n]) is not None for n in _MLP) and "experts" not in children


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Raise ValueError (one line, naming the reason) if `model` cannot be split exactly over `size` ranks."""
    for path, module in model.named_modules():
        if _is_attention(module):
            styles, _ = _attention_plan(path, module, size)
            for child in styles:
                _check_lora(getattr(module, child), f"{path}.{child}")
                base = _base_linear(getattr(module, child))
                width = base.out_features if styles[child] == "colwise" else base.in_features  # type: ignore[union-attr]
                if width % size:
                    raise ValueError(f"{path}.{child}: width {width} not divisible by the TP size {size}")
        elif _is_dense_mlp(module):
            for child in _MLP:
                _check_lora(getattr(module, child), f"{path}.{child}")
            width = _base_linear(module.down_proj).in_features  # type: ignore[union-attr]
            if width % size:
                raise ValueError(f"{type(module).__name__} at {path}: intermediate size {width} not divisible by "
                                 f"the TP size {size}")
        elif _base_linear(module) is not None and isinstance(module, _lora_layer_cls()):
            _check_lora(module, path)


def parallelize_backbone(model: nn.Module, mesh_or_group: Any,
                         config: TensorParallelConfig | None = None) -> TensorParallelPlan:
    """Shard `model` (a transformers causal LM, plain or peft-wrapped, every rank holding the same full weights)
    in place over the TP group `mesh_or_group` (1-D DeviceMesh or ProcessGroup); returns the plan.

    Build the peft adapter *before* calling this: peft must see the full-size layers. After it, an optimizer
    over `model.parameters()` steps local shards; use `clip_grad_norm_` and `gather_lora_state_dict` from here.
    """
    config = config or TensorParallelConfig()
    if getattr(model, "_vela_tp_plan", None) is not None:
        raise ValueError(f"{type(model).__name__} is already tensor-parallel")
    group, mesh = group_of(mesh_or_group)
    plan = TensorParallelPlan(group=group, rank=group.rank(), size=group.size())  # registered with torch or not
    check_tensor_parallel(model, plan.size)
    regions: list[tuple[str, nn.Module]] = []
    for path, module in list(model.named_modules()):
        if _is_attention(module):
            styles, counts = _attention_plan(path, module, plan.size)
            for child, style in styles.items():
                _shard_linear(child, getattr(module, child), style, plan, f"{path}.")
            for attr, value in counts.items():
                setattr(module, attr, value)
            regions.append((path, module))
        elif _is_dense_mlp(module):
            for child in _MLP:
                _shard_linear(child, getattr(module, child), "rowwise" if child == "down_proj" else "colwise",
                              plan, f"{path}.")
            regions.append((path, module))
    if not regions:
        raise ValueError(f"{type(model).__name__}: no attention or dense MLP block to shard")
    sharded = set(plan.sharded)
    for path, module in regions:
        region = Region(module, group, [n for n, p in module.named_parameters()
                                         if p.requires_grad and f"{path}.{n}" not in sharded])
        module.forward = region  # type: ignore[method-assign]
        plan.regions.append(path)
        plan.replicated[path] = list(region.replicated)
    if plan.size > 1 and config.shard_vocab and mesh is None and not is_registered(group):
        logger.info("embedding and LM head replicated over the %d TP ranks: their group is not registered with "
                    "torch.distributed (made directly, as collective.make_group makes one), and torch's "
                    "vocab-parallel plans need a DeviceMesh of a registered group", plan.size)
    elif plan.size > 1 and config.shard_vocab:
        shard_vocab(model, mesh, group, plan)
    model._vela_tp_plan = plan  # type: ignore[assignment]
    logger.info("tensor parallel over %d ranks: %d regions, %d sharded linears, vocab-parallel %s",
                plan.size, len(plan.regions), len(plan.styles), plan.vocab_parallel or "no")
    return plan
