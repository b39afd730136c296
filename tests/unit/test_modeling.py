"""Model surgery: which blocks are found, what is refused, and edge cases of the broker."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vela_ray.model.broker import ExpertBroker, ExpertDispatcher
from vela_ray.model.experts import ExpertShard, LoraSpec
from vela_ray.model.families import FAMILIES, debug_model, mixtral_debug
from vela_ray.model.modeling import attach_brokers, expert_weights, experts_prototypes, find_moe_blocks
from vela_ray.model.transport import InProcessTransport


def _split(model, table):
    blocks = find_moe_blocks(model)
    weights = expert_weights(blocks)
    num_workers = int(table.max()) + 1
    shards = [ExpertShard.from_weights({k: w for k, w in weights.items() if table[k] == n}, LoraSpec(),
                                       experts_prototypes(model.config)) for n in range(num_workers)]
    dispatcher = ExpertDispatcher(table, InProcessTransport(shards))
    attach_brokers(model, dispatcher)
    return dispatcher


@pytest.mark.parametrize("family,moe_layers,first_decoder_layer", [
    ("mixtral", 2, 0), ("qwen3_moe", 2, 0), ("olmoe", 2, 0), ("qwen2_moe", 2, 0), ("deepseek_v3", 2, 1)])
def test_finds_every_moe_block_and_skips_dense_layers(family, moe_layers, first_decoder_layer):
    blocks = find_moe_blocks(debug_model(family))
    assert [b.index for b in blocks] == list(range(moe_layers))
    assert blocks[0].decoder_layer == first_decoder_layer  # DeepSeek's layer 0 is dense


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_brokers_replace_only_the_experts_and_keep_outputs(family):
    model = debug_model(family)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    kept = {n for n, _ in model.named_parameters() if ".experts." not in n}
    blocks = find_moe_blocks(model)
    _split(model, torch.randint(0, 3, (len(blocks), blocks[0].layout.num_experts),
                                generator=torch.Generator().manual_seed(1)))
    assert {n for n, _ in model.named_parameters()} == kept  # routers, shared experts, attention untouched
    assert all(isinstance(b.block.experts, ExpertBroker) for b in find_moe_blocks(model))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_a_model_without_moe_blocks_is_refused_by_class_name():
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no MoE block"):
        find_moe_blocks(dense)


def test_experts_called_another_way_are_refused_naming_the_class():
    """Neither routed rows nor rows grouped by expert: nothing vela-ray knows how to reproduce."""
    model = debug_model("mixtral")
    experts = find_moe_blocks(model)[0].block.experts

    class IndexOnlyExperts(type(experts)):
        def forward(self, hidden_states, top_k_index):
            return hidden_states

    experts.__class__ = IndexOnlyExperts
    with pytest.raises(ValueError, match=r"MixtralForCausalLM: IndexOnlyExperts\.forward\(hidden_states, top_k_index\) "
                                         r"is called neither as experts\(hidden_states, expert_index, expert_weights\)"):
        find_moe_blocks(model)


def test_grouped_experts_with_biases_are_refused():
    """A zero-padded row of a biased expert is not zero, so Llama-4-style groups could not be padded exactly."""
    model = debug_model("llama4_text")
    experts = find_moe_blocks(model)[0].block.experts
    experts.down_bias = torch.nn.Parameter(torch.zeros(experts.down_proj.shape[0], experts.down_proj.shape[2]))
    with pytest.raises(ValueError, match=r"Llama4TextExperts is called on rows grouped by expert and has biases"):
        find_moe_blocks(model)


def test_experts_with_a_parameter_that_is_not_per_expert_are_refused():
    model = debug_model("mixtral")
    experts = find_moe_blocks(model)[0].block.experts
    experts.scale = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"MixtralExperts has parameters that are not one row per expert \(\['scale'\]\)"):
        find_moe_blocks(model)


def test_attaching_brokers_reads_no_deprecated_transformers_api():
    """attach_brokers asks `is_activation_checkpointing`; the old alias warns in every master (issue 12)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _split(debug_model("mixtral"), torch.zeros(2, 6, dtype=torch.long))
    assert [str(w.message) for w in caught] == []


