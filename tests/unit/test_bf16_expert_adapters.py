"""Expert LoRA of a bf16 model trains as peft's does (issue 30): fp32 factors and AdamW state, cast at use.

peft keeps adapters in fp32 on a bf16 base (`autocast_adapter_dtype=True`); with bf16 factors an AdamW
step at lr 3e-5 (~1e-3 of an entry) falls below bf16's rounding step and most updates vanish: 30 steps
on debug Mixtral moved the expert factors 98% away from peft's move (relative L2), against 7e-6 in fp32.

How close is close enough in bf16 is measured, not guessed: the same peft run in exact arithmetic (the
same bf16-valued weights and start adapter, computed in fp32; `exact_reference`) shows what bf16 rounding
alone does to peft's own update, eps = max over the fused expert tensors of |d_peft - d_exact| / |d_exact|
(d: a factor's change from its start). Measured at 30 steps, lr 3e-5: 0.19 (Mixtral), 0.27 (Qwen3-MoE),
0.32 (gpt-oss). A second run with errors of that size differs from peft's by up to ~sqrt(2) eps; vela-ray's
low-rank path differs by 0.18, 0.13, 0.22, and is as close to the exact run as peft is (0.16, 0.29, 0.33).
Two peft bf16 runs of equal math and other rounding differ by up to about eps: 4 micro-batches of one row
instead of 2 of 2, 0.12, 0.05, 0.14; peft's fp32-delta fold (its path for fp8 weights) instead of its bf16
`baddbmm`, 0.20, 0.08, 0.23. Before the fix vela-ray was 0.97-0.99 off peft. Where vela-ray runs peft's
own fold (Llama 4's grouped experts) the two agree to 2e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict

from tests.equivalence import assert_updates_within_rounding, build_pair, expert_drifts, exported_adapter, run_both
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, find_moe_blocks
from vela_ray.training import checkpoint
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.tiers import ExpertTiersConfig, TierSpeeds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16_OPTIM = OptimizerConfig(lr=3e-5, schedule="constant")  # the VELA paper's lr, held: no decay to zero
STEPS = 30
MIXTRAL = debug_model("mixtral", seed=0)  # the experts ExpertManagers host below
# every expert with rows goes to the "device" (the CPU in these tests) as far as the cache allows
ALL_TO_DEVICE = TierSpeeds(cpu_s_per_row=1.0, device_s_per_row=1e-9, upload_bytes_per_s=1e18, bytes_per_expert=1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_bf16_expert_factors_move_as_peft_s_within_bf16_rounding(family):
    pair = build_pair(family, dtype=torch.bfloat16, optim=BF16_OPTIM)
    assert_updates_within_rounding(expert_drifts(pair, family, torch.bfloat16, STEPS), family)


def test_bf16_folded_expert_factors_move_exactly_as_peft_s():
    """Llama 4's experts take rows grouped by expert: the shard folds LoRA into the weights with peft's own
    casts and `baddbmm` (`LayerExperts._adapted`), so bf16 adds no difference between the two."""
    pair = build_pair("llama4_text", dtype=torch.bfloat16, optim=BF16_OPTIM)
    drifts = expert_drifts(pair, "llama4_text", torch.bfloat16, STEPS)
    assert drifts.rounding > 0.05  # bf16 rounding does show, in both
    assert max(drifts.vela_vs_peft.values()) < 1e-4, drifts.vela_vs_peft


def test_a_bf16_models_expert_factors_and_adamw_state_are_fp32_and_export_as_peft_s():
    pair = build_pair("mixtral", dtype=torch.bfloat16, optim=BF16_OPTIM)
    run_both(pair, steps=1)
    for trainer in pair.trainers:
        for name, param in trainer.shard.named_parameters():
            assert param.dtype == (torch.float32 if "lora_" in name else torch.bfloat16), name
        for key, slots in trainer.optimizer_state().items():
            moments = [t.dtype for n, t in slots.items() if n.endswith((".exp_avg", ".exp_avg_sq"))]
            assert len(moments) == 8 and set(moments) == {torch.float32}, key  # 4 factors, 2 moments each
    exported, peft_state = exported_adapter(pair), get_peft_model_state_dict(pair.reference)
    assert {k: t.dtype for k, t in exported.items()} == {k: t.dtype for k, t in peft_state.items()}
    assert {t.dtype for t in exported.values()} == {torch.float32}


def _bf16_manager(keys: list[tuple[int, int]], worker: int = 0) -> ExpertManager:
    """An ExpertManager of debug Mixtral's experts in bf16 (all of them in its spec, so it can rehost)."""
    spec = ExpertManagerSpec(worker=worker, keys=keys, weights=expert_weights(find_moe_blocks(MIXTRAL)),
                             hf_config=MIXTRAL.config, lora=LoraSpec(r=4, alpha=8), optim=BF16_OPTIM,
                             dtype="bfloat16", seed=7)
    manager = ExpertManager(spec)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():  # non-zero B, so every factor gets a gradient and AdamW moments
        for name, param in manager.shard.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return manager


