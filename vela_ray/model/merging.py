"""A peft adapter folded into its base checkpoint, or rewritten per expert, in the checkpoint's own layout.

- `merge_checkpoint(adapter_dir, model_dir, out_dir)`: the base model with every LoRA delta added and every
  module trained in full (`modules_to_save`, e.g. the router) in its trained state, written as the input
  checkpoint is written: the same shard files, key names, dtypes and index, byte for byte except the adapted
  tensors. Each shard is copied, then each adapted tensor is read, updated (in fp32, one expert at a time for
  a fused stack) and written over its own bytes, so memory stays near one tensor plus one expert stack
  whatever the model size.
- `serving_adapter(adapter_dir, model_dir)`: the adapter as serving engines load it, its expert factors under
  the per-expert module names of the checkpoint (`experts.{e}.w1`, `experts.{e}.gate_proj`, ...), at one rank
  and one scale (`_one_scale`), or in peft's fused layout where the checkpoint stores its experts fused.
  `fused_adapter` is its inverse: peft's fused layout, which transformers' model loads.

Both map each on-disk tensor to the model parameter it loads into through `vela_ray.model.loading`'s
reading of transformers' conversion mapping: a tensor stored whole (maybe renamed) takes the delta as it
is; per-expert tensors that transformers stacks (`MergeModulelist`, then `Concatenate` for gate/up) take
their expert's rows of it. Any other conversion is refused by name: it has no inverse here.

Shapes (E = experts, r = rank, I = in features, O = out features):
    peft's fused expert factors  lora_A [r*E, I], lora_B [O, r*E] (expert e: columns e, e+E, ...)
    expert e's delta             scaling * B_e [O, r] @ A_e [r, I] -> [O, I]
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import ParamWrapper
from peft.utils.constants import DUMMY_TARGET_MODULES
from peft.utils.other import ModulesToSaveWrapper, get_pattern_key
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from vela_ray.model.adapters import ADAPTER_FILE, fuse_expert_factors, split_expert_factors
from vela_ray.model.experts import weight_stacks
from vela_ray.model.loading import checkpoint_index, checkpoint_layout, meta_model
from vela_ray.model.quantization import Format, round_trip
from vela_ray.model.quantized_model import QuantizationSpec, quantizable_linears

INDEX_FILE = "model.safetensors.index.json"
_PER_EXPERT_OPS = (("MergeModulelist",), ("MergeModulelist", "Concatenate"))


@dataclass(frozen=True)
class _Delta:
    """The LoRA update of one model parameter, from the adapter's factors."""

    key: str  # the factors' key in the adapter, less `.lora_A.weight` (`base_model.model.<module>`)
    lora_A: torch.Tensor  # [r*E, I] (E = 1 for a linear layer)
    lora_B: torch.Tensor  # [O, r*E]
    scaling: float
    num_experts: int  # 0: a linear layer's [O, I] weight
    transposed: bool  # the stack is [E, I, O] (peft's `is_transposed` experts), else [E, O, I]
    parameter: bool = False  # adapted as a parameter (peft's `target_parameters`), not as a module

    def factors(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_e [r, I], B_e [O, r]) of `expert` (the whole factors of a linear layer)."""
        if not self.num_experts:
            return self.lora_A.float(), self.lora_B.float()
        A_ErI = self.lora_A.float().reshape(self.num_experts, -1, self.lora_A.shape[-1])
        B_OrE = self.lora_B.float().reshape(self.lora_B.shape[0], -1, self.num_experts)
        return A_ErI[expert], B_OrE[:, :, expert]

    def of(self, expert: int) -> torch.Tensor:
        """fp32 delta of `expert`'s slice of the parameter, in the parameter's own orientation."""
        A, B = self.factors(expert)
        delta_OI = self.scaling * (B @ A)
        return delta_OI.T if self.transposed else delta_OI


@dataclass(frozen=True)
class _Saved:
    """A tensor of a module trained in full (peft's `modules_to_save`, e.g. the router): it takes the base
    tensor's place."""

    key: str  # its key in the adapter
    tensor: torch.Tensor
    num_experts: int = 0  # never expert weights (`check_lora_targets` refuses them)


@dataclass(frozen=True)
class _Update:
    """What one on-disk tensor, which loads into model parameter `target`, gets of `change`: a delta's
    `of(expert)` narrowed to `rows` along `dim` (None: all of it; expert None: every expert of a stored
    stack), or a trained tensor in its place. `change` None: only where the tensor loads (`fused_adapter`)."""

    change: _Delta | _Saved | None
    target: str
    expert: int | None
    dim: int = 0
    rows: tuple[int, int] | None = None

    def of(self, expert: int) -> torch.Tensor:
        d = self.change.of(expert)
        return d if self.rows is None else d.narrow(self.dim, self.rows[0], self.rows[1] - self.rows[0])

    def applied(self, part: torch.Tensor, expert: int) -> torch.Tensor:
        """`part` (the tensor, or expert `expert`'s slice of a stored stack) changed, in its own dtype."""
        if isinstance(self.change, _Saved):
            return self.change.tensor.to(part.dtype)
        return (part.float() + self.of(expert)).to(part.dtype)


# --------------------------------------------------------------------------------------------------
# Reading the adapter
# --------------------------------------------------------------------------------------------------


def adapter_changes(adapter_dir: str | Path, model_dir: str | Path) -> dict[str, _Delta | _Saved]:
    """{model parameter name: what the peft adapter makes of it}: its LoRA update, or, for a module trained in
    full (`modules_to_save`), the trained tensor.

    The adapter's config is applied to the model on the meta device, so peft itself says which module each
    saved tensor belongs to, its scaling (`lora_alpha / r`, rslora, rank and alpha patterns) and whether an
    expert stack is [E, O, I] or [E, I, O]."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_FILE).is_file():
        raise ValueError(f"{adapter_dir} is not a peft adapter directory (no {ADAPTER_FILE})")
    lora_config = copy.copy(LoraConfig.from_pretrained(str(adapter_dir)))
    lora_config.base_model_name_or_path = None
    state = load_file(str(adapter_dir / ADAPTER_FILE))
    with torch.device("meta"):
        skeleton = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))),
                                  lora_config)
    changes: dict[str, _Delta | _Saved] = {}
    used: set[str] = set()
    for name, module in skeleton.named_modules():
        path = _model_path(name)
        if isinstance(module, ModulesToSaveWrapper):  # saved as peft saves them: `<module>.<parameter>`
            for param, _ in module.original_module.named_parameters():
                key = f"{name}.{param}"
                if key not in state:
                    raise ValueError(f"{adapter_dir}: adapter has no {key} of {path} (modules_to_save); it was "
                                     "saved for another model")
                used.add(key)
                changes[f"{path}.{param}"] = _Saved(key, state[key])
            continue
        if not isinstance(module, (LoraLinear, ParamWrapper)) or "default" not in module.lora_A:
            continue
        keys = (f"{name}.lora_A.weight", f"{name}.lora_B.weight")
        if not all(k in state for k in keys):
            raise ValueError(f"{adapter_dir}: adapter has no factors for {name} ({keys[0]}); it was saved for "
                             "another model")
        used.update(keys)
        factors = (name, state[keys[0]], state[keys[1]], module.scaling["default"])
        if isinstance(module, ParamWrapper) and module._param_ndim == 2:  # a 2-D parameter: as a linear weight
            changes[f"{path}.{module.parameter_name}"] = _Delta(*factors, 0, False, parameter=True)
        elif isinstance(module, ParamWrapper):
            changes[f"{path}.{module.parameter_name}"] = _Delta(
                *factors, module.num_experts, transposed=not module._did_swap_in_out_features, parameter=True)
        else:
            changes[f"{path}.weight"] = _Delta(*factors, 0, False)
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"{adapter_dir}: adapter tensors this model has no place for: {unused[:3]}; use an "
                         "adapter of this model")
    return changes


def _model_path(peft_name: str) -> str:
    """`base_model.model.<path>(.base_layer)*` -> `<path>`: the model's own name of a peft module."""
    return re.sub(r"^base_model\.model\.|(\.base_layer)+$", "", peft_name)


def _on_disk_updates(changes: Mapping[str, _Delta | _Saved | None], model_dir: str | Path) -> dict[str, _Update]:
    """{checkpoint tensor name: its update}: each changed model parameter traced back to the checkpoint
    tensors it loads from (see the module docstring); ValueError naming a conversion with no inverse."""
    ckpt = checkpoint_layout(str(model_dir))
    shapes = _shapes(model_dir)
    updates: dict[str, _Update] = {}
    for target, change in changes.items():
        source = ckpt.sources.get(target)
        if source is None:
            raise ValueError(f"{model_dir}: the checkpoint has no tensor for {target}, which the adapter adapts")
        refusal = (f"{model_dir}: {target} is stored as {list(source.names[:2])}, which transformers converts "
                   f"with {list(source.ops) or ['a split']}; vela-ray cannot write an adapted tensor back through "
                   "that conversion, so this family cannot be exported merged or per-expert (use --format peft)")
        if source.first_target != target or source.ops not in ((), *_PER_EXPERT_OPS):
            raise ValueError(refusal)
        if not source.ops:
            if tuple(shapes[source.names[0]]) != tuple(ckpt.shapes[target]):
                raise ValueError(refusal)
            stack = change is None or change.num_experts  # a stack stored whole: every expert of it
            updates[source.names[0]] = _Update(change, target, None if stack else 0)
            continue
        ops = source.converter.operations
        if isinstance(change, _Saved) or any(getattr(op, "dim", 0) != 0 for op in ops
                                             if type(op).__name__ == "MergeModulelist"):
            raise ValueError(refusal)
        dim = next((op.dim - 1 for op in ops if type(op).__name__ == "Concatenate"), 0)
        offsets: dict[int, int] = {}
        for name in source.names:  # by expert, then the converter's source order
            expert = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
            start = offsets.get(expert, 0)
            offsets[expert] = start + shapes[name][dim]
            updates[name] = _Update(change, target, expert, dim, (start, offsets[expert]))
    return updates


def _shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """{checkpoint tensor name: shape}, from the safetensors headers only."""
    shapes = {}
    for file in sorted(set(checkpoint_index(model_dir).values())):
        header, _ = _header(file)
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _header(file: Path) -> tuple[dict, int]:
    """(safetensors header, byte offset of its data)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


# --------------------------------------------------------------------------------------------------
# merged
# --------------------------------------------------------------------------------------------------


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """Every file a merged copy of `model_dir` writes: its weights, index, config, tokenizer and the rest."""
    return sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith("."))


def plan_merge(adapter_dir: str | Path, model_dir: str | Path) -> dict[str, _Update]:
    """The checkpoint tensors a merge rewrites, checked before anything is written (ValueError if it cannot)."""
    return _on_disk_updates(adapter_changes(adapter_dir, model_dir), model_dir)


def merge_checkpoint(adapter_dir: str | Path, model_dir: str | Path, out_dir: str | Path,
                     progress: Callable[[str], None] | None = None,
                     quantization: QuantizationSpec | None = None) -> Path:
    """Write `model_dir` with the adapter folded in to `out_dir` (see the module docstring). `quantization`: the
    run held frozen weights quantized (`model.quantization`): those tensors are written as the run computed with
    them, dequantized, before the delta is added (`plan_round_trips`)."""
    updates = plan_merge(adapter_dir, model_dir)
    round_trips = plan_round_trips(model_dir, quantization) if quantization is not None else {}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = set(checkpoint_index(model_dir).values())
    for file in checkpoint_files(model_dir):
        shutil.copyfile(file, out / file.name)
        if file in weights:
            _merge_shard(file, out / file.name, updates, round_trips)
            if progress:
                progress(file.name)
    return out


def merge_in_place(adapter_dir: str | Path, model_dir: str | Path) -> Path:
    """Fold the adapter into `model_dir` itself, a checkpoint this export wrote (a shipped checkpoint's
    dequantized copy, `shipped.write_dequantized`): each adapted tensor rewritten over its own bytes."""
    updates = plan_merge(adapter_dir, model_dir)
    for file in sorted(set(checkpoint_index(model_dir).values())):
        _merge_shard(file, file, updates)
    return Path(model_dir)


@dataclass(frozen=True)
class _RoundTrip:
    """An on-disk tensor a quantized run computed with dequantized: [O, I] (or [I, O] when `transposed`), or a
    stored stack of them (`stack`: one per expert along dim 0)."""

    fmt: Format
    transposed: bool
    stack: bool

    def applied(self, part: torch.Tensor) -> torch.Tensor:
        return round_trip(part.float(), self.fmt, self.transposed).to(part.dtype)


def plan_round_trips(model_dir: str | Path, spec: QuantizationSpec) -> dict[str, _RoundTrip]:
    """{checkpoint tensor name: its round trip} for every tensor a run with `spec` held quantized: the backbone's
    linear weights (`quantized_model.quantize_backbone`'s) and the expert stacks, traced to the tensors they load
    from as `plan_merge` traces deltas. Each format quantizes within rows of whole blocks, so a stack gathered from
    per-expert pieces (gate, up) rounds piece by piece alike, where each piece is whole blocks of rows; ValueError
    naming the tensor otherwise, or where transformers converts it."""
    ckpt = checkpoint_layout(str(model_dir))
    fmt, trips = spec.fmt, {}

    def source_of(target: str, per_expert: bool):
        source = ckpt.sources[target]
        if source.ops and not (per_expert and source.ops in _PER_EXPERT_OPS):
            raise ValueError(f"{model_dir}: {target} is stored as {list(source.names[:2])}, converted by "
                             f"transformers ({list(source.ops)}); vela-ray cannot write its quantized values back "
                             "through that conversion: export --format peft")
        return source

    if spec.backbone:
        for _, _, path in quantizable_linears(ckpt.skeleton, spec):
            trips[source_of(f"{path}.weight", False).names[0]] = _RoundTrip(fmt, False, False)
    if spec.experts:
        rows = fmt.block[0] or 1
        for layer, path in enumerate(ckpt.experts_paths):
            prototype = ckpt.prototypes[layer]
            transposed = bool(getattr(prototype, "is_transposed", False))
            for stack in weight_stacks(prototype):
                source = source_of(f"{path}.{stack}", True)
                if not source.ops:
                    trips[source.names[0]] = _RoundTrip(fmt, transposed, True)
                    continue
                shapes = _shapes(model_dir)
                for name in source.names:
                    if transposed or shapes[name][0] % rows:
                        raise ValueError(f"{model_dir}: {name} {shapes[name]} is part of {path}.{stack}, and "
                                         f"{fmt.name}'s {rows}-row blocks straddle it and its neighbour; export "
                                         "--format peft")
                    trips[name] = _RoundTrip(fmt, False, False)
    return trips


def _merge_shard(source: Path, target: Path, updates: dict[str, _Update],
                 round_trips: Mapping[str, _RoundTrip] | None = None) -> None:
    """Overwrite the adapted (and round-tripped) tensors of `target` (a copy of `source`) in place: the header,
    key order and every other byte stay those of the input."""
    header, data_start = _header(source)
    round_trips = round_trips or {}
    with safe_open(str(source), "pt") as reader, open(target, "r+b") as writer:
        for name, entry in header.items():
            update, trip = updates.get(name), round_trips.get(name)
            if name == "__metadata__" or (update is None and trip is None):
                continue
            tensor = reader.get_tensor(name)
            whole = (update is not None and update.expert is None) or (trip is not None and trip.stack)
            for expert in range(tensor.shape[0]) if whole else [None]:  # a stored stack one expert at a time
                part = tensor if expert is None else tensor[expert]
                if trip is not None:
                    part.copy_(trip.applied(part))
                if update is not None:
                    part.copy_(update.applied(part, update.expert if expert is None else expert))
            writer.seek(data_start + entry["data_offsets"][0])
            writer.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


# --------------------------------------------------------------------------------------------------
# per-expert, and back
# --------------------------------------------------------------------------------------------------


def serving_adapter(adapter_dir: str | Path, model_dir: str | Path,
                    fused: bool = False) -> tuple[LoraConfig, dict[str, torch.Tensor], bool]:
    """(config, state, per_expert): the adapter as serving engines load it. Its expert factors go under the
    checkpoint's per-expert module names (per_expert True), or stay in peft's fused layout where `fused` is
    asked or the checkpoint stores its experts fused. Either way every module's factors are at one rank and
    one scale (`_one_scale`), the targets a list of module names (`_serving_config`), and the tensors of
    modules trained in full (`modules_to_save`) as peft saves them."""
    changes = adapter_changes(adapter_dir, model_dir)
    deltas = {name: c for name, c in changes.items() if isinstance(c, _Delta)}
    experts = {} if fused else _on_disk_updates({k: d for k, d in deltas.items() if d.num_experts}, model_dir)
    per_expert = bool(experts) and all(u.expert is not None for u in experts.values())
    kept = {name: d for name, d in deltas.items() if not (per_expert and d.num_experts)}  # the rest: per expert
    factors = {d.key: (d.lora_A, d.lora_B, d.scaling, d.num_experts) for d in kept.values()}
    split = _per_expert_factors(experts, model_dir) if per_expert else {}
    fused_config = LoraConfig.from_pretrained(str(adapter_dir))
    r, lora_alpha, state = _one_scale({**factors, **split}, fused_config)
    state.update({c.key: c.tensor for c in changes.values() if isinstance(c, _Saved)})
    modules = [d.key for d in kept.values() if not d.parameter] + list(split)
    parameters = [p for p in fused_config.target_parameters or ()
                  if any(d.parameter and f".{name}".endswith(f".{p}") for name, d in kept.items())]
    return _serving_config(fused_config, modules, parameters, r, lora_alpha), state, per_expert


def _per_expert_factors(experts: dict[str, _Update], model_dir: str | Path) -> dict[str, tuple]:
    """{adapter key of a per-expert module: (A, B, scaling, 0)}: each per-expert tensor's factors, in the
    adapter's dtype. A per-expert tensor that is part of a stacked gate/up (w1 and w3 concatenated) keeps expert
    e's A_e and takes its rows of B_e: B_e [O, r] rows `start:stop` -> [stop-start, r]; the product is exactly
    its rows of the fused delta."""
    factors = {}
    for name, update in experts.items():
        delta = update.change
        if update.dim != 0 or delta.transposed:
            raise ValueError(f"{model_dir}: {name} holds expert rows along dim {update.dim} of a transposed "
                             "stack; vela-ray cannot split its factors per expert")
        A, B = delta.factors(update.expert)
        factors[f"base_model.model.{name.removesuffix('.weight')}"] = (
            A.to(delta.lora_A.dtype).clone(), B[update.rows[0]:update.rows[1]].to(delta.lora_B.dtype), delta.scaling, 0)
    return factors


def _one_scale(factors: dict[str, tuple[torch.Tensor, torch.Tensor, float, int]],
               config: LoraConfig) -> tuple[int, float, dict[str, torch.Tensor]]:
    """(r, lora_alpha, state): every module's factors {key: (A, B, scaling, experts)} at the largest rank r (A
    and B padded with zeros: each product is unchanged) under one scale, lora_alpha / r, with each module's own
    scaling baked into its B (B * own / one). Serving engines apply one lora_alpha / r to every module (vLLM's
    peft_helper reads neither rank_pattern nor alpha_pattern), so this is how they apply the adapter as
    trained. The scale is `config`'s at rank r, written without rsLoRA (peft's v4 conversion doubles
    lora_alpha with r for a fused gate/up, which keeps alpha / r, not rsLoRA's alpha / sqrt(r))."""
    r = max((A.shape[0] // max(1, experts) for A, _, _, experts in factors.values()), default=config.r)
    lora_alpha = config.lora_alpha * math.sqrt(r) if config.use_rslora else config.lora_alpha
    lora_alpha = int(lora_alpha) if float(lora_alpha).is_integer() else lora_alpha
    scale = lora_alpha / r
    state = {}
    for key, (A, B, own, experts) in factors.items():
        if own != scale:
            B = (B.float() * (own / scale)).to(B.dtype)
        A, B = _padded(A, B, r, experts)
        state[f"{key}.lora_A.weight"], state[f"{key}.lora_B.weight"] = A.contiguous(), B.contiguous()
    return r, lora_alpha, state


def _padded(A: torch.Tensor, B: torch.Tensor, r: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r0*E, I] and B [O, r0*E] (E = `experts`, 1 for a linear layer) at rank r >= r0, each expert's A
    with zero rows and B with zero columns, in peft's fused layout where E > 0."""
    if A.shape[0] == r * max(1, experts):
        return A, B
    if not experts:
        return F.pad(A, (0, 0, 0, r - A.shape[0])), F.pad(B, (0, r - B.shape[1]))
    return fuse_expert_factors([_padded(a, b, r, 0) for a, b in split_expert_factors(A, B, experts)])


def _serving_config(fused: LoraConfig, modules: list[str], parameters: list[str], r: int,
                    lora_alpha: float) -> LoraConfig:
    """`fused` (the trained adapter's config) retargeted at the modules with factors `modules` (adapter keys)
    by their names: a list of module-name suffixes, which peft matches, SGLang reads (it refuses a regex, or
    takes one as "all") and peft's transformers-v4 conversion maps onto transformers' fused experts; at one
    rank and scale (`_one_scale`), so without rank/alpha patterns or rsLoRA. A module the names also match but
    the adapter has no factors for starts with B = 0 (peft's default init): it stays as it was."""
    config = copy.copy(fused)
    config.target_modules = sorted({key.rsplit(".", 1)[-1] for key in modules}) or DUMMY_TARGET_MODULES
    config.target_parameters = parameters or None
    config.exclude_modules = None
    config.r, config.lora_alpha, config.use_rslora = r, lora_alpha, False
    config.rank_pattern, config.alpha_pattern = {}, {}
    config.init_lora_weights = True
    return config


def fused_adapter(adapter_dir: str | Path, model_dir: str | Path) -> tuple[LoraConfig, dict] | None:
    """The inverse of `serving_adapter`'s per-expert layout: (LoraConfig, state) in peft's fused layout, which
    applies to transformers' model of `model_dir` (its fused experts); None where the adapter's factors are all
    on the model's own modules already (peft's layout).

    Expert e of a stack gathers the factors of its per-expert modules (`_gathered`); every module's scaling is
    baked into B and all factors padded to one rank, at scale 1 (lora_alpha = r)."""
    adapter_dir = Path(adapter_dir)
    config = LoraConfig.from_pretrained(str(adapter_dir))
    state = load_file(str(adapter_dir / ADAPTER_FILE))
    modules = {name for name, _ in meta_model(model_dir).named_modules()}
    keys = [k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")]
    if all(_model_path(key) in modules for key in keys):
        return None
    backbone, stacks = _scaled_factors(adapter_dir, model_dir, config, state, keys)
    r = max(A.shape[0] for A, _ in [*backbone.values(), *(f for experts in stacks.values() for f in experts)])
    fused = LoraConfig(r=r, lora_alpha=r, target_modules=sorted(_model_path(k) for k in backbone) or
                       DUMMY_TARGET_MODULES, target_parameters=sorted(stacks) or None,
                       modules_to_save=config.modules_to_save)
    out = {k: v for k, v in state.items() if ".lora_" not in k}  # modules trained in full, as peft saved them
    for key, (A, B) in backbone.items():
        out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = _padded(A, B, r, 0)
    with torch.device("meta"):
        skeleton = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))),
                                  copy.copy(fused))
    wrappers = {f"{_model_path(name)}.{m.parameter_name}": name for name, m in skeleton.named_modules()
                if isinstance(m, ParamWrapper)}
    for target, experts in stacks.items():
        A, B = fuse_expert_factors([_padded(a, b, r, 0) for a, b in experts])
        out[f"{wrappers[target]}.lora_A.weight"], out[f"{wrappers[target]}.lora_B.weight"] = A, B
    return fused, out


