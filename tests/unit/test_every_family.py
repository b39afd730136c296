"""Every MoE causal-LM family of the installed transformers: equal to peft, or refused with the reason.

`moe_families()` discovers the families, so a new transformers release brings its new ones
into this test by itself. For each: build the plain transformers + peft reference and
vela-ray over three in-process shards under a scattered placement, train 2 steps, and
require equal losses (rel 1e-5) and an equal exported adapter; or a ValueError naming the
class and what vela-ray cannot reproduce. A family that trains without error but differs
(a silent mismatch) fails here.

`tests.fixtures.REFUSED` lists the refusals; `KNOWN_FAILURES` the families that fail loudly on a
vela-ray gap, not by design: strict xfails, so a fix shows up as XPASS to update.
"""

from __future__ import annotations

import re

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

from tests.equivalence import build_pair, micro_batches, reference_adapter_state, run_both
from tests.fixtures import KNOWN_FAILURES, REFUSED
from vela_ray.model.families import debug_model, moe_families
from vela_ray.training.adapter_io import export

def _params() -> list:
    return [pytest.param(family, id=family, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[family])]
                         if family in KNOWN_FAILURES else []) for family in moe_families()]


@pytest.mark.slow
@pytest.mark.parametrize("family", _params())
def test_every_moe_family_trains_equal_to_peft_or_is_refused_with_the_reason(family, tmp_path):
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a 2-core machine
    if family in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[family]):
            build_pair(family)
        return
    pair = build_pair(family)
    _export_equals_the_reference(pair, tmp_path / "start", family)  # the mapping: bitwise, before training
    ref_losses, vela_losses = run_both(pair, steps=2)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    trained = _export_equals_the_reference(pair, tmp_path / "trained", family, exact=False)
    # The trained export computes what vela-ray's own model computes. (Not compared tensor by tensor with the
    # reference's: AdamW's first steps move each element by ~lr * sign(grad), so an element whose gradient is
    # a rounding error from 0 lands up to 2 lr away; the training losses above are the equality check.)
    batch = micro_batches(99)[0]
    with torch.no_grad():
        want = pair.master.peft_model.eval()(**batch).loss
        got = trained.eval()(**batch).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def _export_equals_the_reference(pair, out_dir, family: str, exact: bool = True) -> PeftModel:
    """Export vela-ray's adapter, reload it with plain peft (bitwise what was written), compare the tensors
    with the reference's (bitwise if `exact`, else only the keys); returns the reloaded model."""
    export(pair.master, pair.workers, out_dir)
    exported, want = load_file(out_dir / "adapter_model.safetensors"), reference_adapter_state(pair)
    assert exported.keys() == want.keys()
    if exact:
        for key, value in want.items():
            torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)
    reloaded = PeftModel.from_pretrained(debug_model(family), out_dir)
    loaded = get_peft_model_state_dict(reloaded)
    assert loaded.keys() == exported.keys()  # peft reads the export back, whatever its key conversions do
    for key, value in exported.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    return reloaded


def test_discovery_covers_the_families_the_issue_names():
    found = set(moe_families())
    assert {"gpt_oss", "llama4_text", "dbrx", "granitemoe", "jamba", "phimoe", "gemma4_text", "hy_v4",
            "deepseek_v4", "mixtral", "qwen3_moe", "olmoe", "deepseek_v3"} <= found


# Gates other than SwiGLU: clamped at swiglu_limit (DeepSeek-V4, HY-V4), clamped GLU with alpha and (up + 1)
# (MiniMax-M3, gpt-oss, whose gate/up are also interleaved and biased). Re-implementing a SwiGLU trains
# these silently wrong once the clamp binds; the limit below makes it bind.
CLAMPED = ["deepseek_v4", "hy_v4", "minimax_m3_vl_text", "gpt_oss"]
BINDING_LIMIT = 0.05


@pytest.mark.slow
@pytest.mark.parametrize("family", CLAMPED)
def test_a_clamped_gate_that_binds_trains_equal_to_peft(family):
    torch.set_num_threads(1)
    clamped = build_pair(family, swiglu_limit=BINDING_LIMIT)
    ref_losses, vela_losses = run_both(clamped, steps=2)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    unclamped_losses, _ = run_both(build_pair(family, swiglu_limit=1e6), steps=1)
    assert abs(unclamped_losses[0] - ref_losses[0]) > 1e-4  # the clamp changes the function: it binds


def test_vela_families_prints_the_refusals_this_test_expects(capsys):
    """`vela families` (the README's list) and this test come from one source: find_moe_blocks."""
    from vela_ray.cli import main

    assert main(["families"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    refused = {line.split()[0]: line for line in lines[:-1] if "  refused: " in line}
    assert refused.keys() == REFUSED.keys()
    for family, pattern in REFUSED.items():
        assert re.search(pattern, refused[family]), refused[family]
    trained = len(lines) - 1 - len(refused)
    assert lines[-1].startswith(f"{trained} of {len(lines) - 1} families trained: ") and trained >= 59


def test_dbrx_is_refused_because_peft_itself_cannot_adapt_its_experts():
    """The premise of Dbrx's refusal (see `modeling.experts_layout`): plain peft fails on DbrxExperts'
    flat weights, so no reference adapter exists. When a peft release fixes this, this test fails: then
    train Dbrx (peft's 2-D rule shares one LoRA A [r, D] by all experts of a matrix: keep it on the master,
    send x A^T with the rows, combine h B_e before A on the way back) and move it out of REFUSED."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(debug_model("dbrx"), LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2"]))
    ids = torch.randint(3, 100, (1, 6))
    with pytest.raises(AttributeError, match="'ParamWrapper' object has no attribute"):
        model(input_ids=ids)
