"""Debug-size configs of the MoE families vela-ray supports.

Two sets of families live here:

* `FAMILIES`: the five hand-written configs vela-ray is tested on everywhere
  (mixtral, qwen3_moe, olmoe, qwen2_moe, deepseek_v3). Their values are pinned
  by other tests; do not change them.
* `moe_families()` / `ALL_FAMILIES`: every Mixture-of-Experts causal-LM family
  of the installed transformers, discovered at run time. Their debug configs
  come from `generic_debug_config`, which shrinks the family's default config
  (`CONFIG_MAPPING[model_type]()`) field by field, plus a small table of
  per-family overrides (`_FAMILY_OVERRIDES`) where the generic rule cannot work.

Every debug config is small enough to run forward and backward on a CPU in
milliseconds; tests and demos build random models from them (no hub).
`debug_model(family)` returns a seeded fp32 model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import re
from pathlib import Path
from typing import Any, Callable

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

from vela_ray.errors import first_line

log = logging.getLogger(__name__)

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


# The curated families: other tests iterate these, keep them to these five.
FAMILIES: dict[str, Callable[..., PretrainedConfig]] = {
    "mixtral": mixtral_debug,
    "qwen3_moe": qwen3_moe_debug,
    "olmoe": olmoe_debug,
    "qwen2_moe": qwen2_moe_debug,
    "deepseek_v3": deepseek_v3_debug,
}


# --------------------------------------------------------------------------------------------------
# Generic shrinker
# --------------------------------------------------------------------------------------------------

VOCAB = 128
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
LAYERS = 2
EXPERTS = 8
TOP_K = 2

# Ids of multimodal placeholder tokens (image/video/audio...) go to the top of the vocabulary so that
# text inputs drawn from [3, 100) never contain them.
_SPECIAL_TOP = VOCAB - 1

# Fields set to a fixed value wherever the config has them as an int.
_FIXED_INT: dict[str, int] = {
    # widths
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN,
    "intermediate_size": 64, "ffn_hidden_size": 64, "intermediate_size_mlp": 64, "dense_intermediate_size": 64,
    "d_ff": 64, "ffn_dim": 64,
    "moe_intermediate_size": 24, "expert_ffn_hidden_size": 24,
    "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "moe_latent_size": 16, "router_hidden_size": 16,
    # attention
    "num_attention_heads": HEADS, "n_heads": HEADS, "n_head": HEADS, "num_heads": HEADS,
    "head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM, "kv_channels": HEAD_DIM,
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS, "swa_head_dim": HEAD_DIM,
    "kv_lora_rank": 16, "q_lora_rank": 16, "o_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16, "v_head_dim": 8,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
    "index_topk_blocks": 2, "index_block_size": 4, "index_local_blocks": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM, "linear_num_heads": HEADS, "linear_head_dim": HEAD_DIM,
    "sliding_window": 8, "sliding_window_size": 8, "attention_window_size": 8, "attention_chunk_size": 8,
    "rotary_dim": HEAD_DIM,
    # state-space / hybrid layers
    "mamba_d_state": 8, "mamba_d_head": HEAD_DIM, "mamba_head_dim": HEAD_DIM, "mamba_headdim": HEAD_DIM,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_n_groups": 1, "mamba_d_ssm": 64,
    "mamba_chunk_size": 8, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 8, "mamba_dt_rank": 4,
    # sequence / vocabulary
    "vocab_size": VOCAB, "max_position_embeddings": 128, "max_seq_len": 128, "n_positions": 128,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "model_max_length": 128,
    # experts
    "zero_expert_num": 2,
}
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_KS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "moe_k", "top_k_experts")
_SHARED_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_NONE_TO_SIZE = ("moe_intermediate_size", "expert_ffn_hidden_size", "head_dim")
_KV_HEADS = ("num_key_value_heads", "kv_n_heads", "num_kv_heads")
_DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
_LAYER_COUNTS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
_SUB_CONFIG_LAYERS = 1  # vision / audio towers of composite configs get one layer

# Families the generic rule cannot shrink alone: extra fields (given as kwargs to the config class).
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma4_text": {"enable_moe_block": True, "global_head_dim": HEAD_DIM},
    "doge": {"is_moe": True, "num_experts": 16},  # product-key experts: num_experts must be a square
    # DbrxAttention reads attn_config.rope_theta and clamps with clip_qkv (None by default)
    # sliding-window layers take their MLA sizes from popped swa_* kwargs with full-size defaults
    "dots3_note_text": {"swa_num_attention_heads": HEADS, "swa_num_key_value_heads": HEADS, "swa_q_lora_rank": 16,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 8},
    # the default pattern has a single MoE layer; layers_block_type sets the layer count
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "zaya": {"num_experts_per_tok": 1},  # ZAYA supports top-1 routing only
    # indexed (QSA) attention layers need the indexer fields, which default to None
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 8, "indexer_compress_ratio": 4},
    "lfm2_moe": {"layer_types": ["full_attention", "conv", "full_attention"]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
}


def _default_config(model_type: str) -> PretrainedConfig:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def _reduce_layer_list(values: list, n: int) -> list:
    """A layer-indexed list cut to `n` entries keeping every distinct value (in order of first use).

    The last distinct value fills the tail: `[dense]*3 + [sparse]*58` -> `[dense, sparse, sparse]`.
    """
    distinct = list({repr(v): v for v in values}.values())
    if len(distinct) >= n:
        return distinct[:n]
    return distinct[:-1] + [distinct[-1]] * (n - len(distinct) + 1)


def _is_index_list(values: list) -> bool:
    """A strictly increasing list of layer indices (e.g. moe_layers=[1, 3, 5]) rather than per-layer values."""
    return (all(isinstance(v, int) and not isinstance(v, bool) for v in values) and len(values) > 1
            and all(a < b for a, b in zip(values, values[1:])))


def _small_token_id(value):
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if value < VOCAB else None
    if isinstance(value, (list, tuple)):
        kept = [v for v in value if isinstance(v, int) and v < VOCAB]
        return kept or None
    return value


def _shrink_kwargs(config: PretrainedConfig, *, top_level: bool, parent_hidden: tuple = (),
                   layers: int | None = None) -> dict[str, Any]:
    """The kwargs that rebuild `config` (a default config) at debug size (`layers` layers if given)."""
    values = config.to_dict()
    kwargs: dict[str, Any] = {}
    default_layers = None
    for name in _LAYER_COUNTS:
        if isinstance(values.get(name), int):
            default_layers = values[name]
            break

    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if name in _FIXED_INT and isinstance(value, int):
            kwargs[name] = _FIXED_INT[name]
        elif name in _EXPERT_COUNTS and (value is None or isinstance(value, int) and value > 0):
            kwargs[name] = EXPERTS
        elif name in _TOP_KS and (value is None or isinstance(value, int)):
            kwargs[name] = TOP_K
        elif name in _NONE_TO_SIZE and value is None:
            kwargs[name] = _FIXED_INT[name]
        elif name in _SHARED_COUNTS and (value is None or isinstance(value, int)):
            kwargs[name] = 1 if value is None else min(value, 1)
        elif name.endswith("vocab_size") and isinstance(value, int):
            # variants of the vocabulary size (inkling2's unpadded_vocab_size sizes its lm_head and must not
            # exceed vocab_size, which the checkpoint pads the lm_head to)
            kwargs[name] = VOCAB
        elif name in ("depth",) and isinstance(value, int):
            kwargs[name] = _SUB_CONFIG_LAYERS

    # MLA families (qk_rope_head_dim/qk_nope_head_dim): head_dim keeps its relation to them
    if isinstance(values.get("qk_rope_head_dim"), int) and isinstance(values.get("head_dim"), int):
        rope, nope = values["qk_rope_head_dim"], values.get("qk_nope_head_dim") or 0
        if values["head_dim"] == rope + nope:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"] + kwargs.get("qk_nope_head_dim", 0)
        elif values["head_dim"] == rope:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    # attention heads: keep MHA families MHA
    heads = values.get("num_attention_heads", values.get("n_heads"))
    for name in _KV_HEADS:
        if isinstance(values.get(name), int):
            kwargs[name] = HEADS if values[name] == heads else KV_HEADS

    # grouped routing
    for name in ("n_group", "num_expert_group"):
        if isinstance(values.get(name), int) and values[name] > 1:
            kwargs[name] = 2
            if isinstance(values.get("topk_group"), int):
                kwargs["topk_group"] = 1

    # layers: 2, or 3 with a dense first layer (or with layers of several kinds, see below)
    fixed_layers = layers is not None
    if layers is None:
        layers = LAYERS if top_level else _SUB_CONFIG_LAYERS
    for name in _DENSE_PREFIX:
        if isinstance(values.get(name), int) and values[name] > 0:
            kwargs[name] = 1
            layers = layers if fixed_layers else LAYERS + 1
    if isinstance(values.get("decoder_sparse_step"), int):
        kwargs["decoder_sparse_step"] = 1
    if isinstance(values.get("mlp_only_layers"), list):
        kwargs["mlp_only_layers"] = []
    if isinstance(values.get("interleave_moe_layer_step"), int):
        kwargs["interleave_moe_layer_step"] = 1
    if isinstance(values.get("expert_layer_period"), int):
        kwargs["expert_layer_period"], kwargs["expert_layer_offset"] = 1, 0
    if isinstance(values.get("attn_layer_period"), int):  # jamba-style hybrids: layer 1 is attention
        kwargs["attn_layer_period"], kwargs["attn_layer_offset"] = 2, 1
    if isinstance(values.get("moe_layer_interval"), int):
        kwargs["moe_layer_interval"] = 1
    if default_layers is not None:
        # layer-indexed lists (layer_types, mlp_layer_types, ...) must have one entry per layer
        per_layer = {name: value for name, value in values.items()
                     if isinstance(value, list) and len(value) == default_layers and default_layers > 1
                     and not _is_index_list(value) and name not in kwargs}
        for value in per_layer.values():
            distinct = len({repr(v) for v in value})
            if distinct > 1 and not fixed_layers:  # [dense, sparse]: repeat the last kind, two MoE layers remain
                layers = max(layers, distinct + 1)
        for name, value in per_layer.items():
            kwargs[name] = _reduce_layer_list(value, layers)
        for name, value in values.items():  # lists of layer indices (llama4's moe_layers): keep those that exist
            if isinstance(value, list) and value and _is_index_list(value) and name not in kwargs:
                kwargs[name] = [i for i in value if i < layers] or [layers - 1]
        for name, value in list(kwargs.items()):
            if isinstance(value, list) and len(value) < layers and name not in ("mlp_only_layers",):
                kwargs[name] = value + [value[-1]] * (layers - len(value))
        for name in _LAYER_COUNTS:
            if isinstance(values.get(name), int):
                kwargs[name] = layers
                break
    if isinstance(values.get("moe_layer_end_index"), int):
        kwargs["moe_layer_end_index"] = layers - 1

    # token ids must lie in the vocabulary; multimodal placeholders go to its top
    top = _SPECIAL_TOP
    for name, value in values.items():
        if not (name.endswith("_token_id") or name.endswith("_token_index") or name.endswith("_token_ids")):
            continue
        if name in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "eod_token_id",
                    "decoder_start_token_id", "cls_token_id", "unk_token_id", "mask_token_id"):
            small = _small_token_id(value)
            if small is None and value is not None:
                small = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(name, 2)
            kwargs[name] = small
        elif isinstance(value, int) and not isinstance(value, bool):
            kwargs[name] = top
            top -= 1

    # widths tied to a hidden size (adapters, projectors of composite models) keep the tie
    hidden_sizes = {values.get("hidden_size"), values.get("d_model"), *(parent_hidden or ())} - {None}
    for name, value in values.items():
        if (name not in kwargs and isinstance(value, int) and not isinstance(value, bool)
                and value in hidden_sizes and re.search(r"dim|size|hidden", name)
                and not name.startswith(("max_", "vocab"))):
            kwargs[name] = HIDDEN
    return kwargs


def _shrink(config: PretrainedConfig, *, top_level: bool, extra: dict[str, Any] | None = None,
            parent_hidden: tuple = ()) -> PretrainedConfig:
    """`config` (a default config) rebuilt at debug size; `extra` kwargs win, dicts in it go to sub-configs."""
    extra = {**_FAMILY_OVERRIDES.get(getattr(config, "model_type", ""), {}), **(extra or {})}
    layers = next((extra[name] for name in _LAYER_COUNTS if isinstance(extra.get(name), int)), None)
    kwargs = _shrink_kwargs(config, top_level=top_level, parent_hidden=parent_hidden, layers=layers)
    # composite configs: shrink every sub-config (text towers like the top level, others to one layer)
    values = config.to_dict()
    own_hidden = tuple(v for v in (values.get("hidden_size"), values.get("d_model")) if isinstance(v, int))
    for key in getattr(type(config), "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            is_text = key in ("text_config", "decoder_config", "language_config") or key.startswith(("attn_", "ffn_"))
            sub_extra = extra.pop(key, None)
            if isinstance(sub_extra, PretrainedConfig):
                kwargs[key] = sub_extra
                continue
            text_hidden = (getattr(config, "text_config").hidden_size,) if hasattr(config, "text_config") else ()
            kwargs[key] = _shrink(sub, top_level=is_text, extra=sub_extra,
                                  parent_hidden=own_hidden + parent_hidden + text_hidden)
    kwargs.update(extra)
    return type(config)(**kwargs)


def debug_config_like(config: PretrainedConfig) -> PretrainedConfig:
    """`config`'s architecture (class, layer types, attention and MoE settings) at debug size: for probing
    how a user's model behaves (e.g. whether packed examples stay apart) without loading its weights."""
    return _shrink(config, top_level=True)


