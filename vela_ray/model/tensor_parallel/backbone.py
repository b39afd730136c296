"""Tensor parallelism of the master's backbone (issue 37): attention by heads, dense MLPs by columns, with LoRA.

`parallelize_backbone(model, mesh)` shards a (peft-wrapped) transformers causal LM over a TP group in place, in
the Megatron layout (thesis §3.1.1): in each attention block Q/K/V are column-parallel (a rank keeps whole
heads) and O is row-parallel; in each dense or shared-expert MLP gate/up are column-parallel and down is
row-parallel. Everything else (norms, routers, the routed experts, MoE blocks' own code) runs replicated:
identical inputs, identical computation, identical outputs on every rank.

LoRA follows the thesis's rule (§3.2): on a column-parallel W, `lora_A` is replicated and `lora_B` sharded on
its output dim; on a row-parallel W, `lora_A` is sharded on its input dim and `lora_B` replicated, and
`x_i A_i B` is added to the partial `x_i W_i` before the block's all-reduce. peft's own `LoraLayer`s are what
is sharded (their parameters become the local shards, their forward is peft's): the adapter stays peft's, and
`gather_lora_state_dict` gives back peft's full adapter whatever the TP size.

Why regions instead of per-module collectives (and instead of DTensor for the linear layers)
--------------------------------------------------------------------------------------------
Each sharded block (attention; dense or shared-expert MLP) is a *TP region*: it is entered through an operator
that is the identity forward and one all-reduce backward (Megatron's `f`), and left through one that is one
all-reduce forward and the identity backward (`g`). Between the two, rank i computes a partial y_i = F_i(x) with
sum_i y_i the block's output, so the gradient of *anything replicated that the region uses* is the sum over
ranks of what each rank's backward computes: the block input's gradient, but equally the gradient of a
replicated LoRA factor (colwise lora_A: grad = x^T sum_i g_i B_i; rowwise lora_B: grad = sum_i u_i^T g) and of
the replicated low-rank projections of MLA. `f` takes those factors as inputs too (the region computes with
aliases `f` returns), so its single backward all-reduce carries [grad x, grad of every replicated trainable
factor] in one buffer: per layer, LoRA adds *no* collective to the base TP's two forward and two backward
all-reduces, only r*(d_in or d_out) elements per factor to the backward one, and every replicated factor ends
with the same, exact gradient on every rank (no per-parameter reduction afterwards).

torch's `ColwiseParallel`/`RowwiseParallel` cannot express this: each styled module owns its redistributes, so
a LoRA-wrapped colwise module all-reduces its input gradient itself (once for the base, once more for lora_B's
input, or a Partial gradient left on lora_A that needs its own all-reduce), and a rowwise one either all-reduces
lora_A's output or leaves lora_B's gradient Partial. Hence the small explicit `_EnterRegion`/`_ExitRegion`
operators (plain `torch.distributed` collectives, which `CommDebugMode` counts like DTensor's). The embedding
and LM head, which LoRA does not adapt, are sharded with torch's own plans (vocab-parallel `RowwiseParallel` and
`ColwiseParallel` gathering the logits: both exact, a sum with zeros and a concatenation), so transformers'
loss sees the full logits.

Multi-head Latent Attention (DeepSeek-V3)
-----------------------------------------
Sharded by heads: `q_b_proj` (or `q_proj` without a q LoRA rank) and `kv_b_proj` colwise (their outputs are
head-major: heads x (nope + rope) and heads x (nope + v)), `o_proj` rowwise. Replicated inside the region:
`q_a_proj` and `kv_a_proj_with_mqa` with their layernorms, because their outputs are latents every head reads
(the q/kv compression and the single rope key shared by all heads, MQA-style); splitting them would need a
collective before the b-projections. They run on the full x on every rank; their (and their LoRA factors')
gradients are partial per rank and summed by `f` like any replicated factor's.

In the runtime (`cluster.master_tp`, `actors.masters.RayPeers`)
-------------------------------------------------------------
A master's ranks join one mesh (`join_mesh`: dims "dp" x "tp", the process's default group). The routed experts
are the ExpertManagers', reached through brokers: on a TP rank each broker sends only its share of the layer's
tokens (`TensorParallelShare`: `_ShareRows` in, `_GatherRows` out, an all-gather each way), so the group's rows leave
once. Checkpoints hold full tensors (`merge_shards` on rank 0, `shard_of` on load), so a run resumes at any TP
size. With several data-parallel masters, `shard_frozen` (FSDP2, `masters.shard_frozen_backbone`) also shards
every decoder layer's frozen weights over "dp", LoRA left whole.

Refused (ValueError, one line naming the reason): head counts, KV head counts, MLP widths or the vocabulary
not divisible by the TP size; an attention whose norms span several heads (OLMoE's q_norm/k_norm normalize
over all heads' features at once, which a head shard cannot compute without another collective); DoRA, LoRA
biases; tied embeddings with vocab sharding.

LoRA dropout draws peft's masks: every rank of a group starts a step from its first rank's RNG state
(`agree_on_rng`), so a replicated input (a column-parallel lora_A's) gets the same mask on every rank, drawn as
peft draws it; a row-parallel lora_A's sharded input gets its slice of the full mask (`ShardedDropout` draws the
whole input's mask, as peft does, and keeps its columns), so the ranks' RNG streams stay in step with peft's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

if TYPE_CHECKING:
    from vela_ray.model.dispatch_stages import BrokerCall

logger = logging.getLogger(__name__)

Style = Literal["colwise", "rowwise"]

_QKV = ("q_proj", "k_proj", "v_proj")
_MLA_COLWISE = ("q_proj", "q_b_proj", "kv_b_proj")
_MLA_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")


class TensorParallelConfig(BaseModel):
    """How the backbone is split over one TP group (`cluster.master_tp`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_vocab: bool = Field(True, description="vocab-parallel embedding and LM head (torch's plans); "
                                                "False keeps both replicated")


@dataclass
class TensorParallelPlan:
    """What `parallelize_backbone` did, for gathering, clipping and tests."""

    group: dist.ProcessGroup
    rank: int
    size: int
    # model parameter name -> the dim it is sharded on (only trainable parameters: what gathering needs)
    sharded: dict[str, int] = field(default_factory=dict)
    # module path -> style, every linear sharded (peft LoraLayers and plain linears)
    styles: dict[str, Style] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)  # module paths of the TP regions, in model order
    # region path -> its replicated trainable parameters (relative names), whose partial gradients ride on the
    # region's backward all-reduce
    replicated: dict[str, list[str]] = field(default_factory=dict)
    vocab_parallel: list[str] = field(default_factory=list)  # embedding / LM head paths sharded by torch's plans
    draws_dropout: bool = False  # some LoRA input has dropout: the ranks must draw from one RNG state


