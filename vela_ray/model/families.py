"""Debug-size configs of the MoE families vela-ray supports.

Each entry builds a transformers config small enough to run forward and
backward on a CPU in milliseconds; tests and demos build random models from
them (no hub). `debug_model(family)` returns a seeded fp32 model.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def mixtral_debug(**overrides) -> MixtralConfig:
    return MixtralConfig(**{**_COMMON, "intermediate_size": 48, "num_local_experts": 6,
                            "num_experts_per_tok": 2, **overrides})


def qwen3_moe_debug(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**_COMMON, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 24,
                             "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": True,
                             **overrides})


def olmoe_debug(**overrides) -> OlmoeConfig:
    return OlmoeConfig(**{**_COMMON, "intermediate_size": 24, "num_experts": 6,
                          "num_experts_per_tok": 2, **overrides})


def qwen2_moe_debug(**overrides) -> Qwen2MoeConfig:
    """Qwen2-MoE with its shared expert and sigmoid shared-expert gate."""
    return Qwen2MoeConfig(**{**_COMMON, "intermediate_size": 64, "moe_intermediate_size": 24,
                             "shared_expert_intermediate_size": 32, "num_experts": 6,
                             "num_experts_per_tok": 2, **overrides})


def deepseek_v3_debug(**overrides) -> DeepseekV3Config:
    """DeepSeek-V3 with a dense first layer, shared experts and grouped routing."""
    base = {**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}
    return DeepseekV3Config(**{**base, "intermediate_size": 64, "moe_intermediate_size": 24,
                               "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                               "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                               "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                               "qk_nope_head_dim": 8, "v_head_dim": 8, "rope_scaling": None,
                               **overrides})


FAMILIES: dict[str, Callable[..., PretrainedConfig]] = {
    "mixtral": mixtral_debug,
    "qwen3_moe": qwen3_moe_debug,
    "olmoe": olmoe_debug,
    "qwen2_moe": qwen2_moe_debug,
    "deepseek_v3": deepseek_v3_debug,
}


def debug_config(family: str, **overrides) -> PretrainedConfig:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[family](**overrides)


def debug_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A seeded random fp32 causal-LM of `family` at debug size."""
    config = debug_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init leaves 3-D expert weights tiny or empty; give them real scale
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.normal_(0.0, 0.1)
    return model.eval()
