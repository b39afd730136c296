"""Zero-redundancy loading from a Hugging Face checkpoint directory (safetensors, possibly sharded).

- `load_backbone(model_dir)`: the master's model with every tensor but the
  experts; expert parameters are created on the meta device, so they are never
  allocated, and are then replaced by brokers.
- `read_experts(model_dir, keys)`: exactly the (layer, expert) weights an expert
  host is given, read memory-mapped, one expert's rows at a time.

Checkpoint names are mapped to the model's own names with transformers' conversion
mapping for the family (`transformers.conversion_mapping`: the renames and merges
`from_pretrained` applies), so the hub layouts load as transformers loads them:
per-expert `experts.{e}.w1/w3/w2` or `gate_proj/up_proj/down_proj` tensors are
assembled into one expert's `gate_up_proj` / `down_proj` rows, fused tensors under
other names (Granite's `input_linear`) are sliced, and renamed routers load. Every
other conversion runs transformers' own `WeightConverter` on the gathered tensors:
the whole tensors for the backbone (lara_mini's fused `in_proj` split into four,
inkling2's padded `lm_head`), one expert's rows of each fused source for experts
(inkling2's interleaved `w13`). A conversion that does not act within each expert
is refused by name. Layer indices here are MoE layer indices (see
`vela_ray.model.modeling`). A checkpoint shipped quantized (DeepSeek-V3's FP8, gpt-oss's MXFP4:
`vela_ray.model.shipped`) gives its experts as their format's parts and its FP8 backbone weights dequantized
one tensor at a time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.core_model_loading import WeightConverter

from vela_ray.model.dtypes import torch_dtype
from vela_ray.model.experts import ExpertParams, ExpertWeights
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.model.quantization import FORMATS, part_name, split_part_name
from vela_ray.model.shipped import SCALE_SUFFIX, Fp8Dequantizer, companions, expert_parts, shipped_format

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """{tensor name: safetensors file} for a single-file or sharded checkpoint."""
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
                         "save the model with save_pretrained(..., safe_serialization=True)")
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


@dataclass(frozen=True)
class TensorSource:
    """Where a model tensor comes from: checkpoint tensors (in order) and the converter that combines them."""

    names: tuple[str, ...]
    files: tuple[Path, ...]
    patterns: tuple[str | None, ...]  # the converter's source pattern each name matched (None: no converter)
    converter: WeightConverter | None  # transformers' conversion for the family; None: stored whole, maybe renamed
    # the model tensor transformers gathers the names under: a one-to-many converter's (Split) first target,
    # whose conversion also yields the others
    first_target: str

    @property
    def ops(self) -> tuple[str, ...]:
        """The converter's operations by name, e.g. ("MergeModulelist", "Concatenate")."""
        return tuple(type(op).__name__ for op in self.converter.operations) if self.converter else ()


@dataclass(frozen=True)
class CheckpointLayout:
    decoder_layers: tuple[int, ...]  # decoder layer of each MoE layer
    prototypes: dict  # {MoE layer: experts module on meta}
    experts_paths: tuple[str, ...]  # model path of each MoE layer's experts
    sources: dict  # {model tensor name: TensorSource}; every target of a one-to-many converter shares its TensorSource
    skeleton: torch.nn.Module  # the model on the meta device: what conversions read shapes and dtypes from
    shapes: dict  # {model tensor name: torch.Size}
    shipped: str | None = None  # the quantized format the checkpoint ships in (`vela_ray.model.shipped`), if any
    index: dict | None = None  # {checkpoint tensor name: file}


