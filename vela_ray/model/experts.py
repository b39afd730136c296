"""ExpertShard: the experts one worker hosts, computed by the model family's own experts code.

Legend: R = rows routed to this shard in one call, D = hidden size, E = experts of
one MoE layer hosted here, r = LoRA rank.

Exact by construction: for each MoE layer the shard holds an instance of the
family's experts class (MixtralExperts, GptOssExperts, DeepseekV4Experts, ...)
that keeps only this worker's experts, so gate functions, clamps, biases,
transposed or interleaved layouts are the family's, never a re-implementation.
Classes that follow transformers' experts contract (made with
`use_experts_implementation`, run through grouped_mm/batched_mm) are computed as
that contract says, with the class's own `_apply_gate` and LoRA kept low-rank,
x W + s (x A^T) B^T, as grouped matrix multiplies over rows sorted by expert
(`LayerExperts._low_rank`, `grouped_mm`); any other class runs its own
`forward` with peft's fold. LoRA is peft's math on the fused weight stacks
(`LoraConfig(target_parameters=[...])`, `peft.tuners.lora.ParamWrapper`): each
stack W [E, a, b] is used as

    W' = baddbmm(W, lhs, rhs, alpha=s)      s = alpha / r (alpha / sqrt(r) with rsLoRA), the stack's own
    lhs, rhs = B_e [a, r], A_e [r, b]       when W stores [out, in] (is_transposed False)
    lhs, rhs = A_e^T [a, r], B_e^T [r, b]   when W stores [in, out] (is_transposed True)

which is what peft folds into the parameter for the original model; each expert's
A_e [r, in] and B_e [out, r] map one to one onto peft's fused factors (see
`vela_ray.model.adapters`). Per-expert factors live in an `ExpertAdapter`, so the
optimizer state and checkpoints stay keyed by logical expert.

Dtypes, as peft's (`get_peft_model(..., autocast_adapter_dtype=True)`, its default): the factors,
their gradients and AdamW moments are fp32 on a bf16/fp16 base (`adapter_dtype`), or an AdamW step
of ~1e-3 relative (lr 3e-5) would fall below bf16's rounding step and vanish. Each use casts them to
the frozen weights' dtype and computes there, as peft's `ParamWrapper` does for a single adapter
(`get_delta_factors` casts lhs and rhs, `_LoraFactorsProxy` folds with one `baddbmm` in W's dtype):
the fold exactly so, the low-rank path with the same casts (so its grouped multiplies keep one dtype
and bf16's kernel, and save no fp32 copy of the rows). Gradients reach the fp32 factors through the
casts. In bf16 the fold's updates equal peft's to 2e-6; the low-rank path's differ from peft's by less
than peft's own differ from exact arithmetic (tests/unit/test_bf16_expert_adapters.py).

The routing weights are applied by the broker on the master, not here: the
family's forward is called with weight 1 per row, so the shard returns unweighted
expert outputs and gradients flow to the router there.

Backward: `forward_rows(..., key=k)` keeps the autograd graph of that call;
`backward_rows(k, grad_out_RD)` runs it, accumulating LoRA gradients here and
returning d(loss)/d(rows) for the master.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import re
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Iterator, Literal, Mapping

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from vela_ray.model.quantization import frozen_matmul, part_name, quantized_weights

_base = threading.local()  # `without_adapters`: this thread computes the base model


@contextlib.contextmanager
def without_adapters() -> Iterator[None]:
    """Within the block, experts this thread computes skip their LoRA update (the frozen weights alone), and a
    broker this thread calls asks its workers for the same (`ForwardRequest.adapters`): the base model, as peft's
    `disable_adapter` gives it on the master. Per thread, so micro-batches in flight on other threads, and the
    other masters' calls to the same workers, keep their adapters."""
    before = getattr(_base, "on", False)
    _base.on = True
    try:
        yield
    finally:
        _base.on = before


def adapters_on() -> bool:
    """False within `without_adapters` on this thread."""
    return not getattr(_base, "on", False)

ExpertKey = tuple[int, int]  # (MoE layer index, expert index): a *logical* expert
ExpertParams = dict[str, torch.Tensor]  # one expert's slice of each per-expert parameter, by parameter name
ExpertWeights = dict[ExpertKey, ExpertParams]


InitLoraWeights = Literal[True, "gaussian"]