def _scaled_factors(adapter_dir: Path, model_dir: str | Path, config: LoraConfig, state: dict,
                    keys: list[str]) -> tuple[dict[str, tuple], dict[str, list[tuple]]]:
    """({key: (A, scaling * B)} of the factors on the model's modules, {expert stack: [(A_e, B_e) per expert]}
    gathered from the per-expert ones): fp32, every scaling in B. A factor on neither is refused, naming it."""
    ckpt = checkpoint_layout(str(model_dir))
    modules = {name for name, _ in ckpt.skeleton.named_modules()}
    stacks = [target for target, source in ckpt.sources.items() if source.ops in _PER_EXPERT_OPS]
    places = {f"base_model.model.{name.removesuffix('.weight')}": u
              for name, u in _on_disk_updates(dict.fromkeys(stacks), model_dir).items() if u.dim == 0}
    backbone, parts = {}, {}
    for key in keys:
        A, B = state[f"{key}.lora_A.weight"].float(), state[f"{key}.lora_B.weight"].float()
        scaling, place = _scaling(config, key.removeprefix("base_model.model.")), places.get(key)
        if place is not None:
            parts.setdefault(place.target, {}).setdefault(place.expert, []).append((place.rows, A, scaling * B))
        elif _model_path(key) in modules:
            backbone[key] = (A, scaling * B)
        else:
            raise ValueError(f"{adapter_dir}: LoRA factors for {key.removeprefix('base_model.model.')}, which "
                             f"{model_dir} has neither as a module nor as a per-expert tensor; use an adapter of "
                             "this model")
    return backbone, {target: [_gathered(experts.get(e, []), *ckpt.shapes[target][1:])
                               for e in range(ckpt.shapes[target][0])] for target, experts in parts.items()}