@functools.cache
def register_model_code(model_dir: str) -> str:
    """Run the model's own code (config.json's `auto_map`: the user opted in with `model.trust_remote_code`)
    and register its config and causal-LM classes with transformers' Auto classes in this process, so
    every later AutoConfig / AutoModelForCausalLM call (here, in peft, in the meta skeletons) builds the
    model as it builds a built-in family. Returns its model_type. Each process that reads the model calls
    it (through `trust_remote_code=True` on this module's entry points); once per process and directory."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    reference = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if reference is None:
        raise ValueError(f"{model_dir}: model.trust_remote_code is set but config.json's auto_map names no "
                         "AutoModelForCausalLM class; add it, or turn trust_remote_code off for a built-in family")
    from transformers import CONFIG_MAPPING

    if config.model_type in CONFIG_MAPPING and CONFIG_MAPPING[config.model_type] is not type(config):
        raise ValueError(f"{model_dir}: its own code reuses transformers' model_type {config.model_type!r}; give "
                         "its config class a model_type of its own")
    model_class = get_class_from_dynamic_module(reference, model_dir)
    AutoConfig.register(config.model_type, type(config), exist_ok=True)
    AutoModelForCausalLM.register(type(config), model_class, exist_ok=True)
    return config.model_type


def model_key(model_dir: str | Path, trust_remote_code: bool) -> str:
    """`model_dir` as the key of the caches here, with its own code registered if the user trusts it."""
    key = str(Path(model_dir).resolve()) if trust_remote_code else str(model_dir)
    if trust_remote_code:
        register_model_code(key)
    return key


def meta_model(model_dir: str | Path, trust_remote_code: bool = False) -> torch.nn.Module:
    """The checkpoint's architecture on the meta device: names, shapes and modules, no weights read, no memory."""
    key = model_key(model_dir, trust_remote_code)
    config = AutoConfig.from_pretrained(key, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


@lru_cache(maxsize=8)
def checkpoint_layout(model_dir: str) -> CheckpointLayout:
    """The model's MoE structure (a meta-device skeleton) and where each of its tensors is in the checkpoint."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, dot_natural_key, rename_source_key

    index = checkpoint_index(model_dir)  # no weights: say so before anything else
    shipped = shipped_format(model_dir)
    parts_of_others = companions(shipped)  # a shipped format's scales and blocks: parts of a tensor, read with it
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    blocks = find_moe_blocks(skeleton)
    conversions = get_model_conversion_mapping(skeleton)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = {p: c for c in conversions if isinstance(c, WeightConverter) for p in c.source_patterns}
    meta_state = skeleton.state_dict()
    prefix = getattr(skeleton, "base_model_prefix", None)
    grouped: dict[str, list] = {}
    # as transformers' convert_and_load_state_dict_in_model does: sorted keys (some renames are guarded by
    # an earlier key), the base-model prefix, and no rename of a key that already names a model tensor
    for name, path in sorted(index.items(), key=lambda kv: dot_natural_key(kv[0])):
        if parts_of_others and name.endswith(parts_of_others):
            continue
        target, pattern = rename_source_key(name, renamings, list(dict.fromkeys(converters.values())), prefix,
                                            meta_state)
        if target not in meta_state and name in meta_state:
            target, pattern = rename_source_key(name, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        order = converters[pattern].source_patterns.index(pattern) if pattern else 0
        grouped.setdefault(target, []).append((order, _expert_of(name) if pattern else -1, name, path, pattern))
    sources = {}
    for target, parts in grouped.items():
        parts.sort(key=lambda p: (p[1], p[0]))  # by expert, then the converter's source order
        converter = converters[parts[0][4]] if parts[0][4] else None
        source = TensorSource(tuple(p[2] for p in parts), tuple(p[3] for p in parts), tuple(p[4] for p in parts),
                         converter, target)
        for name in _targets_of(target, converter):
            sources[name] = source
    experts = tuple(f"{b.experts_path}." for b in blocks)
    if shipped == "fp8":  # the backbone's fp8 weights: read with their scales, dequantized as they are read
        for target, source in list(sources.items()):
            scale = source.names[0] + SCALE_SUFFIX
            if target.startswith(experts) or scale not in index:
                continue
            if source.converter is not None:
                raise ValueError(f"{model_dir}: {target} is shipped in fp8 and converted by transformers "
                                 f"({list(source.ops)}), which vela-ray does not read quantized; dequantize the "
                                 "checkpoint to bf16 first")
            sources[target] = TensorSource((source.names[0], scale), (source.files[0], index[scale]), (None, None),
                                           Fp8Dequantizer(), target)
    return CheckpointLayout(tuple(b.decoder_layer for b in blocks), {b.index: b.block.experts for b in blocks},
                            tuple(b.experts_path for b in blocks), sources, skeleton,
                            {name: t.shape for name, t in meta_state.items()}, shipped, index)


def _targets_of(first_target: str, converter: WeightConverter | None) -> list[str]:
    """Every model tensor a conversion gathered under `first_target` yields. transformers renames a source key
    to a one-to-many converter's first target only (e.g. lara_mini's in_proj -> in_proj_qkv) and names the others
    by swapping in their target patterns, as here."""
    patterns = converter.target_patterns if converter else []
    return [first_target] + [first_target.replace(patterns[0], other) for other in patterns[1:]]


def _expert_of(name: str) -> int:
    match = _EXPERT_INDEX.search(name)
    return int(match.group(1)) if match else -1


def moe_layout(model_dir: str | Path, trust_remote_code: bool = False) -> tuple[int, int]:
    """(MoE layers, experts per layer) of a checkpoint, without loading weights."""
    ckpt = checkpoint_layout(model_key(model_dir, trust_remote_code))
    return len(ckpt.decoder_layers), _leading_dim(ckpt.prototypes[0])


def checkpoint_prototypes(model_dir: str | Path, trust_remote_code: bool = False) -> dict:
    """{MoE layer: experts module on the meta device} of a checkpoint (see `modeling.experts_prototypes`)."""
    return checkpoint_layout(model_key(model_dir, trust_remote_code)).prototypes


def _leading_dim(experts) -> int:
    return next(p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3)


def read_experts(model_dir: str | Path, keys: list[tuple[int, int]], dtype: torch.dtype | None = None,
                 trust_remote_code: bool = False,
                 convert: Callable[[tuple[int, int], ExpertParams], ExpertParams] | None = None) -> ExpertWeights:
    """{(layer, expert): {parameter name: slice}} for exactly `keys`, memory-mapped reads.

    The names are the experts class's own parameters (and buffers), read as transformers
    would load them (see the module docstring), one expert's rows at a time; a stack the checkpoint ships
    quantized (`vela_ray.model.shipped`) as its format's parts. `convert(key, params)`: what is
    kept of each expert, applied as it is read (a worker quantizes there, so one expert is at full width at a time).
    """
    ckpt = checkpoint_layout(model_key(model_dir, trust_remote_code))
    out: ExpertWeights = {}
    with OpenFiles() as files:
        for layer, expert in keys:
            if not 0 <= layer < len(ckpt.decoder_layers):
                raise ValueError(f"MoE layer {layer} out of range: {model_dir} has {len(ckpt.decoder_layers)} MoE layers")
            proto = ckpt.prototypes[layer]
            names = [n for n, _ in [*proto.named_parameters(recurse=False), *proto.named_buffers(recurse=False)]]
            params: ExpertParams = {}
            for name in names:
                target = f"{ckpt.experts_paths[layer]}.{name}"
                parts = (expert_parts(files, ckpt, target, expert, ckpt.shipped, ckpt.index,
                                      bool(getattr(proto, "is_transposed", False))) if ckpt.shipped else None)
                if parts is None:
                    params[name] = _read_expert_tensor(files, ckpt, target, expert, model_dir)
                else:  # as shipped: its format's parts, never at full width here
                    fmt = FORMATS[ckpt.shipped]
                    params.update({part_name(name, fmt, part): t for part, t in parts.items()})
            params = {n: t.to(dtype) if dtype is not None and split_part_name(n) is None else t
                      for n, t in params.items()}
            out[(layer, expert)] = convert((layer, expert), params) if convert is not None else params
    return out


def _read_expert_tensor(files, ckpt: CheckpointLayout, target: str, expert: int, model_dir) -> torch.Tensor:
    """One expert's rows of model tensor `target` [E, ...]."""
    source = ckpt.sources.get(target)
    if source is None:
        raise ValueError(f"{model_dir}: the checkpoint has no tensor for {target}; it does not match its config.json")
    if not source.ops:  # a fused tensor, maybe under another name: slice one expert out of the memory map
        return files.get(source.files[0]).get_slice(source.names[0])[expert]
    if source.ops in (("MergeModulelist",), ("MergeModulelist", "Concatenate")):
        mine = [(n, f) for n, f in zip(source.names, source.files) if _expert_of(n) == expert]
        if not mine:
            raise ValueError(f"{model_dir}: no checkpoint tensors for expert {expert} of {target}")
        parts = [files.get(f).get_tensor(n) for n, f in mine]
        concat_dim = next((op.dim for op in source.converter.operations if type(op).__name__ == "Concatenate"), 1)
        return torch.cat(parts, dim=concat_dim - 1) if len(parts) > 1 else parts[0]
    return _convert_one_expert(files, ckpt, source, target, expert, model_dir)


