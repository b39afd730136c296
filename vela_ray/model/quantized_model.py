"""Which weights of a model a job holds quantized (`model.quantization`), and the model-side helpers around them.

`vela_ray.model.quantization` is the storage (formats, parts, the frozen multiply, `QuantizedLinear`); this module
walks models and experts: the backbone's linear layers a master quantizes (`quantize_backbone`), an expert's stacks
a worker quantizes as it reads them (`quantize_expert_params`) or dequantizes when a checkpoint ships them
quantized and the job holds them at full width (`dequantize_expert_params`), the bytes one expert takes
(`frozen_bytes_per_expert`), and the model a quantized job computes with, as plain modules (`round_trip_model`:
the tests' and the benchmark's reference).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from vela_ray.model.experts import weight_stacks
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.model.quantization import (
    FORMATS, Format, QuantizedLinear, part_name, quantized_weights, round_trip, split_part_name,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizationSpec:
    """Which frozen weights a job holds quantized, and in which format (`model.quantization`)."""

    format: str
    experts: bool = True  # the experts' weight stacks, on the ExpertManagers
    backbone: bool = True  # the backbone's frozen linear layers on the master (not lm_head or modules trained in full)
    keep_full: tuple[str, ...] = ()  # module names (a path ending) left at full width: peft's modules_to_save

    @property
    def fmt(self) -> Format:
        return FORMATS[self.format]


def quantizable_linears(model: torch.nn.Module, spec: QuantizationSpec) -> list[tuple[torch.nn.Module, str, str]]:
    """(parent, attribute, path) of each plain nn.Linear of the backbone that `spec` quantizes: every one but the
    LM head and `keep_full`'s (peft's LoRA layers are walked into: their `base_layer` is one)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found, unfit = [], []
    for path, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{path}.{name}" if path else name
            if type(child) is not torch.nn.Linear or child is head or ".lora_" in f".{full}":
                continue  # a LoRA factor (peft's lora_A / lora_B linears) trains: never quantized
            if any(full == keep or full.endswith(f".{keep}") or f".{keep}." in f".{full}." for keep in spec.keep_full):
                continue
            if spec.fmt.unfit(tuple(child.weight.shape)) is None:
                found.append((parent, name, full))
            else:  # a layer no whole number of blocks covers stays full width (transformers' modules_to_not_convert)
                unfit.append(full)
    if unfit:
        logger.info("%d linear layers stay at full width, their shapes not whole %s blocks: %s", len(unfit),
                    spec.format, ", ".join(unfit[:4]) + (" ..." if len(unfit) > 4 else ""))
    return found


def quantize_backbone(model: torch.nn.Module, spec: QuantizationSpec) -> None:
    """Replace the backbone's frozen linear layers by `QuantizedLinear`s in `spec`'s format, in place (before or
    after peft wraps them)."""
    for parent, name, _ in quantizable_linears(model, spec):
        setattr(parent, name, QuantizedLinear(getattr(parent, name), spec.fmt))


def quantize_as_read(model: torch.nn.Module, spec: QuantizationSpec) -> Callable[[str], None]:
    """A backbone reader's `filled` callback (`sharded_loading.read_backbone`): each linear weight `spec` quantizes
    is held quantized as soon as it has been read, so a master never holds its whole backbone at full width, only
    the tensor being read. `model`: the master's model, peft-wrapped or not (names as the checkpoint's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    pending = {re.sub(r"\.base_layer$", "", path) + ".weight": (parent, name)
               for parent, name, path in quantizable_linears(inner, spec)}

    def filled(checkpoint_name: str) -> None:
        if checkpoint_name in pending:
            parent, name = pending.pop(checkpoint_name)
            setattr(parent, name, QuantizedLinear(getattr(parent, name), spec.fmt))

    return filled


def round_trip_model(model: torch.nn.Module, spec: QuantizationSpec) -> torch.nn.Module:
    """`model` with every weight `spec` quantizes replaced, in place, by its dequantized value in the weight's
    dtype: the model a quantized job computes with, as plain modules peft can train (the reference of the tests
    and of `benchmarks/quantized_experts.py`)."""
    with torch.no_grad():
        if spec.backbone:
            for parent, name, _ in quantizable_linears(model, spec):
                weight = getattr(parent, name).weight
                weight.copy_(round_trip(weight, spec.fmt))
        if spec.experts:
            for block in find_moe_blocks(model):
                experts = block.block.experts
                transposed = bool(getattr(experts, "is_transposed", False))
                for stack in weight_stacks(experts):
                    weight = getattr(experts, stack)
                    weight.copy_(round_trip(weight, spec.fmt, transposed))
    return model


def quantize_expert_params(params: Mapping[str, torch.Tensor], prototype: torch.nn.Module,
                           spec: QuantizationSpec) -> dict[str, torch.Tensor]:
    """One expert's params (`ExpertParams`) with its weight stacks in `spec`'s format (as `[out, in]` parts;
    `prototype`: its layer's experts module, for which names are stacks and their layout)."""
    stacks = set(weight_stacks(prototype))
    transposed = bool(getattr(prototype, "is_transposed", False))
    out = {name: t for name, t in params.items() if name not in stacks}
    for stack in stacks & set(params):
        w_OI = params[stack].transpose(-2, -1) if transposed else params[stack]
        out.update({part_name(stack, spec.fmt, part): t for part, t in spec.fmt.quantize(w_OI).items()})
    return out


def dequantize_expert_params(params: Mapping[str, torch.Tensor], prototype: torch.nn.Module,
                             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One expert's params with every quantized stack back at full width in `dtype`, in its family's layout (a
    checkpoint shipped quantized, trained with `model.quantization.format: none`)."""
    transposed = bool(getattr(prototype, "is_transposed", False))
    out = {name: t for name, t in params.items() if split_part_name(name) is None}
    for stack, (fmt, parts) in quantized_weights(params).items():
        weight = fmt.dequantize(parts, dtype)
        out[stack] = weight.transpose(-2, -1).contiguous() if transposed else weight
    return out


def frozen_bytes_per_expert(prototype: torch.nn.Module, fmt: str | None, dtype: torch.dtype) -> int:
    """Bytes a worker holds for one expert's frozen tensors: its weight stacks in `fmt` (None: at `dtype`'s width),
    anything else per expert (biases) at `dtype`'s. `prototype`: its layer's experts module (on the meta device)."""
    stacks = set(weight_stacks(prototype))
    total = 0
    for name, tensor in [*prototype.named_parameters(recurse=False), *prototype.named_buffers(recurse=False)]:
        shape = tuple(tensor.shape[1:])
        if name in stacks and fmt is not None:
            total += FORMATS[fmt].nbytes(shape)  # [out, in] or its transpose: the same blocks count
        else:
            total += math.prod(shape) * dtype.itemsize
    return total