# --------------------------------------------------------------------------------------------------
# The region operators
# --------------------------------------------------------------------------------------------------

def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Sum `tensors` over `group` with one all-reduce per dtype (one in an fp32 or uniformly cast model)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]


class _EnterRegion(torch.autograd.Function):
    """Megatron's `f`: identity forward on the region's input and replicated trainable factors; backward sums
    all their gradients (each rank's is its heads'/columns' share) over the group in one all-reduce."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, x: torch.Tensor, *params: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (x, *params)]
        return (x.view_as(x), *(p.view_as(p) for p in params))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        wanted = [i for i, g in enumerate(grads) if ctx.needs_input_grad[i + 1]]
        dense = [grads[i] if grads[i] is not None else torch.zeros(ctx.shapes[i][0], dtype=ctx.shapes[i][1],
                                                                    device=ctx.shapes[i][2]) for i in wanted]
        summed = _all_reduce_flat([g.contiguous() for g in dense], ctx.group) if dense else []
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(wanted, summed):
            out[i] = g
        return (None, *out)


class _ExitRegion(torch.autograd.Function):
    """Megatron's `g`: sums the ranks' partial outputs forward (one all-reduce); identity backward (the full
    output gradient is what every rank's partial output receives)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, y: torch.Tensor):  # type: ignore[override]
        out = y.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return None, grad


@contextlib.contextmanager
def _aliased(module: nn.Module, names: list[str], tensors: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, `module`'s parameters `names` read as `tensors` (the aliases `_EnterRegion` returned,
    so their gradients pass through its all-reduce); the parameters are put back afterwards, whatever happens."""
    saved = []
    try:
        for name, tensor in zip(names, tensors):
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = tensor  # type: ignore[assignment]  # a non-leaf alias, for this call only
        yield
    finally:
        for owner, leaf, param in reversed(saved):
            owner._parameters[leaf] = param


class _Region:
    """The forward of one TP region: `f` on the hidden states and replicated factors, the block's own forward
    on local shards, `g` on its (first) output."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, replicated: list[str]):
        self.module = module
        self.group = group
        self.inner = module.forward  # the block's own (bound) forward
        self.input_name = list(inspect.signature(type(module).forward).parameters)[1]  # after self
        self.replicated = replicated  # the block's replicated trainable parameters (names relative to it)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args_l = list(args)
        if args_l:
            hidden = args_l[0]
        else:
            hidden = kwargs[self.input_name]
        params = [self.module.get_parameter(n) for n in self.replicated]
        hidden, *aliases = _EnterRegion.apply(self.group, hidden, *params)
        if args_l:
            args_l[0] = hidden
        else:
            kwargs[self.input_name] = hidden
        with _aliased(self.module, self.replicated, aliases):
            out = self.inner(*args_l, **kwargs)
        if isinstance(out, tuple):
            return (_ExitRegion.apply(self.group, out[0]), *out[1:])
        return _ExitRegion.apply(self.group, out)


# --------------------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------------------

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


def _shard_dropout(module: nn.Module, adapter: str, style: Style, plan: TensorParallelPlan) -> None:
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
    runs on GPUs): one broadcast over the host, before a training step, so the ranks draw the same dropout masks
    (the first rank's state is the one a single master has: seeded per step, saved in checkpoints)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # alike on every rank: all on GPUs or none
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if cuda else [])
    lengths = [len(s) for s in states]
    flat = torch.cat(states)
    dist.broadcast(flat, src=dist.get_global_rank(plan.group, 0), group=plan.group)
    torch.set_rng_state(flat[: lengths[0]].clone())
    if cuda:
        torch.cuda.set_rng_state(flat[lengths[0]:].clone())


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
            _shard_dropout(module, adapter, style, plan)
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