def _convert_one_expert(files, ckpt: CheckpointLayout, source: TensorSource, target: str, expert: int,
                        model_dir) -> torch.Tensor:
    """One expert's rows of `target`, by transformers' own converter run on that expert's part of each source
    (rows `expert:expert+1` of a fused [E, ...] tensor, or the expert's own tensor), so only its rows are read.

    This is what transformers computes wherever the operations act within each expert (Interleave, Concatenate,
    Split or Transpose past dim 0, dequantizing); one that mixes experts (along dim 0) fails on a single
    expert or changes its shape, and is refused by name."""
    converter = copy.deepcopy(source.converter)  # it collects tensors: never fill the cached one
    for name, path, pattern in zip(source.names, source.files, source.patterns):
        if _expert_of(name) < 0:
            converter.add_tensor(source.first_target, name, pattern, files.get(path).get_slice(name)[expert:expert + 1])
        elif _expert_of(name) == expert:
            converter.add_tensor(source.first_target, name, pattern, files.get(path).get_tensor(name))
    refusal = (f"{model_dir}: {target} is stored as {list(source.names[:2])} and transformers converts it with "
               f"{list(source.ops)}, which vela-ray does not apply one expert at a time")
    try:
        rows = converter.convert(source.first_target, model=ckpt.skeleton, config=ckpt.skeleton.config).get(target)
    except Exception as err:  # noqa: BLE001 - any op that cannot run on one expert's rows
        raise ValueError(f"{refusal} ({type(err).__name__}: {err})") from err
    if rows is None or rows.shape != (1, *ckpt.shapes[target][1:]):
        raise ValueError(f"{refusal} (one expert came out {None if rows is None else list(rows.shape)})")
    return rows[0]


