"""Quantized checkpoints as they are shipped, read into vela-ray's quantized storage tensor by tensor.

Two layouts people download (config.json's `quantization_config`, transformers' names):

    fp8     DeepSeek-V3's and Qwen3's fine-grained FP8 (`quant_method: fp8`, e4m3, `weight_block_size` [128, 128]):
            each quantized linear weight `<module>.weight` in float8_e4m3fn beside `<module>.weight_scale_inv`
            [ceil(out/128), ceil(in/128)] fp32; experts stored per expert (`experts.{e}.gate_proj.weight`, ...).
    mxfp4   gpt-oss's (`quant_method: mxfp4`): each expert stack `experts.<stack>` stored as
            `experts.<stack>_blocks` [E, out, in/32, 16] uint8 and `experts.<stack>_scales` [E, out, in/32] uint8.

An expert's stacks are read as the format's parts (`expert_parts`), one expert at a time, never at full width: a
worker keeps them with `model.quantization.format` set to the shipped format, or dequantizes each expert as it
arrives with `format: none` (exact either way: the checkpoint is what it is). The master's FP8 backbone weights are
dequantized one tensor at a time as they are read (`Fp8Dequantizer`, in place of transformers' converter), then
held quantized again when `model.quantization.backbone` says so (the scales re-derived from the dequantized weight:
the same codes, scales within an fp32 rounding). Anything else in `quantization_config` is refused by name
(`shipped_format`), and so are a missing or misshapen scale (`check_shipped`).

`write_shipped` writes a full-width checkpoint in either layout, as the real ones are: what the tests and
`benchmarks/quantized_experts.py` load (no hub here).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vela_ray.model.quantization import FORMATS, Parts

SCALE_SUFFIX = "_scale_inv"  # fp8: `<module>.weight` -> `<module>.weight_scale_inv`
MXFP4_PARTS = {"blocks": "_blocks", "scales": "_scales"}  # mxfp4: `experts.<stack>` -> `experts.<stack>_blocks`


def shipped_format(model_dir: str | Path) -> str | None:
    """The vela-ray format a checkpoint is shipped in (`fp8`, `mxfp4`), None at full width; ValueError naming any
    other `quantization_config`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shipped = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not shipped:
        return None
    method = shipped.get("quant_method")
    if method == "fp8":
        block = list(shipped.get("weight_block_size") or [])
        if shipped.get("fmt", "e4m3") != "e4m3" or block != list(FORMATS["fp8"].block):
            raise ValueError(f"model.path {model_dir}: its fp8 quantization_config (fmt {shipped.get('fmt')!r}, "
                             f"weight_block_size {block}) is not the e4m3 128x128-block layout vela-ray reads; "
                             "dequantize it to bf16 first")
        return "fp8"
    if method == "mxfp4":
        return "mxfp4"
    raise ValueError(f"model.path {model_dir}: config.json's quantization_config is {method!r}, which vela-ray does "
                     "not read (it reads fine-grained fp8 and mxfp4, as DeepSeek-V3, Qwen3 and gpt-oss ship them); "
                     "dequantize the checkpoint to bf16 first, and use model.quantization to hold it quantized")


