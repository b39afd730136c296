"""A peft adapter folded into its base checkpoint, or rewritten per expert, in the checkpoint's own layout.

- `merge_checkpoint(adapter_dir, model_dir, out_dir)`: the base model with every LoRA delta added, written
  as the input checkpoint is written: the same shard files, key names, dtypes and index, byte for byte
  except the adapted tensors. Each shard is copied, then each adapted tensor is read, updated (in fp32,
  one expert at a time for a fused stack) and written over its own bytes, so memory stays near one
  tensor plus one expert stack whatever the model size.
- `per_expert_adapter(adapter_dir, model_dir)`: the adapter's expert factors under the per-expert module
  names of the checkpoint (`experts.{e}.w1`, `experts.{e}.gate_proj`, ...), the names serving engines'
  model code loads experts by; None where the checkpoint stores its experts fused.

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
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import ParamWrapper
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from vela_ray.model.adapters import ADAPTER_FILE
from vela_ray.model.loading import checkpoint_index, checkpoint_layout

INDEX_FILE = "model.safetensors.index.json"
_PER_EXPERT_OPS = (("MergeModulelist",), ("MergeModulelist", "Concatenate"))


@dataclass(frozen=True)
class _Delta:
    """The LoRA update of one model parameter, from the adapter's factors."""

    lora_A: torch.Tensor  # [r*E, I] (E = 1 for a linear layer)
    lora_B: torch.Tensor  # [O, r*E]
    scaling: float
    num_experts: int  # 0: a linear layer's [O, I] weight
    transposed: bool  # the stack is [E, I, O] (peft's `is_transposed` experts), else [E, O, I]

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
class _Update:
    """What one on-disk tensor gains: `delta.of(expert)` narrowed to `rows` along `dim` (None: all of it;
    expert None: every expert of a stored stack)."""

    delta: _Delta
    expert: int | None
    dim: int = 0
    rows: tuple[int, int] | None = None

    def of(self, expert: int) -> torch.Tensor:
        d = self.delta.of(expert)
        return d if self.rows is None else d.narrow(self.dim, self.rows[0], self.rows[1] - self.rows[0])


# --------------------------------------------------------------------------------------------------
# Reading the adapter
# --------------------------------------------------------------------------------------------------