@dataclass
class ReadCount:
    """Bytes and tensors read from checkpoint files by this process for the master's backbone: every backbone read
    (`load_backbone`, `sharded_loading.read_backbone`) adds what it read, so a benchmark or a test sees what a
    process, and a node's processes together, read (`benchmarks/master_loading.py`)."""

    bytes: int = 0
    tensors: int = 0

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        self.tensors += 1
        return tensor


BACKBONE_READS = ReadCount()
"""This process's backbone reads, from its start."""


class OpenFiles(contextlib.ExitStack):
    """safe_open handles, opened once per file."""

    def __init__(self):
        super().__init__()
        self._handles = {}

    def get(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self.enter_context(safe_open(str(path), "pt"))
        return self._handles[path]


@contextlib.contextmanager
def _experts_on_meta(config: PretrainedConfig):
    """While active, the model's experts classes create their parameters on the meta device."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    classes = {type(b.block.experts) for b in find_moe_blocks(skeleton)}
    originals = {cls: cls.__init__ for cls in classes}

    def on_meta(original):
        def __init__(self, *args, **kwargs):
            with torch.device("meta"):
                original(self, *args, **kwargs)
        return __init__

    try:
        for cls, original in originals.items():
            cls.__init__ = on_meta(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.__init__ = original


def backbone_skeleton(model_dir: str | Path, dtype: torch.dtype | None = None,
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """The model with its backbone tensors allocated but neither initialised nor read (transformers'
    `no_init_weights`: no random draws, so torch's generator is where it was, as after `from_pretrained`; untouched
    memory costs no host pages) and its experts unallocated (meta): what `load_backbone` fills, or a tensor-parallel
    rank shards and then fills with its shards only (`sharded_loading.read_backbone`)."""
    config = AutoConfig.from_pretrained(str(model_key(model_dir, trust_remote_code)))
    return _skeleton(config, torch_dtype(dtype or getattr(config, "dtype", None) or torch.float32))


def _skeleton(config: PretrainedConfig, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.initialization import no_init_weights

    with _experts_on_meta(config), no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_backbone(model_dir: str | Path, dtype: torch.dtype | None = None,
                  trust_remote_code: bool = False) -> torch.nn.Module:
    """The model with all non-expert weights loaded and experts left unallocated (meta).

    Call `modeling.attach_brokers` on the result before running it.
    """
    model_dir = model_key(model_dir, trust_remote_code)
    config = AutoConfig.from_pretrained(str(model_dir))
    dtype = torch_dtype(dtype or getattr(config, "dtype", None) or torch.float32)
    model = _skeleton(config, dtype)  # every backbone tensor is then read: none needs an initial value
    state = _read_backbone_tensors(model_dir, model, dtype)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{model_dir}: checkpoint tensors unknown to {type(model).__name__}: "
                         f"{result.unexpected_keys[:5]}")
    experts = tuple(f"{path}." for path in checkpoint_layout(str(model_dir)).experts_paths)
    missing = [k for k in result.missing_keys if not k.startswith(experts) and not _tied(model, k)]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks backbone tensors {missing[:5]} ({len(missing)} in all)")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def _read_backbone_tensors(model_dir, model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every model tensor outside the experts of `model` (the backbone being loaded), under the model's names
    (see the module docstring)."""
    ckpt = checkpoint_layout(str(model_dir))
    experts = tuple(f"{path}." for path in ckpt.experts_paths)
    state = {}
    with OpenFiles() as files:
        for target, source in ckpt.sources.items():
            if target.startswith(experts) or target != source.first_target:  # a Split's others come with the first
                continue
            if source.converter is None:
                state[target] = BACKBONE_READS.add(files.get(source.files[0]).get_tensor(source.names[0])).to(dtype)
            else:
                state.update({name: t.to(dtype) for name, t in convert_whole(files, source, model).items()})
    return state


def convert_whole(files, source: TensorSource, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{model tensor name: tensor} that transformers' converter makes of `source`'s checkpoint tensors, run as
    `convert_and_load_state_dict_in_model` runs it: the tensors gathered under their source patterns in key
    order, then every operation with the model and its config at hand (Split reads its targets' sizes there)."""
    converter = copy.deepcopy(source.converter)  # it collects tensors: never fill the cached one
    for name, path, pattern in zip(source.names, source.files, source.patterns):
        converter.add_tensor(source.first_target, name, pattern, BACKBONE_READS.add(files.get(path).get_tensor(name)))
    return converter.convert(source.first_target, model=model, config=model.config)


def _tied(model, key: str) -> bool:
    return key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)