class Fp8Dequantizer:
    """A shipped FP8 backbone weight read as its full-width tensor: what `loading.convert_whole` runs in place of
    transformers' `WeightConverter` (the same two calls), so both backbone readers dequantize one tensor at a
    time as they read it."""

    operations = ()
    target_patterns: list[str] = []

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def add_tensor(self, target: str, name: str, pattern, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor

    def convert(self, target: str, model=None, config=None) -> dict[str, torch.Tensor]:
        scale = next(t for name, t in self.tensors.items() if name.endswith(SCALE_SUFFIX))
        codes = next(t for name, t in self.tensors.items() if not name.endswith(SCALE_SUFFIX))
        return {target: FORMATS["fp8"].dequantize({"codes": codes.view(torch.uint8), "scale_inv": scale},
                                                  torch.float32)}


def expert_parts(files, ckpt, target: str, expert: int, fmt: str, index: dict[str, Path],
                 transposed: bool) -> Parts | None:
    """One expert's stack `target` (the model's name, e.g. `model.layers.1.mlp.experts.gate_up_proj`) as `fmt`'s
    parts in [out, in] orientation, read from the checkpoint as shipped; None where the stack is not stored
    quantized. `ckpt`: its `loading.CheckpointLayout`; `files`: a `loading.OpenFiles`."""
    if fmt == "mxfp4":
        names = {part: target + suffix for part, suffix in MXFP4_PARTS.items()}
        if names["blocks"] not in index:
            return None
        return {part: files.get(index[name]).get_slice(name)[expert] for part, name in names.items()}
    source = ckpt.sources.get(target)
    if source is None or source.names[0] + SCALE_SUFFIX not in index:
        return None
    if not source.ops:  # one fused [E, ...] tensor and its [E, ...] scales
        name = source.names[0]
        codes, scale = (files.get(index[n]).get_slice(n)[expert] for n in (name, name + SCALE_SUFFIX))
        if transposed:  # 128 x 128 blocks: the [in, out] layout's transpose is the [out, in] one's
            codes, scale = codes.transpose(-2, -1).contiguous(), scale.transpose(-2, -1).contiguous()
        return {"codes": codes.view(torch.uint8), "scale_inv": scale}
    mine = [n for n in source.names if _expert_of(n) == expert]
    codes = [files.get(index[n]).get_tensor(n) for n in mine]
    scales = [files.get(index[n + SCALE_SUFFIX]).get_tensor(n + SCALE_SUFFIX) for n in mine]
    rows = FORMATS["fp8"].block[0]
    if len(mine) > 1 and any(c.shape[0] % rows for c in codes[:-1]):
        raise ValueError(f"{target}: expert {expert}'s {[n.rsplit('.', 2)[-2] for n in mine]} are fused into one "
                         f"stack, but their rows ({[c.shape[0] for c in codes]}) are not whole {rows}-row fp8 "
                         "blocks, so their scales cannot be joined; dequantize the checkpoint to bf16 first")
    return {"codes": torch.cat(codes).view(torch.uint8), "scale_inv": torch.cat(scales)}


def _expert_of(name: str) -> int:
    match = re.search(r"\.experts\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def companions(fmt: str | None) -> tuple[str, ...]:
    """Suffixes of the checkpoint names that are parts of another tensor in `fmt`'s layout, not model tensors."""
    return {"fp8": (SCALE_SUFFIX,), "mxfp4": tuple(MXFP4_PARTS.values())}.get(fmt or "", ())


def check_shipped(model_dir: str | Path) -> str | None:
    """The shipped format of `model_dir` (`shipped_format`), after checking every quantized tensor has its scales,
    shaped as its format's blocks need: one line naming the tensor otherwise. Headers only: nothing is read."""
    fmt = shipped_format(model_dir)
    if fmt is None:
        return None
    headers: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                headers[name] = (piece.get_dtype(), list(piece.get_shape()))
    if fmt == "fp8":
        for name, (dtype, shape) in headers.items():
            if dtype != "F8_E4M3":
                continue
            scale = headers.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"model.path {model_dir}: {name} is stored in fp8 without its {name}{SCALE_SUFFIX}; "
                                 "the checkpoint is incomplete: download it again")
            want = list(FORMATS["fp8"].scale_shape(tuple(shape)))
            if scale[1] != want:
                raise ValueError(f"model.path {model_dir}: {name}{SCALE_SUFFIX} is {scale[1]}, but 128x128 blocks of "
                                 f"{name}'s {shape} need {want}: the checkpoint's block size is not its config's")
    else:
        for name, (_, shape) in headers.items():
            if not name.endswith("_blocks"):
                continue
            scales = headers.get(name.removesuffix("_blocks") + "_scales")
            if scales is None or scales[1] != shape[:-1] or shape[-1] != 16:
                raise ValueError(f"model.path {model_dir}: {name} {shape} needs "
                                 f"{name.removesuffix('_blocks')}_scales {shape[:-1]} (32 fp4 values in 16 bytes "
                                 f"and one e8m0 scale per block), found {None if scales is None else scales[1]}")
    return fmt


def write_dequantized(shipped_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`shipped_dir` written at full width in `dtype`, shard by shard under its own file names: every quantized tensor
    dequantized under the name transformers loads it by (`<module>.weight`, `experts.<stack>`), its scales and blocks
    gone, the rest as stored, and `quantization_config` dropped from config.json. What `vela export --format merged`
    folds a run's adapter into when the run trained on a checkpoint shipped quantized; any engine loads it."""
    shipped_dir, out_dir = Path(shipped_dir), Path(out_dir)
    fmt = shipped_format(shipped_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index_file = shipped_dir / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    total = 0
    for path in sorted(shipped_dir.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(companions(fmt)) and not name.endswith("_blocks"):
                    continue  # a scale: read with its tensor
                if fmt == "mxfp4" and name.endswith("_blocks"):
                    stack = name.removesuffix("_blocks")
                    parts = {"blocks": f.get_tensor(name), "scales": f.get_tensor(stack + "_scales")}
                    tensors[stack] = FORMATS["mxfp4"].dequantize(parts, dtype).transpose(-2, -1).contiguous()
                elif fmt == "fp8" and name + SCALE_SUFFIX in names:
                    parts = {"codes": f.get_tensor(name).view(torch.uint8),
                             "scale_inv": f.get_tensor(name + SCALE_SUFFIX)}
                    tensors[name] = FORMATS["fp8"].dequantize(parts, dtype)
                else:
                    tensors[name] = f.get_tensor(name)
        save_file(tensors, str(out_dir / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index = {**index, "metadata": {**index.get("metadata", {}), "total_size": total}, "weight_map": weight_map}
        (out_dir / index_file.name).write_text(json.dumps(index, indent=2))
    config = json.loads((shipped_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in shipped_dir.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", index_file.name):
            shutil.copy(extra, out_dir / extra.name)
    return out_dir


# --- writing (tests, benchmarks): a full-width checkpoint in the layout the real ones ship ------------------------


def write_shipped(src_dir: str | Path, out_dir: str | Path, fmt: str,
                  keep: tuple[str, ...] = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "router")) -> Path:
    """`src_dir` (a full-width `save_pretrained` directory) written again in `fmt`'s shipped layout: fp8 as
    DeepSeek-V3 ships (every 2-D linear weight but those whose name contains one of `keep`, with its scales), mxfp4
    as gpt-oss ships (its expert stacks' `_blocks` and `_scales`, the rest as it was), in one safetensors file.
    Tokenizer files are copied."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src_dir / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for path in sorted(src_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out.update(_shipped(name, f.get_tensor(name), fmt, keep))
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if fmt == "fp8" else {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                  "model.layers.*.mlp.router",
                                                                                  "model.embed_tokens", "lm_head"]})
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src_dir.iterdir():
        if extra.name not in ("config.json", "model.safetensors", "model.safetensors.index.json") \
                and not extra.name.endswith(".safetensors") and extra.is_file():
            shutil.copy(extra, out_dir / extra.name)
    return out_dir


def _shipped(name: str, tensor: torch.Tensor, fmt: str, keep: tuple[str, ...]) -> dict[str, torch.Tensor]:
    if fmt == "fp8" and name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in keep):
        parts = FORMATS["fp8"].quantize(tensor)
        return {name: parts["codes"].view(torch.float8_e4m3fn), name + SCALE_SUFFIX: parts["scale_inv"]}
    if fmt == "mxfp4" and re.search(r"\.experts\.(gate_up_proj|down_proj)$", name):
        parts = FORMATS["mxfp4"].quantize(tensor.transpose(-2, -1))  # gpt-oss stores [E, in, out]
        return {name + suffix: parts[part] for part, suffix in MXFP4_PARTS.items()}
    return {name: tensor}
