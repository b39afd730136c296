"""Debug-size families: the curated five and every MoE family discovered in the installed transformers."""

from __future__ import annotations

import math

import pytest
import torch

from vela_ray.model import families as fam
from vela_ray.model.families import FAMILIES, debug_config, debug_model, discovered_moe_modules, moe_families

# MoE families that any recent transformers 5.x ships; the test only asks for those present here.
KNOWN = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "gpt_oss", "llama4_text",
         "llama4", "dbrx", "granitemoe", "granitemoeshared", "jamba", "phimoe", "jetmoe", "minimax", "qwen3_next",
         "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "flex_olmo", "lfm2_moe", "longcat_flash",
         "qwen3_5_moe_text", "mistral4")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Debug models are tiny: one intra-op thread avoids OpenMP spinning on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_curated_families_stay_the_five_pinned_ones():
    assert sorted(FAMILIES) == ["deepseek_v3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


def test_discovery_finds_the_known_families():
    found = set(moe_families())
    installed = set(fam._causal_lm_families())
    assert set(FAMILIES) <= found
    assert {f for f in KNOWN if f in installed} <= found
    assert fam.discovery_failures() == {}
    assert fam.ALL_FAMILIES == moe_families()


def test_discovery_includes_causal_lms_missing_from_the_auto_mapping():
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    unmapped = fam.unmapped_causal_lms()
    assert not set(unmapped) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert set(unmapped) <= set(moe_families())
    if hasattr(transformers, "Mistral4ForCausalLM") and "mistral4" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        assert unmapped["mistral4"] is transformers.Mistral4ForCausalLM


def test_dense_families_are_not_discovered():
    assert not {"llama", "qwen2", "mistral", "gpt2", "bamba"} & set(moe_families())


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown family"):
        debug_config("no_such_family")


def test_generic_overrides_reach_the_config():
    config = debug_config("phimoe", num_hidden_layers=3)
    assert config.num_hidden_layers == 3


@pytest.mark.parametrize("family", moe_families())
def test_debug_model_is_small_and_trains(family):
    config = debug_config(family)
    text = config.get_text_config()
    assert text.vocab_size == 128
    # other vocabulary sizes too: inkling2's unpadded_vocab_size (200058 by default) sizes its lm_head, which a
    # checkpoint stores padded to vocab_size (saving pads by vocab_size - unpadded_vocab_size rows)
    assert all(v == 128 for k, v in text.to_dict().items() if k.endswith("vocab_size") and isinstance(v, int))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(text, name, None)
        assert all(i < 128 for i in ([] if ids is None else ids if isinstance(ids, list) else [ids])), name

    model = debug_model(family).train()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    blocks = discovered_moe_modules(model)
    assert len(blocks) >= 2, [b.path for b in blocks]

    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    expert_params = [p for b in blocks for _, e in b.experts for p in e.parameters()]
    for p in expert_params:  # experts have real scale and take part in training
        assert p.abs().sum() > 0
        assert p.grad is not None and torch.isfinite(p.grad).all()
    assert any(p.grad.abs().sum() > 0 for p in expert_params) or not expert_params