def _gathered(parts: list, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_e, B_e) of one expert of a stack from its per-expert modules' [(rows, A, B)]: their A's stacked
    [r1+r2, I]; each B in its rows and its own columns of B_e [O, r1+r2] (block diagonal), so B_e @ A_e holds
    each module's product in its rows, whatever their A's."""
    A_e = torch.cat([A for _, A, _ in parts]) if parts else torch.zeros(0, in_features)
    B_e = torch.zeros(out_features, A_e.shape[0])
    column = 0
    for rows, A, B in parts:
        start, stop = rows or (0, out_features)
        B_e[start:stop, column:column + A.shape[0]] = B
        column += A.shape[0]
    return A_e, B_e


def _scaling(config: LoraConfig, module: str) -> float:
    """peft's scaling of `module` under `config` (rank and alpha patterns, rsLoRA), as `LoraLayer.update_layer`
    sets it."""
    ranks, alphas = config.rank_pattern or {}, config.alpha_pattern or {}
    r = ranks.get(get_pattern_key(ranks.keys(), module), config.r)
    alpha = alphas.get(get_pattern_key(alphas.keys(), module), config.lora_alpha)
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


@contextmanager
def peft_layout(adapter_dir: str | Path, model_dir: str | Path) -> Iterator[Path]:
    """A dir of the adapter `adapter_dir` that `PeftModel.from_pretrained` applies to the model of `model_dir`
    as trained: its own, or its per-expert factors gathered into peft's fused layout in a temporary dir
    (`fused_adapter`). peft alone maps per-expert factors onto fused experts only for the families its
    transformers-v4 conversion knows; for the others it applies the attention's and drops every expert's
    without a word."""
    fused = fused_adapter(adapter_dir, model_dir)
    if fused is None:
        yield Path(adapter_dir)
        return
    with tempfile.TemporaryDirectory(prefix="vela-adapter-") as tmp:
        config, state = fused
        save_file(state, str(Path(tmp) / ADAPTER_FILE), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        yield Path(tmp)