def _group_of(mesh_or_group: Any) -> tuple[dist.ProcessGroup, Any]:
    """(process group, device mesh or None) from a 1-D DeviceMesh or a ProcessGroup."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"tensor parallelism takes a 1-D device mesh, got {mesh_or_group.ndim}-D")
        return mesh_or_group.get_group(), mesh_or_group
    return mesh_or_group, None


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
    group, mesh = _group_of(mesh_or_group)
    plan = TensorParallelPlan(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))
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
        region = _Region(module, group, [n for n, p in module.named_parameters()
                                         if p.requires_grad and f"{path}.{n}" not in sharded])
        module.forward = region  # type: ignore[method-assign]
        plan.regions.append(path)
        plan.replicated[path] = list(region.replicated)
    if plan.size > 1 and config.shard_vocab:
        _shard_vocab(model, mesh, group, plan)
    model._vela_tp_plan = plan  # type: ignore[assignment]
    logger.info("tensor parallel over %d ranks: %d regions, %d sharded linears, vocab-parallel %s",
                plan.size, len(plan.regions), len(plan.styles), plan.vocab_parallel or "no")
    return plan


def join_mesh(store: dist.Store, rank: int, dp: int, tp: int, device: torch.device, timeout_s: float,
              address: str | None = None) -> Any:
    """Join a mesh of `dp` x `tp` master processes through `store` (rank = dp_rank * tp + tp_rank) and return its
    2-D DeviceMesh, dims ("dp", "tp"). Its group becomes the process's default group, which torch's DTensor plans
    (the vocab-parallel embedding and LM head) and FSDP2 need; a master's other groups (the collective data plane,
    the data-parallel masters' own) are groups of their own, so nothing else in the process uses the default one.
    On GPUs it is NCCL for device tensors and gloo for host ones. `address`: this process's address as the others
    reach it (gloo binds the interface that holds it; its default, the hostname's, is the loopback on many hosts)."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group: one mesh per master process")
    if address and not address.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _interface_of(address)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=dp * tp,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def _interface_of(address: str) -> str | None:
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)