def test_placement_table_of_the_wrong_shape_is_refused():
    model = debug_model("mixtral")
    dispatcher = ExpertDispatcher(torch.zeros(2, 5, dtype=torch.long), InProcessTransport([ExpertShard({})]))
    with pytest.raises(ValueError, match=r"placement table is \(2, 5\) but MixtralForCausalLM has 2 MoE layers x 6"):
        attach_brokers(model, dispatcher)


def test_worker_without_rows_and_expert_without_tokens_are_fine():
    model = debug_model("mixtral")
    table = torch.zeros(2, 6, dtype=torch.long)
    table[:, 5] = 1  # worker 1 hosts only expert 5 of each layer
    dispatcher = _split(model, table)
    hidden = torch.randn(4, 32, requires_grad=True)
    top_k = torch.tensor([[0, 1], [1, 2], [0, 2], [1, 0]])  # expert 5 never picked: worker 1 gets no rows
    out = find_moe_blocks(model)[0].block.experts(hidden, top_k, torch.full((4, 2), 0.5))
    out.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    rows = torch.tensor(dispatcher.traffic().rows)
    assert rows[0, 1].sum() == 0 and rows[0, 0, 0] == 8


def test_an_empty_batch_gives_an_empty_output():
    model = debug_model("mixtral")
    _split(model, torch.zeros(2, 6, dtype=torch.long))
    broker = find_moe_blocks(model)[0].block.experts
    out = broker(torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 32)


def test_a_shard_handed_zero_rows_keeps_forward_and_backward_paired():
    shard = ExpertShard.from_weights(_two_layer_weights(layers=[0], experts=[0]), LoraSpec(2, 4), _TINY_EXPERTS)
    out = shard.forward_rows(0, torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), key="k")
    assert out.shape == (0, 4)
    assert shard.backward_rows("k", torch.zeros(0, 4)).shape == (0, 4)
    with pytest.raises(KeyError, match="backward_rows called twice"):
        shard.backward_rows("k", torch.zeros(0, 4))


# Mixtral's experts class at D = I = 4 with 4 experts, for every layer of the shards below
_TINY_EXPERTS = experts_prototypes(mixtral_debug(hidden_size=4, intermediate_size=4, num_local_experts=4))[0]


def _two_layer_weights(layers=range(2), experts=range(4)) -> dict:
    g = torch.Generator().manual_seed(0)
    return {(l, e): {"gate_up_proj": torch.randn(8, 4, generator=g), "down_proj": torch.randn(4, 4, generator=g)}
            for l in layers for e in experts}


def test_seeded_lora_init_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    ExpertShard.from_weights(_two_layer_weights(), LoraSpec(2, 4), _TINY_EXPERTS, seed=7)
    assert torch.equal(torch.get_rng_state(), before)


def test_an_experts_lora_init_depends_on_seed_layer_and_expert_not_on_its_shard():
    weights = _two_layer_weights()
    alone = ExpertShard.from_weights({(1, 2): weights[(1, 2)]}, LoraSpec(2, 4), _TINY_EXPERTS, seed=7)
    with_others = ExpertShard.from_weights(weights, LoraSpec(2, 4), _TINY_EXPERTS, seed=7)
    other_seed = ExpertShard.from_weights(weights, LoraSpec(2, 4), _TINY_EXPERTS, seed=8)
    want = alone.lora_state()[(1, 2)]
    for name, value in with_others.lora_state()[(1, 2)].items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0)
    a_of = {key: state["lora_A_gate_up"] for key, state in with_others.lora_state().items()}
    assert not torch.equal(a_of[(1, 2)], a_of[(1, 3)]) and not torch.equal(a_of[(1, 2)], a_of[(0, 2)])
    assert not torch.equal(other_seed.lora_state()[(1, 2)]["lora_A_gate_up"], a_of[(1, 2)])


def test_lora_a_is_drawn_within_nn_linear_bounds_and_b_is_zero():
    """peft (like nn.Linear) draws A from U(-1/sqrt(in), 1/sqrt(in)) and zeroes B: the adapter starts as identity."""
    expert = ExpertShard.from_weights(_two_layer_weights(), LoraSpec(8, 16), _TINY_EXPERTS, seed=0).expert(0, 0)
    for a, fan_in in ((expert.lora_A_gate_up, 4), (expert.lora_A_down, 4)):
        assert 0.5 / fan_in**0.5 < float(a.detach().abs().max()) <= 1 / fan_in**0.5
    assert not expert.lora_B_gate_up.any() and not expert.lora_B_down.any()
