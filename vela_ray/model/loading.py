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

from vela_ray.model.modeling import find_moe_blocks

_PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\blayers\.(?P<layer>\d+)\.)(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED_KEY = re.compile(
    r"^(?P<prefix>.*\blayers\.(?P<layer>\d+)\.)(?:block_sparse_moe|mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$"
)
_PROJ_SLOT = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# checkpoint name -> transformers-5 module name, for backbone tensors
_BACKBONE_RENAMES = [(re.compile(r"\.block_sparse_moe\."), ".mlp.")]

ExpertWeights = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


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
def _moe_decoder_layers(model_dir: str) -> tuple[int, ...]:
    """Decoder-layer number of each MoE layer index, from a meta-device skeleton (allocates nothing)."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return tuple(b.decoder_layer for b in find_moe_blocks(skeleton))


def moe_layout(model_dir: str | Path) -> tuple[int, int, str]:
    """(MoE layers, experts per layer, activation) of a checkpoint, without loading weights."""
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        blocks = find_moe_blocks(AutoModelForCausalLM.from_config(config))
    return len(blocks), blocks[0].layout.num_experts, blocks[0].layout.activation


def read_experts(model_dir: str | Path, keys: list[tuple[int, int]], dtype: torch.dtype | None = None) -> ExpertWeights:
    """{(layer, expert): (gate_up [2I, D], down [D, I])} for exactly `keys`, memory-mapped reads."""
    by_slot = _expert_tensor_names(checkpoint_index(model_dir))
    decoder_layers = _moe_decoder_layers(str(model_dir))
    out: ExpertWeights = {}
    with _OpenFiles() as files:
        for layer, expert in keys:
            if not 0 <= layer < len(decoder_layers):
                raise ValueError(f"MoE layer {layer} out of range: {model_dir} has {len(decoder_layers)} MoE layers")
            parts = {slot: _read_slot(files, by_slot, decoder_layers[layer], expert, slot, model_dir)
                     for slot in ("gate", "up", "down")}
            gate_up = torch.cat([parts["gate"], parts["up"]], dim=0)
            down = parts["down"]
            if dtype is not None:
                gate_up, down = gate_up.to(dtype), down.to(dtype)
            out[(layer, expert)] = (gate_up, down)
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


def _read_slot(files, names, decoder_layer: int, expert: int, slot: str, model_dir) -> torch.Tensor:
    if (decoder_layer, expert, slot) in names:
        name, path = names[(decoder_layer, expert, slot)]
        return files.get(path).get_tensor(name)
    fused = "down_proj" if slot == "down" else "gate_up_proj"
    if (decoder_layer, None, fused) not in names:
        raise ValueError(f"{model_dir}: no weights for expert {expert} ({slot}) of decoder layer {decoder_layer}")
    name, path = names[(decoder_layer, None, fused)]
    tensor = files.get(path).get_slice(name)[expert]  # reads one expert's rows only
    if slot == "down":
        return tensor
    half = tensor.shape[0] // 2
    return tensor[:half] if slot == "gate" else tensor[half:]


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