def vocab_shardable(model: nn.Module, size: int) -> bool:
    """Whether `_shard_vocab` can split `model`'s embedding and LM head over `size` ranks: untied, and a
    vocabulary divisible by `size`. Otherwise both stay replicated (exact too; only their memory is not split)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and head.weight is embed.weight:
        return False
    return all(m is None or m.weight.shape[0] % size == 0 for m in (embed, head))


def _shard_vocab(model: nn.Module, mesh: Any, group: dist.ProcessGroup, plan: TensorParallelPlan) -> None:
    """Embedding vocab-parallel and LM head colwise with gathered logits: torch's plans (exact: the embedding's
    all-reduce adds zeros, the LM head's all-gather concatenates)."""
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
        if module is None or isinstance(module, _lora_layer_cls()) or not isinstance(module, (nn.Embedding, nn.Linear)):
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


# --------------------------------------------------------------------------------------------------
# Optimizer support and export
# --------------------------------------------------------------------------------------------------

def grad_sq_norm(model: nn.Module, plan: TensorParallelPlan) -> float:
    """The squared gradient norm of the whole (unsharded) set of `model`'s trainable parameters, on every rank:
    sharded ones' squares summed over the group (one all-reduce), replicated ones' counted once, each part in
    torch's fused kernels (`get_total_norm`, as a single master's `optim.grad_sq_norm`) with one host sync. Also a
    barrier: it returns only when every rank's backward has (so their brokers' backward calls have) ended."""
    from torch.nn.utils import get_total_norm

    sharded, replicated = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            (sharded if name in plan.sharded else replicated).append(p.grad.detach())
    sq = [float(get_total_norm(grads, 2.0)) ** 2 if grads else 0.0 for grads in (sharded, replicated)]
    return all_sum(sq[0], plan) + sq[1]


def refuse_grouped_experts(layouts: list, size: int) -> None:
    """A master split over `size` ranks shares each MoE layer's rows among them (`TensorParallelShare`), which needs
    experts called on routed rows: ValueError (one line) for a model whose experts are called on rows grouped by
    expert (`modeling.ExpertsLayout.call`, e.g. Llama 4)."""
    grouped = [layout for layout in layouts if layout.call != "routed"]
    if grouped:
        raise ValueError(f"cluster.master_tp: {size} needs experts called on routed rows; "
                         f"{grouped[0].experts_class} is called on rows grouped by expert: use master_tp: 1")


def all_sum(value: float, plan: TensorParallelPlan) -> float:
    """`value` summed over the TP group (every rank gets the sum): e.g. the experts' squared gradient norm, which
    only the group's first rank reads from the workers, the others adding 0."""
    buf = torch.tensor([value], dtype=torch.float64, device=_device_of(plan))
    dist.all_reduce(buf, group=plan.group)
    return float(buf.item())