@dataclass(frozen=True)
class StackLora:
    """One expert weight stack's resolved LoRA: peft's `ParamWrapper.update_layer` for that parameter."""

    r: int
    alpha: float
    use_rslora: bool = False
    init_lora_weights: InitLoraWeights = True

    @property
    def scaling(self) -> float:
        """peft's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


@dataclass(frozen=True)
class LoraSpec:
    """A job's LoRA in peft's names (`peft.LoraConfig`; the paper: r=8, alpha=16, every linear layer but the
    router, every expert weight stack). The master passes the backbone's options to peft
    (`vela_ray.model.adapters.full_lora_config`); the expert side implements them for its stacks.

    `rank_pattern`/`alpha_pattern` need each stack's module path, which workers do not have: the driver
    resolves them once (`adapters.resolve_expert_lora` fills `resolved`: (MoE layer, stack, r, alpha) of every
    adapted stack), and `stack` then reads the table."""

    r: int = 8
    alpha: float = 16.0
    use_rslora: bool = False
    init_lora_weights: InitLoraWeights = True
    lora_dropout: float = 0.0  # peft applies it on backbone modules only (it refuses it on expert stacks)
    target_modules: str | tuple[str, ...] | None = None  # None: every linear layer but lm_head and routers
    exclude_modules: str | tuple[str, ...] | None = None
    expert_stacks: tuple[str, ...] | None = None  # the experts' weight stacks to adapt; None: all of them
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    modules_to_save: tuple[str, ...] = ()  # trained in full on the master (the router: "gate")
    resolved: tuple[tuple[int, str, int, float], ...] | None = None

    @property
    def scaling(self) -> float:
        return StackLora(self.r, self.alpha, self.use_rslora).scaling

    def stack(self, layer: int, stack: str) -> StackLora | None:
        """The LoRA of weight stack `stack` of MoE layer `layer`; None where it is not adapted."""
        if self.resolved is None:
            if self.rank_pattern or self.alpha_pattern:
                raise ValueError("LoraSpec with rank_pattern/alpha_pattern must be resolved against the model "
                                 "first (vela_ray.model.adapters.resolve_expert_lora)")
            adapted = self.expert_stacks is None or stack in self.expert_stacks
            return StackLora(self.r, self.alpha, self.use_rslora, self.init_lora_weights) if adapted else None
        for at_layer, name, r, alpha in self.resolved:
            if (at_layer, name) == (layer, stack):
                return StackLora(r, alpha, self.use_rslora, self.init_lora_weights)
        return None


def weight_stacks(experts: nn.Module) -> list[str]:
    """The experts' 3-D weight parameters [E, a, b]: what peft's `target_parameters` adapts (biases are not)."""
    return [name for name, p in experts.named_parameters(recurse=False) if p.dim() == 3]


ExpertsCall = Literal["routed", "grouped"]


def experts_call(experts: nn.Module) -> ExpertsCall | None:
    """How a family calls its experts, from the class's forward signature:

    - "routed": `experts(hidden_states, expert_index, expert_weights)`, each row to its top-k experts;
    - "grouped": `experts(x)` with x [E*T, D] holding T rows for each expert in turn (Llama 4: every
      expert sees every token, its input pre-scaled by the routing score, 0 where not routed);
    - None: anything else.
    """
    params = list(inspect.signature(type(experts).forward).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return {3: "routed", 1: "grouped"}.get(len(params))


def slot_name(stack: str) -> str:
    """Short name of a weight stack in LoRA state keys: gate_up_proj -> gate_up, down_proj -> down."""
    return stack.removesuffix("_proj")


def lora_in_out(experts: nn.Module, stack: str) -> tuple[int, int]:
    """(in, out) features of one expert of `stack`, by peft's rule: [E, out, in] unless `is_transposed`."""
    _, a, b = getattr(experts, stack).shape
    return (a, b) if getattr(experts, "is_transposed", False) else (b, a)


def adapter_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA factors of frozen `weight_dtype` weights train in: fp32 for floats narrower than 32
    bits (bf16, fp16, fp8), else the weights' own. peft's rule (`tuners_utils.cast_adapter_dtype`): the
    backbone's adapters on the master follow it too, so every adapter of a model steps alike."""
    narrow = weight_dtype.is_floating_point and torch.finfo(weight_dtype).bits < 32
    return torch.float32 if narrow else weight_dtype


