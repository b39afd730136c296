"""Backbone-only loading and per-expert reads from locally saved checkpoints."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from vela_ray.model.broker import ExpertDispatcher
from vela_ray.model.experts import ExpertShard, LoraSpec
from tests.fixtures import KNOWN_FAILURES, REFUSED, side_by_side
from vela_ray.model.families import debug_model, moe_families
from vela_ray.model.loading import checkpoint_prototypes, load_backbone, moe_layout, read_experts
from vela_ray.model.modeling import attach_brokers, expert_weights, find_moe_blocks
from vela_ray.model.transport import InProcessTransport


def _split_model_from_checkpoint(model_dir, num_workers=3):
    num_layers, num_experts = moe_layout(model_dir)
    table = torch.tensor([[(l * 5 + e) % num_workers for e in range(num_experts)] for l in range(num_layers)])
    shards = []
    for worker in range(num_workers):
        keys = [(l, e) for l in range(num_layers) for e in range(num_experts) if table[l, e] == worker]
        shards.append(ExpertShard.from_weights(read_experts(model_dir, keys), LoraSpec(),
                                                   checkpoint_prototypes(model_dir)))
    backbone = load_backbone(model_dir)
    attach_brokers(backbone, ExpertDispatcher(table, InProcessTransport(shards)))
    return backbone


def _loadable_families() -> list:
    """Every discovered MoE family vela-ray trains; the known gaps as strict xfails."""
    return [pytest.param(f, id=f, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[f])]
                         if f in KNOWN_FAILURES else []) for f in moe_families() if f not in REFUSED]


@pytest.mark.parametrize("family", _loadable_families())
def test_backbone_plus_expert_reads_reproduce_the_saved_model(family, tmp_path):
    """The runtime's path: save_pretrained, then the master's backbone and the workers' expert reads,
    through transformers' own key conversion for the family (renamed routers, hub per-expert layouts,
    Granite's fused input_linear, inkling2's interleaved w13 and padded lm_head, lara_mini's fused in_proj)."""
    torch.set_num_threads(1)
    model = debug_model(family, seed=3)
    model.save_pretrained(tmp_path)
    split = _split_model_from_checkpoint(tmp_path)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_backbone_never_allocates_experts(tmp_path):
    debug_model("mixtral").save_pretrained(tmp_path)
    backbone = load_backbone(tmp_path)
    for block in find_moe_blocks(backbone):
        assert block.block.experts.gate_up_proj.is_meta and block.block.experts.down_proj.is_meta
    assert not any(p.is_meta for n, p in backbone.named_parameters() if ".experts." not in n)


def test_read_experts_reads_exactly_the_requested_experts_from_a_sharded_checkpoint(tmp_path):
    model = debug_model("qwen3_moe", seed=1)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    keys = [(1, 4), (0, 0), (1, 5)]
    got = read_experts(tmp_path, keys)
    want = expert_weights(find_moe_blocks(model), keys)
    assert list(got) == keys
    for key in keys:
        assert got[key].keys() == want[key].keys() == {"gate_up_proj", "down_proj"}
        for name in want[key]:
            torch.testing.assert_close(got[key][name], want[key][name], rtol=0, atol=0)


def test_read_experts_slices_fused_expert_tensors(tmp_path):
    model = debug_model("olmoe", seed=2)
    model.save_pretrained(tmp_path)
    # rewrite the checkpoint with fused [E, 2I, D] / [E, D, I] expert tensors
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = read_experts(tmp_path, [(1, 3)])
    want = expert_weights(find_moe_blocks(model), [(1, 3)])
    assert got[(1, 3)].keys() == want[(1, 3)].keys()
    for name in want[(1, 3)]:
        torch.testing.assert_close(got[(1, 3)][name], want[(1, 3)][name], rtol=0, atol=0)


def _convert_checkpoints_of(monkeypatch, model, conversions: list) -> None:
    """transformers converts checkpoints of `model`'s class with `conversions` (for this test only), as it
    does a family's hub layout: vela-ray reads them through transformers' conversion mapping."""
    from transformers import conversion_mapping

    conversion_mapping.get_checkpoint_conversion_mapping("mixtral")  # builds the cache
    monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, type(model).__name__, conversions)