def generic_debug_config(family: str, **overrides) -> PretrainedConfig:
    """A debug-size config of any transformers family, shrunk from its default config."""
    return _shrink(_default_config(family), top_level=True, extra=overrides)


# --------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------

_EXPERT_SOURCE = re.compile(r"[Ee]xperts|MoE|Moe\b|SparseMoe|moe_")
_CAUSAL_LM_CLASS = re.compile(r"^class (\w+ForCausalLM)\(", re.M)


def _models_root() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


def _module_name(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)


def _modeling_sources(model_type: str) -> list[Path]:
    return sorted((_models_root() / _module_name(model_type).replace(".", "/")).glob("modeling_*.py"))


def _mentions_experts(model_type: str) -> bool:
    """Cheap pre-filter: does the family's modeling source mention experts at all? (read as text, no import)"""
    return any(_EXPERT_SOURCE.search(path.read_text(encoding="utf-8")) for path in _modeling_sources(model_type))


@functools.cache
def unmapped_causal_lms() -> dict[str, type]:
    """MoE causal-LM classes that transformers defines but leaves out of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.

    model_type -> class (e.g. mistral4 -> Mistral4ForCausalLM in transformers 5.23). Modeling sources are
    scanned as text; only files that mention experts are imported.
    """
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mapped = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
              for name in ([names] if isinstance(names, str) else names)}
    found: dict[str, type] = {}
    for path in sorted(_models_root().glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        names = [n for n in _CAUSAL_LM_CLASS.findall(text) if n not in mapped]
        if not names or not _EXPERT_SOURCE.search(text):
            continue
        try:
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        except ImportError as err:  # an optional dependency is missing
            log.debug("cannot import %s: %s", path, err)
            continue
        for name in names:
            cls = getattr(module, name, None)
            model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
            if model_type in CONFIG_MAPPING and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                found[model_type] = cls
    return found


def _causal_lm_families() -> list[str]:
    """Every causal-LM model_type: the auto mapping plus the unmapped MoE causal LMs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted({*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *unmapped_causal_lms()})


def _looks_like_experts(module: torch.nn.Module) -> bool:
    """A module holding a family's routed experts (3-D stacked weights or a list of expert MLPs)."""
    name = type(module).__name__
    if name.lower().endswith("experts"):
        return True
    if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        return False
    direct = [p for _, p in module.named_parameters(recurse=False)]
    return any(p.dim() == 3 for p in direct) and bool(re.search(r"expert|moe", name, re.I))


_ATTENTION_PATH = re.compile(r"(^|\.)[^.]*(attn|attention)[^.]*(\.|$)")
_MOE_BLOCK_CLASS = re.compile(r"(MoE|Moe)(Block|Layer)?$")


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every routed-experts module of the MLPs, outermost only.

    Experts inside attention (JetMoE's mixture of attention heads) are left out.
    """
    found: list[tuple[str, torch.nn.Module]] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix, _ in found) or _ATTENTION_PATH.search(path):
            continue
        if "shared" in path.rsplit(".", 1)[-1].lower():  # always-on shared experts are dense MLPs
            continue
        if _looks_like_experts(module) or (isinstance(module, torch.nn.ModuleList) and path.endswith("experts")):
            found.append((path, module))
    return found


@dataclasses.dataclass
class DiscoveredMoe:
    """A module discovery counts as MoE: a wider net than `modeling.find_moe_blocks`, which decides
    what vela-ray trains, so that families it refuses are still found and tested."""

    path: str
    module: torch.nn.Module
    experts: list[tuple[str, torch.nn.Module]]  # (path, module); empty for experts without an experts module


def discovered_moe_modules(model: torch.nn.Module) -> list[DiscoveredMoe]:
    """Every MoE block: the parent of each experts module, plus MoE-block classes without one (Doge)."""
    modules = dict(model.named_modules())
    blocks: dict[str, DiscoveredMoe] = {}
    for path, experts in _experts_modules(model):
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        blocks.setdefault(parent, DiscoveredMoe(parent, modules[parent], [])).experts.append((path, experts))
    for path, module in modules.items():
        if (path not in blocks and _MOE_BLOCK_CLASS.search(type(module).__name__)
                and not _ATTENTION_PATH.search(path)
                and not any(path.startswith(p + ".") or p.startswith(path + ".") for p in blocks)):
            blocks[path] = DiscoveredMoe(path, module, [])
    return sorted(blocks.values(), key=lambda b: list(modules).index(b.path))


def build_model(config: PretrainedConfig, *, meta: bool = False) -> torch.nn.Module:
    """The fp32 causal LM of `config` (through the auto class, or the unmapped class), on the meta device if asked."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    unmapped = None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        unmapped = unmapped_causal_lms().get(config.model_type)
    with torch.device("meta") if meta else contextlib.nullcontext():
        if unmapped is not None:
            return unmapped._from_config(config, dtype=torch.float32)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _has_moe(family: str) -> bool:
    try:
        config = debug_config(family)
        try:
            model = build_model(config, meta=True)
        except Exception:  # some __init__s compute on tensors; the debug size is cheap on CPU too
            model = build_model(config)
    except Exception as err:  # noqa: BLE001 - a family that cannot be built is not discovered
        _DISCOVERY_FAILURES[family] = f"{type(err).__name__}: {err}"
        log.debug("family %s could not be built: %s", family, err)
        return False
    return bool(discovered_moe_modules(model))


_DISCOVERY_FAILURES: dict[str, str] = {}


@functools.cache
def moe_families() -> list[str]:
    """Every causal-LM family of the installed transformers whose debug model has MoE experts."""
    found = []
    for family in _causal_lm_families():
        if family in FAMILIES or (_mentions_experts(family) and _has_moe(family)):
            found.append(family)
    return found


def family_support() -> dict[str, str | None]:
    """{family: None if vela-ray trains it, else the one-line reason it refuses it}, for every discovered
    family, decided by `modeling.find_moe_blocks` on its debug model (meta device): what `vela families`
    prints. tests/unit/test_every_family.py shows each supported one equal to peft."""
    from vela_ray.model.modeling import find_moe_blocks

    support: dict[str, str | None] = {}
    for family in moe_families():
        try:
            find_moe_blocks(build_model(debug_config(family), meta=True))
            support[family] = None
        except ValueError as err:
            support[family] = first_line(err)
    return support


def discovery_failures() -> dict[str, str]:
    """Families that mention experts but whose debug model could not be built (after `moe_families()`)."""
    moe_families()
    return dict(_DISCOVERY_FAILURES)


def __getattr__(name: str):
    if name == "ALL_FAMILIES":  # lazy: discovery builds every family once on the meta device
        return moe_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def debug_config(family: str, **overrides) -> PretrainedConfig:
    if family in FAMILIES:
        return FAMILIES[family](**overrides)
    from transformers import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)} "
                         "or a transformers causal-LM model_type (see moe_families())")
    return generic_debug_config(family, **overrides)


def _init_expert_params(model: torch.nn.Module) -> None:
    """Random init leaves 3-D expert weights tiny or empty (and biases zero); give them real scale."""
    expert_params: set[int] = set()
    for _, module in _experts_modules(model):
        expert_params.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) or id(param) in expert_params:
            is_bias = "bias" in name.rsplit(".", 1)[-1]
            if is_bias or param.dim() < 2:
                if is_bias and not torch.count_nonzero(param):
                    param.normal_(0.0, 0.02)
                elif not torch.isfinite(param).all():
                    param.zero_()
            else:
                param.normal_(0.0, 0.1)


def debug_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A seeded random fp32 causal-LM of `family` at debug size."""
    return seeded_model(debug_config(family, **overrides), seed)


def seeded_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A seeded random fp32 causal-LM of `config` (a debug-size one: `debug_config`, `debug_config_like`),
    its experts at real scale; the same weights for the same (config, seed)."""
    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        _init_expert_params(model)
    return model.eval()
