"""Zero-redundancy loading from a Hugging Face checkpoint directory (safetensors, possibly sharded).

- `load_backbone(model_dir)`: the master's model with every tensor but the
  experts; expert parameters are created on the meta device, so they are never
  allocated, and are then replaced by brokers.
- `read_experts(model_dir, keys)`: exactly the (layer, expert) FFNs an expert
  host is given, read memory-mapped, one tensor at a time.

transformers writes MoE checkpoints in the per-expert hub layout
(`model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight` for Mixtral,
`...mlp.experts.{e}.gate_proj.weight` for Qwen/DeepSeek/OLMoE); checkpoints
with fused `...experts.gate_up_proj` / `...experts.down_proj` tensors are read
too, by slicing one expert out of the memory map. Layer indices here are MoE
layer indices (see `vela_ray.model.modeling`).
"""

from __future__ import annotations

import contextlib
import json
import re
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from vela_ray.model.modeling import experts_prototypes, find_moe_blocks

_PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\blayers\.(?P<layer>\d+)\.)(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED_KEY = re.compile(r"^(?P<prefix>.*\blayers\.(?P<layer>\d+)\.)(?:\w+\.)*?experts\.(?P<proj>\w+)$")
_PROJ_SLOT = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# checkpoint name -> transformers-5 module name, for backbone tensors
_BACKBONE_RENAMES = [(re.compile(r"\.block_sparse_moe\."), ".mlp.")]

from vela_ray.model.experts import ExpertParams, ExpertWeights


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


def is_expert_tensor(name: str) -> bool:
    return bool(_PER_EXPERT_KEY.match(name) or _FUSED_KEY.match(name))


@lru_cache(maxsize=8)
def _moe_skeleton(model_dir: str) -> tuple[tuple[int, ...], dict]:
    """(decoder layer of each MoE layer, {MoE layer: experts module on meta}) of a checkpoint."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    blocks = find_moe_blocks(skeleton)
    return tuple(b.decoder_layer for b in blocks), {b.index: b.block.experts for b in blocks}


def moe_layout(model_dir: str | Path) -> tuple[int, int]:
    """(MoE layers, experts per layer) of a checkpoint, without loading weights."""
    decoder_layers, prototypes = _moe_skeleton(str(model_dir))
    return len(decoder_layers), _leading_dim(prototypes[0])


def checkpoint_prototypes(model_dir: str | Path) -> dict:
    """{MoE layer: experts module on the meta device} of a checkpoint (see `modeling.experts_prototypes`)."""
    return _moe_skeleton(str(model_dir))[1]


def _leading_dim(experts) -> int:
    return next(p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3)


def read_experts(model_dir: str | Path, keys: list[tuple[int, int]], dtype: torch.dtype | None = None) -> ExpertWeights:
    """{(layer, expert): {parameter name: slice}} for exactly `keys`, memory-mapped reads.

    The names are the experts class's own parameters (and buffers); a fused checkpoint tensor
    `...experts.<name>` is sliced at the expert, and the per-expert hub layout (w1/w3/w2 or
    gate_proj/up_proj/down_proj) is assembled into `gate_up_proj` [gate; up] and `down_proj`.
    """
    by_slot = _expert_tensor_names(checkpoint_index(model_dir))
    decoder_layers, prototypes = _moe_skeleton(str(model_dir))
    out: ExpertWeights = {}
    with _OpenFiles() as files:
        for layer, expert in keys:
            if not 0 <= layer < len(decoder_layers):
                raise ValueError(f"MoE layer {layer} out of range: {model_dir} has {len(decoder_layers)} MoE layers")
            proto = prototypes[layer]
            names = [n for n, _ in [*proto.named_parameters(recurse=False), *proto.named_buffers(recurse=False)]]
            params: ExpertParams = {
                name: _read_param(files, by_slot, decoder_layers[layer], expert, name, model_dir) for name in names}
            out[(layer, expert)] = {n: t.to(dtype) if dtype is not None else t for n, t in params.items()}
    return out


def _expert_tensor_names(index: dict[str, Path]) -> dict[tuple, tuple[str, Path]]:
    """{(decoder_layer, expert|None, slot): (tensor name, file)}; expert None marks a fused tensor."""
    names: dict[tuple, tuple[str, Path]] = {}
    for name, path in index.items():
        if m := _PER_EXPERT_KEY.match(name):
            names[(int(m["layer"]), int(m["expert"]), _PROJ_SLOT[m["proj"]])] = (name, path)
        elif m := _FUSED_KEY.match(name):
            names[(int(m["layer"]), None, m["proj"])] = (name, path)
    return names


def _read_param(files, names, decoder_layer: int, expert: int, param: str, model_dir) -> torch.Tensor:
    if (decoder_layer, None, param) in names:
        name, path = names[(decoder_layer, None, param)]
        return files.get(path).get_slice(name)[expert]  # reads one expert's rows only
    hub = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}.get(param)
    if hub and all((decoder_layer, expert, slot) in names for slot in hub):
        parts = [files.get(names[(decoder_layer, expert, slot)][1]).get_tensor(names[(decoder_layer, expert, slot)][0])
                 for slot in hub]
        return torch.cat(parts, dim=0)
    raise ValueError(f"{model_dir}: no weights for {param} of expert {expert} of decoder layer {decoder_layer}")


class _OpenFiles(contextlib.ExitStack):
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


def load_backbone(model_dir: str | Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model with all non-expert weights loaded and experts left unallocated (meta).

    Call `modeling.attach_brokers` on the result before running it.
    """
    config = AutoConfig.from_pretrained(str(model_dir))
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with _experts_on_meta(config):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = _read_backbone_tensors(model_dir, dtype)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{model_dir}: checkpoint tensors unknown to {type(model).__name__}: "
                         f"{result.unexpected_keys[:5]}")
    missing = [k for k in result.missing_keys if ".experts." not in k and not _tied(model, k)]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks backbone tensors {missing[:5]} ({len(missing)} in all)")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def _read_backbone_tensors(model_dir, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    with _OpenFiles() as files:
        for name, path in checkpoint_index(model_dir).items():
            if is_expert_tensor(name):
                continue
            target = name
            for pattern, replacement in _BACKBONE_RENAMES:
                target = pattern.sub(replacement, target)
            state[target] = files.get(path).get_tensor(name).to(dtype)
    return state


def _tied(model, key: str) -> bool:
    return key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)
