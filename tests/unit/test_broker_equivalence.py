"""vela-ray's broker + shards against plain transformers + peft, per MoE family, in one process."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from tests.equivalence import build_pair, micro_batches, reference_adapter_state, run_both
from vela_ray.model.adapters import ADAPTER_FILE, fuse_expert_factors
from vela_ray.model.families import FAMILIES, debug_model
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.training.adapter_io import export
from vela_ray.training.step import master_compute_seconds

FAMILY_NAMES = sorted(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_losses_and_exported_adapter_match_peft_over_five_steps(family, tmp_path):
    pair = build_pair(family)
    ref_losses, vela_losses = run_both(pair, steps=5)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert ref_losses[0] != ref_losses[-1]  # the adapters really trained

    # The export, reloaded by plain peft, computes what vela-ray's model computes (test_every_family.py's
    # criterion). Not compared element by element with the reference's adapter: AdamW's first steps move each
    # element by ~lr * sign(grad), so one whose gradient is rounding noise around 0 lands up to 2 lr away (a
    # deepseek_v3 expert lora_B element once by 4.2e-4 where 2e-3 of its tensor's scale allowed 4.1e-4).
    export(pair.master, pair.workers, tmp_path)
    exported = load_file(tmp_path / ADAPTER_FILE)
    assert exported.keys() == reference_adapter_state(pair).keys()
    want = _held_out_loss(pair.master.peft_model)
    torch.testing.assert_close(_held_out_loss(_reloaded(family, tmp_path)), want, rtol=1e-5, atol=0)

    # ... and the criterion sees a mis-mapped expert: experts 0 and 1 of every layer trade their factors
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(tmp_path / "adapter_config.json", swapped)
    num_experts = find_moe_blocks(pair.master.peft_model)[0].layout.num_experts
    save_file({key: _swap_experts_0_and_1(key, value, num_experts) for key, value in exported.items()},
              str(swapped / ADAPTER_FILE))
    mis_mapped = _held_out_loss(_reloaded(family, swapped))
    assert abs(mis_mapped - want) > 1e-5 * abs(want), (mis_mapped, want)


def _held_out_loss(model) -> torch.Tensor:
    """The loss on a batch that no training step saw."""
    with torch.no_grad():
        return model.eval()(**micro_batches(99)[0]).loss


def _reloaded(family: str, adapter_dir) -> PeftModel:
    """The adapter in `adapter_dir` loaded by plain peft, which must read back every tensor of the file unchanged."""
    reloaded = PeftModel.from_pretrained(debug_model(family), adapter_dir)
    loaded, written = get_peft_model_state_dict(reloaded), load_file(adapter_dir / ADAPTER_FILE)
    assert loaded.keys() == written.keys()
    for key, value in written.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    return reloaded


def _swap_experts_0_and_1(key: str, value: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`value` with experts 0 and 1 trading places if it is an expert LoRA factor, in peft's fused layout
    (lora_A [r*E, in]: expert e owns rows e*r:(e+1)*r; lora_B [out, r*E]: columns e, e+E, ...)."""
    if ".experts." not in key:
        return value
    order = [1, 0, *range(2, num_experts)]
    if ".lora_A." in key:
        return value.reshape(num_experts, -1, value.shape[-1])[order].reshape(value.shape)
    return value.reshape(value.shape[0], -1, num_experts)[:, :, order].reshape(value.shape)


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
    from vela_ray.training.adapter_io import import_adapter
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
    dispatcher = pair.master.dispatcher
    dispatcher.reset_traffic()
    batch = micro_batches(0)[0]
    model(**batch).loss.backward()
    counted = dispatcher.traffic()
    rows_counted, bytes_counted = torch.tensor(counted.rows), torch.tensor(counted.bytes)

    hidden = model.config.hidden_size
    for layer, top_k_index in routed.items():
        rows_per_worker = torch.bincount(table[layer][top_k_index.reshape(-1)], minlength=3)
        for worker in range(3):
            rows = int(rows_per_worker[worker])
            # dispatch, gather, grad_dispatch, grad_gather: same rows each way, fp32
            assert rows_counted[layer, worker].tolist() == [rows] * 4
            assert bytes_counted[layer, worker].tolist() == [rows * hidden * 4] * 4
    assert rows_counted.sum() == 4 * sum(t.numel() for t in routed.values())


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_the_master_compute_probe_runs_every_broker_call_and_leaves_no_trace(family):
    """`master_compute_seconds` times the master's own work around the experts (`answering_at_once`): each call
    plans, packs and combines its rows as in a step, the experts answer zeros, and the step after it sees no
    row, byte, wait, key or gradient of it."""
    pair = build_pair(family)
    master, model = pair.master, pair.master.peft_model
    dispatcher = master.dispatcher
    batch = micro_batches(0)[0]
    calls = []
    for block in find_moe_blocks(model):
        block.block.experts.register_forward_pre_hook(lambda mod, args: calls.append(args[1].shape))
    with dispatcher.probing(torch.zeros_like):
        stood_in = model(**batch).loss
    planned = []
    real_plan = dispatcher.plan
    dispatcher.plan = lambda layer, top_k_index: planned.append(layer) or real_plan(layer, top_k_index)
    with dispatcher.answering_at_once():
        assert model(**batch).loss == stood_in  # the experts' part is zeros either way
    del dispatcher.plan
    assert planned == list(range(len(find_moe_blocks(model))))  # every call planned its rows

    sent = []
    real_transport = dispatcher.transport
    real_transport.forward = lambda requests, real=real_transport.forward: sent.append(requests) or real(requests)
    dispatcher.reset_traffic()
    next_key = dispatcher.new_key(0)
    seconds = master_compute_seconds(master, batch)
    assert seconds > 0
    assert dispatcher.new_key(0)[0] == next_key[0] + 1  # the probe took no key from the step's count
    assert not torch.tensor(dispatcher.traffic().rows).any()
    assert dispatcher.round_trip_s == {"forward": 0.0, "backward": 0.0}
    assert all(p.grad is None for p in model.parameters())
    assert not sent  # no worker got a row
    model(**batch).loss.backward()
    assert sent  # the step's calls reach the workers again