class ExpertAdapter(nn.Module):
    """One expert's LoRA factors: `lora_A_<slot>` [r, in] and `lora_B_<slot>` [out, r] per adapted weight stack."""

    def __init__(self, in_out: dict[str, tuple[int, int]], stacks: Mapping[str, StackLora], dtype: torch.dtype,
                 generator: torch.Generator | None = None):
        """`in_out` and `stacks` by slot (`slot_name`); only slots in `stacks` get factors. `dtype`: the
        factors' own (`adapter_dtype` of the frozen weights'). `generator` draws the A inits; None draws from
        torch's global RNG, as nn.Linear does."""
        super().__init__()
        for slot, lora in stacks.items():
            fan_in, fan_out = in_out[slot]
            setattr(self, f"lora_A_{slot}", nn.Parameter(torch.empty(lora.r, fan_in, dtype=dtype)))
            setattr(self, f"lora_B_{slot}", nn.Parameter(torch.zeros(fan_out, lora.r, dtype=dtype)))
        # peft's `reset_lora_parameters`: A kaiming-uniform (as nn.Linear; peft's fused A [r*E, in] has the same
        # fan-in, so the same bound) or gaussian with std 1/r, B zero, so the adapter starts as identity.
        for slot, lora in stacks.items():
            lora_A = getattr(self, f"lora_A_{slot}")
            if lora.init_lora_weights is True:
                nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
            else:
                nn.init.normal_(lora_A, std=1 / lora.r, generator=generator)


def expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    """A CPU generator for one expert's LoRA init, the same for (seed, layer, expert) in any process.

    `hash` of a tuple of ints does not depend on PYTHONHASHSEED, so every worker derives the same seed.
    """
    return torch.Generator().manual_seed(hash((seed, layer, expert)) % (2**31))


def local_experts_module(prototype: nn.Module, per_expert: list[ExpertParams]) -> nn.Module:
    """An instance of `prototype`'s class holding exactly `per_expert` (in that order), frozen. A weight stack
    given as quantized parts (`vela_ray.model.quantization`) is held as those parts, stacked, in buffers.

    `prototype` is the model's experts module (on the meta device, from a skeleton); every
    per-expert parameter or buffer (leading dim = the layer's expert count) becomes the stack
    of the given slices, and `num_experts` the local count, so the class's own forward runs
    over local indices 0..len(per_expert)-1.
    """
    total = _num_experts(prototype)
    module = copy.deepcopy(prototype)
    quantized = quantized_weights(per_expert[0]) if per_expert else {}
    for name, tensor in list(prototype.named_parameters(recurse=False)) + list(prototype.named_buffers(recurse=False)):
        if tensor.dim() == 0 or tensor.shape[0] != total:
            raise ValueError(f"{type(prototype).__name__}.{name} {tuple(tensor.shape)} is not per expert "
                             f"(leading dim {total}); vela-ray cannot split it over workers")
        if name in quantized:  # held as its format's parts, buffers; the stack itself is never allocated
            del module._parameters[name]
            for part in quantized[name][0].parts:
                key = part_name(name, quantized[name][0], part)
                module._buffers[key] = torch.stack([p[key] for p in per_expert])
            continue
        stacked = torch.stack([p[name] for p in per_expert]) if per_expert else tensor.new_empty((0, *tensor.shape[1:]))
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(stacked, requires_grad=False)
        else:
            module._buffers[name] = stacked
    if getattr(module, "num_experts", None) == total:
        module.num_experts = len(per_expert)
    return module


def _follows_transformers_contract(experts: nn.Module) -> bool:
    """Whether `experts` computes as transformers' experts implementations (grouped_mm, batched_mm) do:
    up = x W_gate_up (+ bias), h = `_apply_gate(up)` (or act(up) without gate), out = h W_down (+ bias),
    under its layout flags. True for classes made with `use_experts_implementation` that the model runs
    through one of those implementations (not "eager", where a class's own forward may differ), with no
    post-expert norm. Only then may a shard keep LoRA low-rank instead of folding it into the weights."""
    needed = {"gate_up_proj", "down_proj"} if getattr(experts, "has_gate", True) else {"up_proj", "down_proj"}
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return (experts_call(experts) == "routed" and hasattr(experts, "has_gate") and hasattr(experts, "_apply_gate")
            and implementation not in (None, "eager") and not getattr(experts, "has_post_expert_norm", False)
            and set(weight_stacks(experts)) == needed)