def _device_of(plan: TensorParallelPlan) -> torch.device:
    """Where the group's collectives run: NCCL's on this rank's GPU, gloo's on the host."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(plan.group) == "nccl" \
        else torch.device("cpu")


def clip_grad_norm_(model: nn.Module, plan: TensorParallelPlan, max_norm: float | None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the whole (unsharded) set of trainable parameters (`grad_sq_norm`).
    Returns the norm."""
    total = torch.tensor(grad_sq_norm(model, plan)).sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in model.parameters():
            if p.requires_grad and p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


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


# --------------------------------------------------------------------------------------------------
# The routed experts over a TP group: each rank sends a disjoint share of a layer's rows
# --------------------------------------------------------------------------------------------------

def row_bounds(num_rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [lo, hi) of `num_rows` rows: sizes differ by at most one, the first
    `num_rows % size` ranks taking one more."""
    base, extra = divmod(num_rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _all_gather_rows(part: torch.Tensor, num_rows: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The ranks' row shares (`row_bounds`) of a [num_rows, ...] tensor, concatenated in rank order: one all-gather,
    of shares padded to the largest."""
    longest = -(-num_rows // size)
    padded = part.new_zeros((longest, *part.shape[1:]))
    padded[: len(part)] = part
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[: hi - lo] for piece, (lo, hi) in
                      zip(pieces, (row_bounds(num_rows, r, size) for r in range(size)))])


class _ShareRows(torch.autograd.Function):
    """This rank's rows of a replicated tensor; backward all-gathers the shares' gradients, so the replicated
    tensor's gradient is whole, and equal, on every rank."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, rank: int, size: int, x: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.size, ctx.num_rows = group, size, x.shape[0]
        lo, hi = row_bounds(x.shape[0], rank, size)
        return x[lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return None, None, None, _all_gather_rows(grad.contiguous(), ctx.num_rows, ctx.group, ctx.size)


class _GatherRows(torch.autograd.Function):
    """Every rank's share of the rows, concatenated (one all-gather); backward keeps this rank's rows of the
    (replicated, equal on every rank) gradient."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, rank: int, size: int, num_rows: int,  # type: ignore[override]
                part: torch.Tensor):
        ctx.bounds = row_bounds(num_rows, rank, size)
        return _all_gather_rows(part.contiguous(), num_rows, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        lo, hi = ctx.bounds
        return None, None, None, None, grad[lo:hi]


class TensorParallelShare:
    """The broker's first stage on a rank of a tensor-parallel master (`ExpertDispatcher.share_rows`), for MoE
    blocks whose inputs are replicated over the TP group: this rank dispatches its share of the tokens
    (`row_bounds`), so the group's rows leave through all its ranks, each row once, and the combined outputs are
    gathered (one all-gather forward; one for the hidden states' and routing weights' gradients backward).
    Exact: every token's output is computed once, by one rank, as it would be whole; the experts' LoRA gradients
    reach the workers once. Experts called on grouped rows are refused beforehand (`refuse_grouped_experts`)."""

    def __init__(self, plan: TensorParallelPlan):
        self.plan = plan

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        if self.plan.size == 1:
            return call
        group, rank, size = self.plan.group, self.plan.rank, self.plan.size
        lo, hi = row_bounds(call.whole_tokens, rank, size)
        return replace(call, hidden_TD=_ShareRows.apply(group, rank, size, call.hidden_TD),
                       top_k_index_TK=call.top_k_index_TK[lo:hi],
                       top_k_weights_TK=_ShareRows.apply(group, rank, size, call.top_k_weights_TK))

    def combine(self, call: BrokerCall, out_TD: torch.Tensor) -> torch.Tensor:
        if self.plan.size == 1:
            return out_TD
        return _GatherRows.apply(self.plan.group, self.plan.rank, self.plan.size, call.whole_tokens, out_TD)


# --------------------------------------------------------------------------------------------------
# Checkpoint state: full tensors whatever the TP size
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# The frozen backbone sharded over data-parallel masters (FSDP2; `masters.shard_frozen_backbone`)
# --------------------------------------------------------------------------------------------------

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
