"""Which linear layers vela-ray adapts, where peft's transformers-v5 name conversion gets in the way.

peft 0.21 rewrites LoRA targets named like a v4 MoE's expert matrices (`gate_proj`, `up_proj`,
`down_proj`) into the fused v5 expert parameters for some families, and refuses a `gate_proj`
without its `up_proj`. Beam (transformers 5.24) names a linear of its attention `gate_proj`; with
every layer MoE there is no dense MLP, so no `up_proj`, and peft refuses the attention gate.
`linear_targets` leaves such layers frozen (logged) and the rest trains equal to peft.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING

from tests.equivalence import build_pair, micro_batches, reference_adapter_state, run_both
from vela_ray.model.adapters import ADAPTER_FILE, linear_targets
from vela_ray.model.families import debug_model
from vela_ray.training.adapter_io import export

ALL_MOE = {"mlp_layer_types": ["sparse"] * 3}  # Beam's debug model has 3 layers; the default's first is dense

pytestmark = pytest.mark.skipif("beam" not in CONFIG_MAPPING, reason="Beam arrived in transformers 5.24")


@pytest.fixture(autouse=True)
def _one_thread():
    """Debug models are tiny: one intra-op thread avoids OpenMP spinning on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_peft_refuses_an_attention_gate_proj_without_an_up_proj():
    """The premise: when a peft release accepts this, adapt Beam's attention gate (drop the refusal branch of
    `adapters._leaf_names_peft_rewrites`) and this test fails to say so."""
    model = debug_model("beam", **ALL_MOE)
    assert not any(name.endswith("up_proj") for name, _ in model.named_modules())
    with pytest.raises(ValueError, match="Cannot convert PEFT target.* gate_proj without also targeting up_proj"):
        get_peft_model(model, LoraConfig(r=4, target_modules=r"^model\.layers\.\d+\.self_attn\.gate_proj$"))


def test_an_all_moe_beam_leaves_its_attention_gate_frozen_and_says_so(caplog):
    model = debug_model("beam", **ALL_MOE)
    with caplog.at_level(logging.WARNING, logger="vela_ray.model.adapters"):
        targets = re.compile(linear_targets(model))
    assert not targets.match("model.layers.0.self_attn.gate_proj")
    assert all(targets.match(f"model.layers.{layer}.self_attn.{leaf}")
               for layer in range(3) for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert "not adapting ['gate_proj'] layers" in caplog.text


def test_an_all_moe_beam_trains_equal_to_peft_and_its_adapter_loads_in_plain_peft(tmp_path):
    pair = build_pair("beam", **ALL_MOE)
    ref_losses, vela_losses = run_both(pair, steps=2)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert ref_losses[0] != ref_losses[1]

    export(pair.master, pair.workers, tmp_path)
    exported = load_file(tmp_path / ADAPTER_FILE)
    assert exported.keys() == reference_adapter_state(pair).keys()
    assert not any("gate_proj" in key for key in exported)
    reloaded = PeftModel.from_pretrained(debug_model("beam", **ALL_MOE), tmp_path)
    assert get_peft_model_state_dict(reloaded).keys() == exported.keys()
    batch = micro_batches(99)[0]  # held out: no training step saw it
    with torch.no_grad():
        want = pair.master.peft_model.eval()(**batch).loss
        got = reloaded.eval()(**batch).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
