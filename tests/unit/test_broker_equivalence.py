"""vela-ray's broker + shards against plain transformers + peft, per MoE family, in one process."""

from __future__ import annotations

import tempfile

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from tests.equivalence import build_pair, micro_batches, reference_adapter_state, run_both
from vela_ray.model.adapters import fuse_expert_factors
from vela_ray.model.families import FAMILIES, debug_model
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.training.step import export

FAMILY_NAMES = sorted(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_losses_and_exported_adapter_match_peft_over_five_steps(family):
    pair = build_pair(family)
    ref_losses, vela_losses = run_both(pair, steps=5)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert ref_losses[0] != ref_losses[-1]  # the adapters really trained

    out = tempfile.mkdtemp()
    export(pair.master, pair.workers, out)
    exported = load_file(f"{out}/adapter_model.safetensors")
    reference = reference_adapter_state(pair)
    assert exported.keys() == reference.keys()
    for key, value in reference.items():
        # Adam turns float noise in near-zero gradients into lr-sized steps, so compare
        # against each tensor's scale; a mis-mapped expert differs by O(scale).
        scale = float(value.abs().max())
        assert float((exported[key] - value).abs().max()) <= 2e-3 * scale, key


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_every_lora_gradient_matches_peft(family):
    pair = build_pair(family)
    batch = micro_batches(0)[0]
    pair.reference(**batch).loss.backward()
    pair.master.peft_model(**batch).loss.backward()

    ref_grads = {n: p.grad for n, p in pair.reference.named_parameters() if p.requires_grad}
    for name, param in pair.master.peft_model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    # experts: fuse the shards' per-expert grads the way peft stores them, then compare
    shard_grads = {}
    for shard in pair.master.dispatcher.transport.shards:  # build_pair's InProcessTransport
        for key in shard.keys:
            shard_grads[key] = {n: p.grad for n, p in shard.expert(*key).named_parameters()}
    checked = 0
    for name, grad in ref_grads.items():
        if ".experts." not in name or ".lora_A." not in name:
            continue
        slot = "down" if ".experts.lora_A" in name else "gate_up"
        layer = _moe_layer_of(pair, name)
        num_experts = 1 + max(e for (l, e) in shard_grads if l == layer)
        fused_A, fused_B = fuse_expert_factors(
            [(shard_grads[(layer, e)][f"lora_A_{slot}"], shard_grads[(layer, e)][f"lora_B_{slot}"])
             for e in range(num_experts)])
        torch.testing.assert_close(fused_A, grad, rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(fused_B, ref_grads[name.replace("lora_A", "lora_B")], rtol=1e-4, atol=1e-7)
        checked += 1
    assert checked == 2 * len(find_moe_blocks(pair.master.peft_model))


def _moe_layer_of(pair, param_name: str) -> int:
    for block in find_moe_blocks(pair.master.peft_model):
        if f"{block.path}.experts" in param_name:
            return block.index
    raise AssertionError(param_name)


def test_bf16_losses_stay_close_to_peft():
    pair = build_pair("mixtral", dtype=torch.bfloat16)
    ref_losses, vela_losses = run_both(pair, steps=3)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def test_exported_adapter_loads_in_peft_and_reproduces_vela_outputs():
    pair = build_pair("qwen2_moe")
    run_both(pair, steps=2)
    out = tempfile.mkdtemp()
    export(pair.master, pair.workers, out)
    loaded = PeftModel.from_pretrained(debug_model("qwen2_moe", seed=0), out).eval()
    batch = micro_batches(7)[0]
    pair.master.peft_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, pair.master.peft_model(**batch).logits,
                                   rtol=1e-5, atol=1e-5)


def test_adapter_reimports_into_a_different_placement_with_identical_outputs():
    first = build_pair("olmoe", num_workers=3)
    run_both(first, steps=2)
    out = tempfile.mkdtemp()
    export(first.master, first.workers, out)
    second = build_pair("olmoe", num_workers=2)  # other worker count, other placement
    from vela_ray.training.step import import_adapter
    import_adapter(second.master, second.workers, out)
    batch = micro_batches(3)[0]
    first.master.peft_model.eval(), second.master.peft_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(second.master.peft_model(**batch).logits,
                                   first.master.peft_model(**batch).logits, rtol=1e-6, atol=1e-6)


def test_broker_counts_exactly_the_rows_it_dispatched():
    pair = build_pair("mixtral")
    model = pair.master.peft_model
    table = pair.master.dispatcher.expert_to_worker
    routed = {}  # layer -> top_k_index seen by the broker

    for block in find_moe_blocks(model):
        block.block.experts.register_forward_pre_hook(
            lambda mod, args, layer=block.index: routed.__setitem__(layer, args[1].clone()))
    counter = pair.master.dispatcher.counter
    counter.reset()
    batch = micro_batches(0)[0]
    model(**batch).loss.backward()

    hidden = model.config.hidden_size
    for layer, top_k_index in routed.items():
        rows_per_worker = torch.bincount(table[layer][top_k_index.reshape(-1)], minlength=3)
        for worker in range(3):
            rows = int(rows_per_worker[worker])
            # dispatch, gather, grad_dispatch, grad_gather: same rows each way, fp32
            assert counter.rows[layer, worker].tolist() == [rows] * 4
            assert counter.bytes[layer, worker].tolist() == [rows * hidden * 4] * 4
    assert counter.rows.sum() == 4 * sum(t.numel() for t in routed.values())