def _train_one_step(manager: ExpertManager) -> None:
    """A forward, backward and AdamW step over every hosted expert of layer 0, so the moments exist."""
    experts = torch.tensor([e for layer, e in manager.keys if layer == 0] * 3)
    rows = torch.randn(len(experts), MIXTRAL.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = rows.bfloat16()
    manager.forward_rows(0, experts, rows, "k")
    manager.backward_rows("k", torch.ones_like(rows))
    manager.step(3e-5, 1.0)


def test_a_bf16_expert_moves_and_checkpoints_with_its_fp32_state_bit_for_bit(tmp_path: Path):
    sender, receiver = _bf16_manager([(0, 0), (0, 1)]), _bf16_manager([(0, 2)], worker=1)
    _train_one_step(sender)
    sent = sender.expert_states([(0, 1)])
    assert {t.dtype for t in sent[(0, 1)].values() if t.dim()} == {torch.float32}
    receiver.rehost([(0, 1), (0, 2)], sent)
    staging = checkpoint.begin(tmp_path, step=1)
    receiver.snapshot_checkpoint_part(str(staging))
    receiver.finish_checkpoint_part()
    resumed = _bf16_manager([(0, 1)], worker=2)
    resumed.load_checkpoint(str(checkpoint.finalize(staging, step=1, meta={})))
    for manager in (receiver, resumed):
        for name, value in manager.expert_states([(0, 1)])[(0, 1)].items():
            assert value.dtype == sent[(0, 1)][name].dtype and torch.equal(value, sent[(0, 1)][name]), name


def test_a_checkpoint_with_bf16_expert_state_resumes_in_fp32_and_steps(tmp_path: Path):
    """Parts written while a bf16 model's expert factors were bf16 (before issue 30's fix) still load."""
    writer = _bf16_manager([(0, 0)])
    _train_one_step(writer)
    old = {n: t.bfloat16() if t.dim() else t for n, t in writer.expert_states([(0, 0)])[(0, 0)].items()}
    staging = checkpoint.begin(tmp_path, step=1)
    checkpoint.write_tensors(staging / "experts" / "part-0.safetensors", checkpoint.expert_part_tensors({(0, 0): old}))
    resumed = _bf16_manager([(0, 0)])
    resumed.load_checkpoint(str(checkpoint.finalize(staging, step=1, meta={})))
    for name, value in resumed.expert_states([(0, 0)])[(0, 0)].items():
        assert value.dtype == (torch.float32 if value.dim() else old[name].dtype), name
        torch.testing.assert_close(value, old[name].to(value.dtype), rtol=0, atol=0, msg=name)
    _train_one_step(resumed)  # AdamW takes the upcast moments


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text"])
def test_a_tiered_bf16_manager_equals_an_untiered_one_and_its_device_experts_train_the_fp32_factors(family):
    """Device experts (here the CPU stands in) read the host's fp32 factors cast to bf16 in each call, and
    their gradients reach those factors: gpt-oss on the low-rank path, Llama 4 on peft's fold."""
    model = debug_model(family, seed=0)
    blocks = find_moe_blocks(model)
    layer, num_experts, hidden = blocks[0].index, blocks[0].layout.num_experts, blocks[0].layout.hidden_size
    ids = torch.tensor([e for e in range(num_experts) for _ in range((3, 0, 5, 1)[e % 4])])
    generator = torch.Generator().manual_seed(5)
    rows, grad = (torch.randn(len(ids), hidden, generator=generator).bfloat16() for _ in range(2))
    results = []
    for tiers in (ExpertTiersConfig(), ExpertTiersConfig(enabled=True, cache_experts=2)):
        manager = ExpertManager(ExpertManagerSpec(
            worker=0, keys=[(layer, e) for e in range(num_experts)], weights=expert_weights(blocks[:1]),
            hf_config=model.config, lora=LoraSpec(r=4, alpha=8), dtype="bfloat16", seed=3, tiers=tiers))
        if manager.tiers:
            manager.tiers.use_speeds(ALL_TO_DEVICE)
        out = manager.forward_rows(layer, ids, rows, "k")
        results.append((out, manager.backward_rows("k", grad), manager.lora_grads()))
    (out, grad_in, lora), (t_out, t_grad_in, t_lora) = results
    assert manager.report().tiers.experts_device == 2
    torch.testing.assert_close(t_out, out, rtol=0, atol=0)
    torch.testing.assert_close(t_grad_in, grad_in, rtol=0, atol=0)
    for key, named in lora.items():
        for name, want in named.items():
            assert want.dtype == torch.float32
            torch.testing.assert_close(t_lora[key][name], want, rtol=0, atol=0, msg=f"{key} {name}")