def _num_experts(experts: nn.Module) -> int:
    stacks = weight_stacks(experts)
    if not stacks:
        raise ValueError(f"{type(experts).__name__} has no 3-D expert weights")
    return getattr(experts, stacks[0]).shape[0]


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_VERSION = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def native_grouped_mm(x_RK: torch.Tensor, w_nKN: torch.Tensor) -> bool:
    """Whether `grouped_mm(x_RK, w_nKN, offs)` runs on `torch._grouped_mm` (forward and backward); else it
    loops over the experts in Python.

    `torch._grouped_mm` where it computes both directions, from torch 2.9 on (before, it had no CPU kernel
    and took bf16 on sm90 only: not worth a branch):
    - CUDA sm80+, as transformers 5's grouped_mm experts decide (`transformers.integrations.moe.
      _can_use_grouped_mm`). In bf16 on sm90/sm100 it is one CUTLASS kernel for all experts, no host sync;
      other dtypes and devices run ATen's per-group loop: the Python fallback's loop, in C++.
    - CPU: per-group BLAS calls in C++, forward and backward bitwise equal to the Python loop's in fp32
      here. As fast as the per-expert code it replaced at OLMoE-like sizes (8 experts, ~250 rows each:
      matmuls dominate; 0.97-1.05x its time, within this shared machine's noise), 0.81-0.85x with 32
      small experts, where the loop's Python overhead shows (`benchmarks/expert_compute.py`, and with
      `--hidden 512 --intermediate 256 --experts 32 --rows 1024`). Its backward rejects a broadcast
      (expanded) gradient; `LayerExperts._low_rank` unsorts by indexing, whose gradient is dense.
    - fp32, bf16, fp16 only; both kernels need 16-byte aligned data and strides: every dimension (in, out,
      LoRA r) a multiple of 4 in fp32, 8 in bf16. x is contiguous (`grouped_mm` sees to it); w [n, K, N]
      may be a transposed view, as weight stacks [n, N, K] and LoRA factors are.
    Elsewhere (other devices, float64, odd sizes such as r=4 in bf16, torch < 2.9) a Python loop over the
    experts: as fast as the per-expert code it replaced (0.96-1.06x, noise again). A padded `torch.bmm`
    over [n, most rows, K] took 2.8x to 4x that time on CPU with skewed routing, computing the padding.
    """
    if not hasattr(torch, "_grouped_mm") or _TORCH_VERSION < (2, 9):
        return False
    if x_RK.device.type == "cuda":
        device_ok = torch.cuda.get_device_capability(x_RK.device) >= (8, 0)
    else:
        device_ok = x_RK.device.type == "cpu"
    alignment = 16 // x_RK.element_size()
    return (device_ok and x_RK.dtype == w_nKN.dtype and w_nKN.dtype in _GROUPED_MM_DTYPES
            and (w_nKN.is_contiguous() or w_nKN.transpose(-2, -1).is_contiguous())
            and all(size % alignment == 0 for size in w_nKN.shape[1:])
            and x_RK.data_ptr() % 16 == 0 and w_nKN.data_ptr() % 16 == 0)


@dataclass(frozen=True)
class GroupOffsets:
    """Where each expert's rows end among rows sorted by expert, twice: `ends` [n] int32 on the compute
    device (what `torch._grouped_mm` reads there) and `counts` [n], each expert's rows, on the host (what the
    per-expert loop splits by, so it reads nothing back from the device). Built on the host from the
    expert ids, which arrive there (`LayerExperts.route`)."""

    ends: torch.Tensor
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Routing:
    """One call's rows by local expert (`LayerExperts.route`), on the weights' device: n = local experts."""

    local_R: torch.Tensor  # each row's local expert, in the request's order
    order_R: torch.Tensor  # the rows sorted by local expert (stable)
    sorted_R: torch.Tensor  # local_R[order_R]
    unorder_R: torch.Tensor  # the inverse of order_R: sorted rows back into the request's order
    offs: GroupOffsets  # where each local expert's sorted rows end [n]


def grouped_mm(x_RK: torch.Tensor, w_nKN: torch.Tensor, offs_n: torch.Tensor | GroupOffsets) -> torch.Tensor:
    """Rows times their expert's matrix: x [R, K] sorted by expert, expert i's rows ending at `offs_n[i]`
    (int32, offs_n[-1] == R; an expert may have none), times w [n, K, N] -> [R, N]. Differentiable in x
    and w; see `native_grouped_mm` for which implementation runs. `offs_n` as `GroupOffsets` (what
    `LayerExperts` passes) costs no host sync; as a device tensor the loop reads its counts back."""
    counts = offs_n.counts if isinstance(offs_n, GroupOffsets) else None
    offs_n = offs_n.ends if isinstance(offs_n, GroupOffsets) else offs_n
    x_RK = x_RK.contiguous()
    if native_grouped_mm(x_RK, w_nKN):
        return torch._grouped_mm(x_RK, w_nKN, offs=offs_n)
    if counts is None:
        counts = torch.diff(offs_n, prepend=offs_n.new_zeros(1)).tolist()
    # unbind, not w[i]: the gradient of n selects would be n zero-filled copies of the whole stack
    return torch.cat([x_rK @ w_KN for x_rK, w_KN in zip(x_RK.split(counts), w_nKN.unbind(0))])