def _save_with_tensors(model, path, state: dict[str, torch.Tensor]) -> None:
    """`model`'s config and `state` (in place of its weights) as a checkpoint."""
    model.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_fused_backbone_projection_is_split_by_transformers_own_conversion(tmp_path, monkeypatch):
    """One checkpoint tensor, several model tensors (lara_mini's in_proj): transformers files it under the first
    target only; the backbone gets all three, sized by the model (k and v are narrower than q)."""
    from transformers.core_model_loading import Split, WeightConverter

    model = debug_model("mixtral", seed=4)
    state = dict(model.state_dict())
    for layer in range(model.config.num_hidden_layers):
        attn = f"model.layers.{layer}.self_attn"
        qkv = [state.pop(f"{attn}.{proj}.weight") for proj in ("q_proj", "k_proj", "v_proj")]
        state[f"{attn}.qkv_proj.weight"] = torch.cat(qkv)
    _save_with_tensors(model, tmp_path, state)
    _convert_checkpoints_of(monkeypatch, model, [WeightConverter(
        "self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [Split(dim=0)])])
    split = _split_model_from_checkpoint(tmp_path)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _olmoe_storing_gate_up_transposed(tmp_path, monkeypatch, dims: tuple[int, int]):
    """An olmoe model and its checkpoint, whose experts' gate_up_proj [E, 2I, D] is stored transposed at `dims`
    (as gate_up_t) and converted back by transformers' Transpose(*dims)."""
    from transformers.core_model_loading import Transpose, WeightConverter

    model = debug_model("olmoe", seed=5)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            name, tensor = name.replace("gate_up_proj", "gate_up_t"), tensor.transpose(*dims)
        state[name] = tensor
    _save_with_tensors(model, tmp_path, state)
    _convert_checkpoints_of(monkeypatch, model, [
        WeightConverter("mlp.experts.gate_up_t", "mlp.experts.gate_up_proj", [Transpose(*dims)])])
    return model


def test_a_conversion_within_each_expert_is_applied_one_expert_at_a_time(tmp_path, monkeypatch):
    model = _olmoe_storing_gate_up_transposed(tmp_path, monkeypatch, (1, 2))  # stored [E, D, 2I]
    got = read_experts(tmp_path, [(1, 3), (0, 5)])
    want = expert_weights(find_moe_blocks(model), [(1, 3), (0, 5)])
    for key in want:
        torch.testing.assert_close(got[key]["gate_up_proj"], want[key]["gate_up_proj"], rtol=0, atol=0)


def test_a_conversion_across_experts_is_refused_by_name(tmp_path, monkeypatch):
    """Stored [2I, E, D]: transformers transposes the whole tensor; one expert's rows cannot be read alone."""
    _olmoe_storing_gate_up_transposed(tmp_path, monkeypatch, (0, 1))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj is stored as .*gate_up_t.* "
                                         r"\['Transpose'\], which vela-ray does not apply one expert at a time"):
        read_experts(tmp_path, [(0, 1)])


def test_out_of_range_layer_is_refused(tmp_path):
    debug_model("mixtral").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"MoE layer 7 out of range.*2 MoE layers"):
        read_experts(tmp_path, [(7, 0)])


def test_missing_checkpoint_names_the_directory(tmp_path):
    with pytest.raises(ValueError, match=r"no model.safetensors"):
        read_experts(tmp_path, [(0, 0)])


_RSS_GROWTH = """
import json, sys, psutil, torch
from transformers import AutoModelForCausalLM
import transformers.modeling_utils  # transformers' lazy imports (accelerate, kernels): not the load's memory
from vela_ray.model.loading import load_backbone
path, mode = sys.argv[1], sys.argv[2]
before = psutil.Process().memory_info().rss
model = load_backbone(path) if mode == "backbone" else AutoModelForCausalLM.from_pretrained(path)
print(json.dumps({"growth_mib": (psutil.Process().memory_info().rss - before) / 2**20}))
"""


@pytest.mark.slow
def test_backbone_load_holds_less_memory_than_a_full_load_by_at_least_the_expert_bytes(tmp_path):
    from transformers import AutoModelForCausalLM

    from vela_ray.model.families import mixtral_debug

    config = mixtral_debug(hidden_size=256, intermediate_size=1024, num_local_experts=16, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    expert_mib = 4 * 16 * 3 * 256 * 1024 * 4 / 2**20  # layers x experts x 3 matrices x D x I x fp32 = 192 MiB
    modes = ("backbone", "full")
    outs = side_by_side([[sys.executable, "-c", _RSS_GROWTH, str(tmp_path), mode] for mode in modes])
    growth = {mode: json.loads(out.strip().splitlines()[-1])["growth_mib"] for mode, out in zip(modes, outs)}
    print(f"RSS growth MiB: backbone {growth['backbone']:.0f}, full {growth['full']:.0f}, experts {expert_mib:.0f}")
    assert growth["full"] - growth["backbone"] >= 0.9 * expert_mib
    assert growth["backbone"] < 0.5 * expert_mib  # imports and the small backbone only
