"""What one ExpertManager hosts and how it trains (`ExpertManagerSpec`), and reading those experts.

The spec is plain data, sent to the actor once; `load_expert_weights` reads the spec's experts from the
model's checkpoint (memory-mapped, only those experts) or takes them from its in-memory `weights`:

    spec = ExpertManagerSpec(worker=0, model_dir="/ckpt", keys=[(0, 3), (1, 5)])
    weights, prototypes = load_expert_weights(spec)   # {(layer, expert): {parameter: slice}}, per-layer modules
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PretrainedConfig

from vela_ray.model.experts import ExpertParams, ExpertWeights, LoraSpec
from vela_ray.model.loading import checkpoint_prototypes, read_experts
from vela_ray.model.modeling import experts_prototypes
from vela_ray.model.quantization import quantized_weights, split_part_name
from vela_ray.model.quantized_model import QuantizationSpec, dequantize_expert_params, quantize_expert_params
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.tiers import ExpertTiersConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExpertManagerSpec(BaseModel):
    """What one ExpertManager hosts and how it trains; plain data, sent to the actor once."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    worker: int = Field(ge=0, description="index of this worker in the placement table")
    keys: list[tuple[int, int]] = Field(description="the (MoE layer, expert) pairs this worker hosts")
    model_dir: str | None = Field(None, description="checkpoint to read the experts from (safetensors)")
    trust_remote_code: bool = Field(False, description="`model.trust_remote_code`: run the model's own code")
    weights: dict[tuple[int, int], dict[str, torch.Tensor]] | None = Field(
        None, description="in-memory {(layer, expert): {parameter: slice}} instead of model_dir (tests)"
    )
    # Any, checked below: transformers' configs are dataclasses whose annotations pydantic cannot resolve
    hf_config: Any = Field(
        None, description="the model's PretrainedConfig, whose experts classes compute; required with `weights`"
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="the job's LoRA; rank/alpha patterns resolved per "
                           "expert stack (`adapters.resolve_expert_lora`), which stacks, rsLoRA and init")
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW of the expert adapters")
    seed: int = Field(0, description="LoRA init seed, combined with each (layer, expert)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the frozen experts' dtype, None keeps the stored one; LoRA factors and their AdamW "
                          "state are fp32 under bf16/fp16, as peft keeps them (`experts.adapter_dtype`)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the experts run")
    tiers: ExpertTiersConfig = Field(default_factory=ExpertTiersConfig, description="APTMoE's CPU/device tiers: "
                                     "experts in host memory, `device` only the tier of a bounded cache")
    quantization: QuantizationSpec | None = Field(
        None, description="`model.quantization`: the experts' weight stacks held in its format, each expert "
                          "quantized as it is read (its full-width copy lives for that expert only)")

    @model_validator(mode="after")
    def _one_source(self) -> "ExpertManagerSpec":
        if (self.model_dir is None) == (self.weights is None):
            raise ValueError(f"worker {self.worker}: give exactly one of `model_dir` and `weights`")
        if self.weights is not None:
            missing = [k for k in self.keys if k not in self.weights]
            if missing:
                raise ValueError(f"worker {self.worker}: `weights` lacks experts {missing[:8]} listed in `keys`")
            if not isinstance(self.hf_config, PretrainedConfig):
                raise ValueError(f"worker {self.worker}: in-memory `weights` need the `hf_config` of their model "
                                 f"(a transformers PretrainedConfig, got {type(self.hf_config).__name__})")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"worker {self.worker}: `keys` lists an expert twice")
        return self


def load_expert_weights(spec: ExpertManagerSpec) -> tuple[ExpertWeights, dict]:
    """The spec's experts as {(layer, expert): {parameter: slice}} and each layer's experts prototype; with
    `spec.quantization` on the experts, their stacks as its format's parts, each quantized as it is read."""
    dtype = _DTYPES[spec.dtype] if spec.dtype else None
    quantized = spec.quantization if spec.quantization is not None and spec.quantization.experts else None
    if spec.weights is not None:
        prototypes = experts_prototypes(spec.hf_config)
        weights = {k: _held(k, {n: t.to(dtype) if dtype and split_part_name(n) is None else t
                                for n, t in spec.weights[k].items()}, prototypes, quantized, dtype) for k in spec.keys}
        return weights, prototypes
    trust = spec.trust_remote_code
    prototypes = checkpoint_prototypes(spec.model_dir, trust)
    return (read_experts(spec.model_dir, list(spec.keys), dtype=dtype, trust_remote_code=trust,
                         convert=lambda key, params: _held(key, params, prototypes, quantized, dtype)),
            prototypes)


def _held(key: tuple[int, int], params: ExpertParams, prototypes: dict, quantized: QuantizationSpec | None,
          dtype: torch.dtype | None) -> ExpertParams:
    """One expert's params as the worker holds them: quantized where the job says so. Stacks the checkpoint ships
    quantized stay as shipped in the job's format, and are dequantized without one."""
    shipped = {fmt.name for fmt, _ in quantized_weights(params).values()}
    if shipped and (quantized is None or shipped != {quantized.format}):
        if quantized is not None:
            raise ValueError(f"expert {key} is shipped in {sorted(shipped)}, not model.quantization.format "
                             f"{quantized.format}: use the shipped format or none")
        return dequantize_expert_params(params, prototypes[key[0]], dtype or torch.float32)
    return params if quantized is None or shipped else quantize_expert_params(params, prototypes[key[0]], quantized)


def compute_dtype(spec: ExpertManagerSpec, weights: ExpertWeights) -> torch.dtype:
    """What the spec's experts compute in: `spec.dtype`, else their stored floating dtype (fp32 if none is)."""
    if spec.dtype:
        return _DTYPES[spec.dtype]
    stored = (t.dtype for params in weights.values() for t in params.values() if t.is_floating_point())
    return next(stored, torch.float32)