class LayerExperts(nn.Module):
    """The shard's experts of one MoE layer: the family's experts class over them, plus their adapters."""

    def __init__(self, layer: int, prototype: nn.Module, weights: dict[int, ExpertParams], lora: LoraSpec,
                 seed: int | None = None, adapters: Mapping[int, ExpertAdapter] | None = None,
                 dtype: torch.dtype | None = None):
        """`adapters`: each expert's existing LoRA factors instead of fresh ones, shared, so gradients reach
        them (a tiered worker's device copy of some experts, `vela_ray.training.tiered`); they may live on
        another device than `weights`, whose device the factors are moved to in each call. `dtype`: what the
        frozen weights compute in; required when `weights` hold quantized stacks, else their own dtype."""
        super().__init__()
        self.layer = layer
        self.expert_ids = sorted(weights)
        self.module = local_experts_module(prototype, [weights[e] for e in self.expert_ids])
        self.stacks = weight_stacks(prototype)
        self.transposed = bool(getattr(prototype, "is_transposed", False))
        self.call = experts_call(prototype)
        self.low_rank = _follows_transformers_contract(prototype)
        self.lora = {s: spec for s in self.stacks if (spec := lora.stack(layer, s)) is not None}  # adapted stacks
        in_out = {slot_name(s): lora_in_out(prototype, s) for s in self.stacks}
        self.hidden_size = in_out[slot_name(self.stacks[0])][0]  # the first stack reads the hidden states
        # {stack: its format}: the stacks held quantized (their parts are the module's buffers, wherever `.to` or
        # pinning puts them: looked up at each use, never kept here), dequantized at each use in `dtype`
        self.quantized = {stack: fmt for stack, (fmt, _) in
                          quantized_weights(dict(self.module.named_buffers(recurse=False))).items()}
        first = next(iter(next(iter(weights.values())).values())) if weights else torch.empty(0)
        if self.quantized and dtype is None:
            raise ValueError("quantized expert weights need the dtype they compute in (LayerExperts' `dtype`)")
        self.dtype = dtype or (first.dtype if weights else torch.float32)
        slots = {slot_name(s): spec for s, spec in self.lora.items()}
        self.adapters = nn.ModuleDict({
            str(e): adapters[e] if adapters is not None
            else ExpertAdapter(in_out, slots, adapter_dtype(self.dtype),
                               None if seed is None else expert_generator(seed, layer, e))
            for e in self.expert_ids
        })
        local_of = torch.full((_num_experts(prototype),), -1, dtype=torch.long, device=first.device)
        local_of[self.expert_ids] = torch.arange(len(self.expert_ids), device=first.device)
        self.register_buffer("local_of", local_of, persistent=False)
        # the same map on the host, where the ids arrive: routing is worked out there (`route`)
        self.host_local_of = np.full(_num_experts(prototype), -1, dtype=np.int64)
        self.host_local_of[self.expert_ids] = np.arange(len(self.expert_ids))

    def forward(self, expert_ids_R: torch.Tensor, rows_RD: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs, row i through expert `expert_ids_R[i]` (global id in the layer)."""
        routing = self.route(expert_ids_R)
        if self.low_rank:
            return self._low_rank(routing, rows_RD)
        adapted = {stack: self._adapted(stack) for stack in self.stacks}
        if self.call == "grouped":
            return self._grouped(adapted, routing.local_R, rows_RD)
        ones_R1 = rows_RD.new_ones(rows_RD.shape[0], 1)
        return functional_call(self.module, adapted, (rows_RD, routing.local_R[:, None], ones_R1))

    def route(self, expert_ids_R: torch.Tensor) -> Routing:
        """The rows' local experts, their order by expert and the grouped multiplies' offsets, worked out on
        the host, where the ids arrive (the broker sends them with the rows), and moved to the weights' device
        in one copy: the call reads nothing back from the device, however many experts (ids given on a
        device are read back once, here). Ids of experts not hosted here raise a KeyError naming them."""
        ids_R = expert_ids_R.detach().cpu().numpy().astype(np.int64, copy=False)
        table = self.host_local_of
        known_R = (ids_R >= 0) & (ids_R < len(table))
        local_R = np.where(known_R, table[np.where(known_R, ids_R, 0)], -1)
        if (local_R < 0).any():
            missing = [(self.layer, int(e)) for e in sorted(set(ids_R[local_R < 0].tolist()))]
            raise KeyError(f"experts {missing} are not hosted here (hosted of layer {self.layer}: {self.expert_ids})")
        counts_n = np.bincount(local_R, minlength=len(self.expert_ids))
        order_R = np.argsort(local_R, kind="stable")
        unorder_R = np.empty_like(order_R)
        unorder_R[order_R] = np.arange(len(order_R))
        host = np.concatenate([local_R, order_R, local_R[order_R], unorder_R, np.cumsum(counts_n)])
        moved, device = torch.from_numpy(host), self.local_of.device
        if device.type == "cuda":  # the call's one host-to-device copy, from pinned memory: queued, not waited for
            moved = moved.pin_memory().to(device, non_blocking=True)
        else:
            moved = moved.to(device)  # none on the CPU
        local, order, ordered, unorder, offs = moved.split([len(ids_R)] * 4 + [len(counts_n)])
        return Routing(local, order, ordered, unorder,
                       GroupOffsets(offs.to(torch.int32), tuple(counts_n.tolist())))

    def _low_rank(self, routing: Routing, rows_RD: torch.Tensor) -> torch.Tensor:
        """transformers' experts contract (see `_follows_transformers_contract`) with LoRA kept low-rank:
        x W + s (x A^T) B^T per weight stack, the family's `_apply_gate` (or activation) between them.
        Equal to peft's fold up to rounding, without its full-size weight gradient in backward.

        As transformers' grouped_mm implementation: rows sorted by local expert, one grouped matrix
        multiply per product (`grouped_mm`) instead of a Python loop over experts, and the gate applied
        once to the whole sorted block (it works row by row)."""
        module = self.module
        order_R, sorted_R, offs = routing.order_R, routing.sorted_R, routing.offs  # built on the host: no sync
        h = self._grouped_linear("gate_up_proj" if module.has_gate else "up_proj", rows_RD[order_R], sorted_R, offs)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        return self._grouped_linear("down_proj", h, sorted_R, offs)[routing.unorder_R]

    def _grouped_linear(self, stack: str, x_RI: torch.Tensor, local_R: torch.Tensor,
                        offs: GroupOffsets) -> torch.Tensor:
        """Each row's projection by its expert's `stack`, with bias and LoRA: peft's W + s B A, applied
        low-rank in the weights' dtype (see the module docstring). Rows are sorted by local expert
        (`local_R`); `offs` ends each expert's rows."""
        if stack in self.quantized:  # made [n, in, out] for this multiply and again in backward, never kept
            y_RO = frozen_matmul(x_RI, lambda: self._dequantized(stack).transpose(-2, -1),
                                 lambda x, w: grouped_mm(x, w, offs))
        else:
            weight = getattr(self.module, stack)
            y_RO = grouped_mm(x_RI, weight if self.transposed else weight.transpose(-2, -1), offs)
        if getattr(self.module, "has_bias", False):
            y_RO = y_RO + getattr(self.module, f"{stack}_bias")[local_R]
        if stack not in self.lora or not adapters_on():  # a stack the job leaves frozen, or the base model's call
            return y_RO
        A_nrI, B_nOr = self._factors(slot_name(stack), self.dtype)
        low_RO = grouped_mm(grouped_mm(x_RI, A_nrI.transpose(-2, -1), offs), B_nOr.transpose(-2, -1), offs)
        return y_RO + self.lora[stack].scaling * low_RO

    def _factors(self, slot: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The local experts' LoRA factors of `slot`, stacked and cast to `dtype` (the frozen weights', as
        peft casts them): A [n, r, in], B [n, out, r]. Stacked anew each call, so gradients reach each
        expert's own parameters (optimizer state and checkpoints are keyed by logical expert)."""
        adapters = [self.adapters[str(e)] for e in self.expert_ids]
        device = self.local_of.device  # the frozen weights': shared adapters may live elsewhere (no-op if not)
        return (torch.stack([getattr(a, f"lora_A_{slot}") for a in adapters]).to(device, dtype),
                torch.stack([getattr(a, f"lora_B_{slot}") for a in adapters]).to(device, dtype))

    def _grouped(self, adapted: dict, local_R: torch.Tensor, rows_RD: torch.Tensor) -> torch.Tensor:
        """A "grouped" call: every local expert gets the same number of rows, zero-padded. A zero row gives
        a zero output and no gradient (no bias: act(0) * 0 = 0), so the padding changes nothing."""
        num_local = len(self.expert_ids)
        counts = torch.bincount(local_R, minlength=num_local)
        slot_R = torch.empty_like(local_R)  # each row's position among its expert's rows
        order = torch.argsort(local_R, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot_R[order] = torch.arange(len(local_R), device=local_R.device) - starts[local_R[order]]
        flat_R = local_R * int(counts.max()) + slot_R
        packed = rows_RD.new_zeros(num_local * int(counts.max()), rows_RD.shape[1]).index_copy(0, flat_R, rows_RD)
        return functional_call(self.module, adapted, (packed,)).index_select(0, flat_R)

    def _dequantized(self, stack: str) -> torch.Tensor:
        """A quantized stack as [n, out, in] in `dtype` (its formats' orientation, whatever the family's layout)."""
        fmt = self.quantized[stack]
        return fmt.dequantize({part: self.module._buffers[part_name(stack, fmt, part)] for part in fmt.parts},
                              self.dtype)

    def _frozen(self, stack: str) -> torch.Tensor:
        """The stack in the family's layout: the parameter, or a quantized stack dequantized."""
        if stack not in self.quantized:
            return getattr(self.module, stack)
        weight = self._dequantized(stack)
        return weight.transpose(-2, -1) if self.transposed else weight

    def _adapted(self, stack: str) -> torch.Tensor:
        """peft's fold of the LoRA update into the stack, in the stack's dtype (see the module docstring). A
        quantized stack is folded dequantized: the folded stack lives for the call's graph, as any fold does."""
        weight = self._frozen(stack)
        if stack not in self.lora or not adapters_on():  # a stack the job leaves frozen, or the base model's call
            return weight
        A_ErI, B_EOr = self._factors(slot_name(stack), weight.dtype)
        lhs, rhs = (A_ErI.transpose(-2, -1), B_EOr.transpose(-2, -1)) if self.transposed else (B_EOr, A_ErI)
        return torch.baddbmm(weight, lhs, rhs, alpha=self.lora[stack].scaling)


class ExpertShard(nn.Module):
    """A set of logical experts (layer, expert) hosted together, e.g. by one ExpertManager.

    Stages of one training micro-batch, per MoE layer:
      1. `forward_rows(layer, expert_ids_R, rows_RD, key)`: run each row through its expert;
         with a key, keep the graph for backward.
      2. `backward_rows(key, grad_out_RD)`: backprop through that graph; LoRA grads accumulate
         here, d(rows) goes back to the master.
    """

    def __init__(self, layers: Mapping[int, LayerExperts]):
        super().__init__()
        self.layers = nn.ModuleDict({str(layer): mod for layer, mod in sorted(layers.items())})
        self.keys: list[ExpertKey] = sorted((layer, e) for layer, mod in layers.items() for e in mod.expert_ids)
        self._saved: dict[Hashable, tuple[torch.Tensor, torch.Tensor] | None] = {}

    @classmethod
    def from_weights(
        cls,
        weights: ExpertWeights,
        lora: LoraSpec,
        prototypes: Mapping[int, nn.Module] | nn.Module,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> "ExpertShard":
        """Build from {(layer, expert): {parameter name: that expert's slice}}.

        `prototypes`: the model's experts module of each MoE layer (`modeling.experts_prototypes`),
        or one module for every layer. With `seed`, each expert's LoRA init draws from its own
        generator seeded by (seed, layer, expert), so the init does not depend on which shard hosts
        it and building a shard leaves torch's global RNG (the caller's data order, dropout) alone.
        Without `seed`, the init draws from the global RNG like any nn.Module. `dtype`: what quantized
        weights compute in (`LayerExperts`).
        """
        by_layer: dict[int, dict[int, ExpertParams]] = {}
        for (layer, expert), params in sorted(weights.items()):
            by_layer.setdefault(layer, {})[expert] = params
        proto = (lambda layer: prototypes) if isinstance(prototypes, nn.Module) else prototypes.__getitem__
        return cls({layer: LayerExperts(layer, proto(layer), experts, lora, seed, dtype=dtype)
                    for layer, experts in by_layer.items()})

    def expert(self, layer: int, expert: int) -> ExpertAdapter:
        """The LoRA factors of one hosted expert."""
        return self.layers[str(layer)].adapters[str(expert)]

    def forward_rows(
        self, layer: int, expert_ids_R: torch.Tensor, rows_RD: torch.Tensor, key: Hashable | None = None,
        compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, adapters: bool = True,
    ) -> torch.Tensor:
        """Expert outputs for `rows_RD`, row i through expert `expert_ids_R[i]` of `layer`.

        With `key`, the graph is kept for `backward_rows(key, ...)`; without it no graph is built.
        `compute(expert_ids_R, rows_RD)` stands in for the layer's `LayerExperts` (a tiered worker
        splits the rows between its CPU and its device, `vela_ray.training.tiered`). `adapters` False: the
        base model's outputs, every LoRA update left out (`without_adapters`).
        """
        if rows_RD.shape[0] == 0:  # nothing routed here: an empty entry keeps backward_rows(key) valid
            if key is not None:
                self._saved[key] = None
            return rows_RD.new_zeros(rows_RD.shape)
        if str(layer) not in self.layers:
            raise KeyError(f"no experts of MoE layer {layer} are hosted here")
        with torch.enable_grad() if key is not None else torch.no_grad(), \
                contextlib.nullcontext() if adapters else without_adapters():
            rows_RD = rows_RD.detach().requires_grad_(key is not None)
            out_RD = (compute or self.layers[str(layer)])(expert_ids_R, rows_RD)
        if key is not None:
            self._saved[key] = (rows_RD, out_RD)
        return out_RD.detach()

    def backward_rows(self, key: Hashable, grad_out_RD: torch.Tensor) -> torch.Tensor:
        """Backprop `grad_out_RD` through the graph saved under `key`; returns d(loss)/d(rows)."""
        if key not in self._saved:
            raise KeyError(f"no saved forward for {key!r}: backward_rows called twice or without forward_rows")
        saved = self._saved.pop(key)
        if saved is None:
            return grad_out_RD.new_zeros(grad_out_RD.shape)
        rows_RD, out_RD = saved
        out_RD.backward(grad_out_RD.to(out_RD.dtype))
        return rows_RD.grad

    def release(self) -> int:
        """Drop graphs kept for a backward that will not come (e.g. an eval pass). Returns how many."""
        count = len(self._saved)
        self._saved.clear()
        return count

    def weights(self) -> ExpertWeights:
        """The hosted experts' frozen tensors, as `from_weights` takes them (e.g. to host them elsewhere)."""
        out: ExpertWeights = {}
        for layer, mod in self.layers.items():
            tensors = [*mod.module.named_parameters(recurse=False), *mod.module.named_buffers(recurse=False)]
            for local, expert in enumerate(mod.expert_ids):
                out[(int(layer), expert)] = {name: t[local].detach() for name, t in tensors}
        return out

    def frozen_views(self) -> dict[ExpertKey, dict[str, torch.Tensor]]:
        """Each hosted expert's floating frozen parameters, as views of its layer's stacks (writing one writes the
        stack): what full-parameter ZO perturbs in place. Named as the experts module names them."""
        out: dict[ExpertKey, dict[str, torch.Tensor]] = {}
        for layer, mod in self.layers.items():
            stacks = [(name, p) for name, p in mod.module.named_parameters(recurse=False) if p.is_floating_point()]
            for local, expert in enumerate(mod.expert_ids):
                out[(int(layer), expert)] = {name: p.data[local] for name, p in stacks}
        return out

    def lora_parameters(self) -> Iterable[nn.Parameter]:
        return (p for p in self.parameters() if p.requires_grad)

    def lora_state(self) -> dict[ExpertKey, dict[str, torch.Tensor]]:
        """{(layer, expert): {"lora_A_gate_up": ..., ...}}: the adapter keyed by logical expert."""
        return {
            key: {name: p.detach().clone() for name, p in self.expert(*key).named_parameters()}
            for key in self.keys
        }

    def load_lora_state(self, state: dict[ExpertKey, dict[str, torch.Tensor]]) -> None:
        missing = [key for key in self.keys if key not in state]
        if missing:
            raise ValueError(f"adapter state lacks experts {missing[:8]} (of {len(missing)}) hosted by this shard")
        with torch.no_grad():
            for key in self.keys:
                for name, param in self.expert(*key).named_parameters():
                    param.copy_(state[key][name])