def adapter_deltas(adapter_dir: str | Path, model_dir: str | Path) -> dict[str, _Delta]:
    """{model parameter name: its LoRA update} of a peft adapter of the model in `model_dir`.

    The adapter's config is applied to the model on the meta device, so peft itself says which module each
    saved factor belongs to, its scaling (`lora_alpha / r`, rslora, rank and alpha patterns) and whether an
    expert stack is [E, O, I] or [E, I, O]."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_FILE).is_file():
        raise ValueError(f"{adapter_dir} is not a peft adapter directory (no {ADAPTER_FILE})")
    lora_config = copy.copy(LoraConfig.from_pretrained(str(adapter_dir)))
    lora_config.base_model_name_or_path = None
    if lora_config.modules_to_save:
        raise ValueError(f"{adapter_dir}: the adapter trains {lora_config.modules_to_save} in full "
                         "(modules_to_save); merged and per-expert exports do not write those yet: use --format peft")
    state = load_file(str(adapter_dir / ADAPTER_FILE))
    with torch.device("meta"):
        skeleton = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))),
                                  lora_config)
    deltas, used = {}, set()
    for name, module in skeleton.named_modules():
        if not isinstance(module, (LoraLinear, ParamWrapper)) or "default" not in module.lora_A:
            continue
        keys = (f"{name}.lora_A.weight", f"{name}.lora_B.weight")
        if not all(k in state for k in keys):
            raise ValueError(f"{adapter_dir}: adapter has no factors for {name} ({keys[0]}); it was saved for "
                             "another model")
        used.update(keys)
        path = re.sub(r"^base_model\.model\.|(\.base_layer)+$", "", name)
        if isinstance(module, ParamWrapper) and module._param_ndim == 2:  # a 2-D parameter: as a linear weight
            deltas[f"{path}.{module.parameter_name}"] = _Delta(
                state[keys[0]], state[keys[1]], module.scaling["default"], 0, False)
        elif isinstance(module, ParamWrapper):
            deltas[f"{path}.{module.parameter_name}"] = _Delta(
                state[keys[0]], state[keys[1]], module.scaling["default"], module.num_experts,
                transposed=not module._did_swap_in_out_features)
        else:
            deltas[f"{path}.weight"] = _Delta(state[keys[0]], state[keys[1]], module.scaling["default"], 0, False)
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"{adapter_dir}: adapter tensors this model has no place for: {unused[:3]}; use an "
                         "adapter of this model")
    return deltas


def _on_disk_updates(deltas: dict[str, _Delta], model_dir: str | Path) -> dict[str, _Update]:
    """{checkpoint tensor name: its update}: each adapted model parameter traced back to the checkpoint
    tensors it loads from (see the module docstring); ValueError naming a conversion with no inverse."""
    ckpt = checkpoint_layout(str(model_dir))
    shapes = _shapes(model_dir)
    updates: dict[str, _Update] = {}
    for target, delta in deltas.items():
        source = ckpt.sources.get(target)
        if source is None:
            raise ValueError(f"{model_dir}: the checkpoint has no tensor for {target}, which the adapter adapts")
        refusal = (f"{model_dir}: {target} is stored as {list(source.names[:2])}, which transformers converts "
                   f"with {list(source.ops) or ['a split']}; vela-ray cannot write a LoRA delta back through that "
                   "conversion, so this family cannot be exported merged or per-expert (use --format peft)")
        if source.first_target != target or source.ops not in ((), *_PER_EXPERT_OPS):
            raise ValueError(refusal)
        if not source.ops:
            if tuple(shapes[source.names[0]]) != tuple(ckpt.shapes[target]):
                raise ValueError(refusal)
            updates[source.names[0]] = _Update(delta, None if delta.num_experts else 0)
            continue
        ops = source.converter.operations
        if any(getattr(op, "dim", 0) != 0 for op in ops if type(op).__name__ == "MergeModulelist"):
            raise ValueError(refusal)
        dim = next((op.dim - 1 for op in ops if type(op).__name__ == "Concatenate"), 0)
        offsets: dict[int, int] = {}
        for name in source.names:  # by expert, then the converter's source order
            expert = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
            start = offsets.get(expert, 0)
            offsets[expert] = start + shapes[name][dim]
            updates[name] = _Update(delta, expert, dim, (start, offsets[expert]))
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
    return _on_disk_updates(adapter_deltas(adapter_dir, model_dir), model_dir)


def merge_checkpoint(adapter_dir: str | Path, model_dir: str | Path, out_dir: str | Path,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Write `model_dir` with the adapter folded in to `out_dir` (see the module docstring)."""
    updates = plan_merge(adapter_dir, model_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = set(checkpoint_index(model_dir).values())
    for file in checkpoint_files(model_dir):
        shutil.copyfile(file, out / file.name)
        if file in weights:
            _merge_shard(file, out / file.name, updates)
            if progress:
                progress(file.name)
    return out


def _merge_shard(source: Path, target: Path, updates: dict[str, _Update]) -> None:
    """Overwrite the adapted tensors of `target` (a copy of `source`) in place: the header, key order and
    every other byte stay those of the input."""
    header, data_start = _header(source)
    with safe_open(str(source), "pt") as reader, open(target, "r+b") as writer:
        for name, entry in header.items():
            update = updates.get(name)
            if name == "__metadata__" or update is None:
                continue
            tensor = reader.get_tensor(name)
            experts = range(tensor.shape[0]) if update.expert is None else [None]
            for expert in experts:  # a stored stack one expert at a time: one expert's fp32 copy at most
                part = tensor if expert is None else tensor[expert]
                part.copy_((part.float() + update.of(update.expert if expert is None else expert)).to(part.dtype))
            writer.seek(data_start + entry["data_offsets"][0])
            writer.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


# --------------------------------------------------------------------------------------------------
# per-expert
# --------------------------------------------------------------------------------------------------


def per_expert_adapter(adapter_dir: str | Path, model_dir: str | Path) -> tuple[LoraConfig, dict] | None:
    """(LoraConfig, adapter state) with every expert factor under the checkpoint's per-expert module names,
    or None where the checkpoint stores the experts fused (serving engines then take peft's fused layout).

    A per-expert tensor that is part of a stacked gate/up (w1 and w3 concatenated) keeps expert e's A_e and
    takes its rows of B_e: B_e [O, r] rows `start:stop` -> [stop-start, r]; the product is exactly its rows of
    the fused delta."""
    deltas = adapter_deltas(adapter_dir, model_dir)
    experts = _on_disk_updates({k: d for k, d in deltas.items() if d.num_experts}, model_dir)
    if not experts:
        return None
    if any(u.expert is None for u in experts.values()):
        return None
    lora_config = LoraConfig.from_pretrained(str(adapter_dir))
    if lora_config.rank_pattern or lora_config.alpha_pattern:
        raise ValueError(f"{adapter_dir}: the adapter has a rank_pattern/alpha_pattern, which per-expert export "
                         "does not rewrite for the per-expert module names yet; use --format peft or merged")
    state = {k: v for k, v in load_file(str(Path(adapter_dir) / ADAPTER_FILE)).items()
             if not _is_expert_key(k, deltas)}
    for name, update in experts.items():
        if update.dim != 0 or update.delta.transposed:
            raise ValueError(f"{model_dir}: {name} holds expert rows along dim {update.dim} of a transposed "
                             "stack; vela-ray cannot split its factors per expert")
        A, B = update.delta.factors(update.expert)
        module = name.removesuffix(".weight")
        dtype = update.delta.lora_A.dtype
        state[f"base_model.model.{module}.lora_A.weight"] = A.to(dtype).clone()
        state[f"base_model.model.{module}.lora_B.weight"] = B[update.rows[0]:update.rows[1]].to(dtype).contiguous()
    per_expert = {name.removesuffix(".weight") for name in experts}
    config = _per_expert_config(lora_config, per_expert)
    return config, state


def _is_expert_key(key: str, deltas: dict[str, _Delta]) -> bool:
    path = re.sub(r"^base_model\.model\.|(\.base_layer)*\.lora_[AB]\.weight$", "", key)
    return any(d.num_experts and target.startswith(path + ".") for target, d in deltas.items())


def _per_expert_config(fused: LoraConfig, modules: set[str]) -> LoraConfig:
    """`fused` with the expert parameters replaced by the per-expert linear modules (one regex, layer and
    expert numbers as \\d+), the backbone targets kept."""
    experts = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules})
    backbone = fused.target_modules
    if isinstance(backbone, str):
        backbone_patterns = [backbone.removeprefix("^(?:").removesuffix(")$")] if backbone else []
    else:
        backbone_patterns = [rf"(?:.*\.)?{re.escape(m)}" for m in sorted(backbone or [])]
    config = copy.copy(fused)
    config.target_modules = "^(?:" + "|".join(backbone_patterns + experts) + ")$"
    config.target_parameters = None
    return config
