"""peft's LoRA options (issue 34), on the backbone and the experts alike, each shown equal to plain peft.

`build_pair(..., lora=spec)` gives peft the `LoraConfig` of `spec` (`adapters.full_lora_config`) and vela-ray the
same spec: the master passes it to peft on the stripped model, the shards implement it for the expert stacks
(rank/alpha per stack resolved by peft's own `get_pattern_key`). Both sides start from one random adapter and
train 4 steps; the losses must agree to fp32 reordering (rtol 1e-5), and vela-ray's export, loaded by
`PeftModel.from_pretrained`, must compute what vela-ray's model computes.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from peft import get_peft_model
from peft.tuners.lora.layer import ParamWrapper

from tests.fixtures import job_dict, make_checkpoint, write_job
from vela_ray.config import JobConfig
from vela_ray.model.adapters import check_lora_targets, full_lora_config, resolve_expert_lora
from vela_ray.model.experts import ExpertShard, LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks
from vela_ray.training import equivalence
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.master import build_local

OPTIONS = {
    "expert_stacks_down_only": LoraSpec(r=4, alpha=8, expert_stacks=("down_proj",)),
    "attention_only": LoraSpec(r=4, alpha=8, target_modules=r".*self_attn\.(q|k|v|o)_proj", expert_stacks=()),
    "experts_only": LoraSpec(r=4, alpha=8, target_modules=()),
    "target_names": LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    "all_linear": LoraSpec(r=4, alpha=8, target_modules="all-linear"),
    "exclude_modules": LoraSpec(r=4, alpha=8, exclude_modules=("k_proj", "o_proj")),
    "rslora": LoraSpec(r=4, alpha=8, use_rslora=True),
    "rank_and_alpha_patterns": LoraSpec(r=8, alpha=8, rank_pattern=((r"experts\.down_proj", 2), ("q_proj", 4)),
                                        alpha_pattern=((r"experts\.\w+", 3.0),)),
    "router_in_modules_to_save": LoraSpec(r=4, alpha=8, modules_to_save=("gate",)),
    "gaussian_init": LoraSpec(r=4, alpha=8, init_lora_weights="gaussian"),
}
# experts at rank 4, attention at 16, the router trained in full, rsLoRA
COMBINATION = LoraSpec(r=16, alpha=16, rank_pattern=((r"experts\.\w+", 4),), modules_to_save=("gate",),
                       use_rslora=True)


def _pair(family: str, lora: LoraSpec, optim: OptimizerConfig = equivalence.OPTIM) -> equivalence.Pair:
    return equivalence.build_pair(functools.partial(debug_model, family, seed=0), lora=lora, optim=optim)


def _assert_equal_to_peft(pair: equivalence.Pair, family: str, tmp_path, steps: int = 4) -> list[float]:
    ref_losses, vela_losses = equivalence.run_both(pair, steps=steps)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert ref_losses[0] != ref_losses[-1]  # it trained
    reloaded = equivalence.reloaded_export(pair, functools.partial(debug_model, family, seed=0), tmp_path)
    torch.testing.assert_close(equivalence.held_out_loss(reloaded),
                               equivalence.held_out_loss(pair.master.peft_model), rtol=1e-5, atol=0)
    return vela_losses


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_each_lora_option_trains_equal_to_peft_and_its_export_reloads_in_peft(family, option, tmp_path):
    _assert_equal_to_peft(_pair(family, OPTIONS[option]), family, tmp_path)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_experts_rank_4_attention_16_router_saved_rslora_equals_peft(family, tmp_path):
    # lr 1e-3: at the harness's 1e-2 the fully trained router moved so far that on mixtral step 2's loss differed
    # by 2.8e-4 (relative), then 6.8e-4, while every step at 1e-3 and every other option at 1e-2 agree to 1e-7:
    # consistent with a top-k choice between near-tied experts flipped by rounding (not shown further).
    pair = _pair(family, COMBINATION, OptimizerConfig(lr=1e-3, max_grad_norm=0.5, warmup_steps=1))
    _assert_equal_to_peft(pair, family, tmp_path)
    shapes = {name: tuple(p.shape) for name, p in pair.master.peft_model.named_parameters() if p.requires_grad}
    assert all(shape[0] == 16 for name, shape in shapes.items() if "self_attn" in name and "lora_A" in name)
    experts = pair.trainers[0].shard.layers
    assert all(a.shape[0] == 4 for layer in experts.values() for ad in layer.adapters.values()
               for n, a in ad.named_parameters() if n.startswith("lora_A"))
    assert any(".gate.modules_to_save." in name for name in shapes)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["use_rslora"], config["modules_to_save"]) == (16, True, ["gate"])
    assert config["rank_pattern"] == {r"experts\.\w+": 4}


def test_gpt_oss_router_trains_in_full_equal_to_peft(tmp_path):
    # gpt-oss calls its router `router`, its expert stacks [E, in, out] (is_transposed) with biases
    lora = LoraSpec(r=8, alpha=8, rank_pattern=((r"experts\.\w+", 4),), modules_to_save=("router",), use_rslora=True)
    pair = _pair("gpt_oss", lora, OptimizerConfig(lr=1e-3, max_grad_norm=0.5, warmup_steps=1))
    _assert_equal_to_peft(pair, "gpt_oss", tmp_path)
    assert any(".router.modules_to_save." in n for n, p in pair.master.peft_model.named_parameters() if p.requires_grad)


def test_lora_dropout_on_the_backbone_draws_peft_s_masks_exactly(tmp_path):
    # the master's peft dropout draws from torch's global RNG in the reference's module order, and both sides
    # are seeded alike per step (run_both), so the masks match: equal losses, not just equal statistics
    dropped = _assert_equal_to_peft(_pair("mixtral", LoraSpec(r=4, alpha=8, lora_dropout=0.3, expert_stacks=())),
                                    "mixtral", tmp_path)
    plain, _ = equivalence.run_both(_pair("mixtral", LoraSpec(r=4, alpha=8, expert_stacks=())), steps=4)
    assert dropped != plain  # dropout was on


def test_a_router_in_modules_to_save_trains_and_its_weights_export(tmp_path):
    pair = _pair("mixtral", OPTIONS["router_in_modules_to_save"])
    router = dict(pair.master.peft_model.named_parameters())
    key = next(n for n in router if n.endswith("layers.0.mlp.gate.modules_to_save.default.weight"))
    before = router[key].detach().clone()
    equivalence.run_both(pair, steps=2)
    assert not torch.equal(router[key], before)  # the router moved
    exported = equivalence.exported_adapter(pair)
    torch.testing.assert_close(exported["base_model.model.model.layers.0.mlp.gate.weight"], router[key].detach(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_expert_factor_init_has_peft_s_distribution(init):
    # peft draws its fused A [r*E, in] at once from the global RNG; vela-ray draws each expert's A [r, in] from that
    # expert's own generator (any placement, any worker), so the numbers differ but not their law:
    # kaiming-uniform(a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in)) (std 1/sqrt(3 in)); gaussian is N(0, 1/r); B is 0.
    model = debug_model("mixtral", seed=0)
    lora = LoraSpec(r=4, alpha=8, init_lora_weights=init, rank_pattern=((r"experts\.down_proj", 2),))
    torch.manual_seed(0)
    wrappers = [m for m in get_peft_model(debug_model("mixtral", seed=0), full_lora_config(model, lora)).modules()
                if isinstance(m, ParamWrapper)]
    shard = ExpertShard.from_weights(expert_weights(find_moe_blocks(model)), resolve_expert_lora(model, lora),
                                     experts_prototypes(model.config), seed=0)
    for stack in ("gate_up_proj", "down_proj"):
        ours_A = torch.cat([getattr(shard.expert(l, e), f"lora_A_{stack[:-5]}") for l, e in shard.keys])
        ours_B = torch.cat([getattr(shard.expert(l, e), f"lora_B_{stack[:-5]}") for l, e in shard.keys])
        peft_A = torch.cat([m.lora_A["default"].weight.detach() for m in wrappers if m.parameter_name == stack])
        r, fan_in = ours_A.shape[0] // len(shard.keys), ours_A.shape[1]
        assert r == peft_A.shape[0] // len(shard.keys) == (2 if stack == "down_proj" else 4)
        want_std = 1 / r if init == "gaussian" else 1 / (3 * fan_in) ** 0.5
        for A in (ours_A, peft_A):
            assert abs(float(A.detach().std()) / want_std - 1) < 0.1, (stack, float(A.detach().std()), want_std)
        if init is True:
            assert float(ours_A.detach().abs().max()) <= 1 / fan_in ** 0.5
        assert not ours_B.any()


# --- bad input, in one line, before Ray --------------------------------------------------------------------


@pytest.mark.parametrize("lora, message", [
    (LoraSpec(target_modules=("q_proj", "nonexistent_proj")), r"target_modules entry 'nonexistent_proj' matches "
                                                              r"no module of MixtralForCausalLM"),
    (LoraSpec(target_modules=r".*\.nothing"), r"target_modules '.*\\\\.nothing' matches no module"),
    (LoraSpec(rank_pattern=(("w9", 2),)), r"lora.rank_pattern key 'w9' matches no adapted module or expert stack"),
    (LoraSpec(alpha_pattern=(("experts\\.up", 2.0),)), r"lora.alpha_pattern key .* matches no adapted"),
    (LoraSpec(target_modules=("gate",)), r"adapts the router model.layers.0.mlp.gate of MixtralForCausalLM, a "
                                         r"MixtralTopKRouter, not a linear layer .* lora.modules_to_save instead"),
    (LoraSpec(expert_stacks=("w1",)), r"lora.expert_stacks \['w1'\] match no expert weight stack"),
    (LoraSpec(lora_dropout=0.1), r"lora_dropout 0.1 with adapted expert stacks: peft's ParamWrapper cannot"),
    (LoraSpec(target_modules=(), expert_stacks=()), r"nothing to train"),
    (LoraSpec(modules_to_save=("router",)), r"lora.modules_to_save entry 'router' matches no module"),
    (LoraSpec(modules_to_save=("experts",)), r"matches model.layers.0.mlp.experts, expert weights that live on the "
                                             r"ExpertManagers; adapt them with lora.expert_stacks instead"),
])
def test_lora_options_that_match_nothing_are_refused_naming_the_field(lora, message):
    with pytest.raises(ValueError, match=message) as err:
        check_lora_targets(debug_model("mixtral", seed=0), lora)
    assert "\n" not in str(err.value)


def test_peft_s_v4_rename_of_a_target_name_is_refused():
    # DeepSeek's shared experts call their layers gate_proj/up_proj/down_proj, names peft maps onto the experts
    with pytest.raises(ValueError, match=r"names \['down_proj'\], which peft maps onto the experts"):
        check_lora_targets(debug_model("deepseek_v3", seed=0), LoraSpec(target_modules=("down_proj",)))


def test_a_linear_shared_expert_gate_is_a_lora_target_equal_to_peft(tmp_path):
    lora = LoraSpec(r=4, alpha=8, target_modules=("q_proj", "shared_expert_gate"))
    _assert_equal_to_peft(_pair("qwen2_moe", lora), "qwen2_moe", tmp_path)


@pytest.mark.parametrize("lora, message", [
    ({"lora_dropout": 1.0}, r"lora.lora_dropout\n? *Input should be less than 1"),
    ({"lora_dropout": -0.1}, r"lora.lora_dropout\n? *Input should be greater than or equal to 0"),
    ({"lora_dropout": 0.1}, r"lora_dropout above 0 and adapted expert stacks"),
    ({"rank_pattern": {"q_proj": 0}}, r"ranks must be >= 1"),
    ({"init_lora_weights": "pissa"}, r"lora.init_lora_weights"),
])
def test_lora_section_refuses_bad_values(lora, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        JobConfig.model_validate(job_dict(tmp_path / "model", tmp_path / "out", lora=lora))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("model"))


def test_preflight_refuses_a_target_that_matches_nothing_in_one_line(model_dir, tmp_path):
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out",
                                                    lora={"target_modules": ["q_proj", "qkv"]}))
    with pytest.raises(ValueError, match=r"^lora.target_modules entry 'qkv' matches no module of Mixtral\w+$"):
        JobConfig.from_yaml(job).preflight()
    assert not (tmp_path / "out").exists()


def test_job_lora_section_reaches_workers_resolved_per_stack(model_dir, tmp_path):
    config = JobConfig.model_validate(job_dict(model_dir, tmp_path / "out", lora={
        "r": 16, "alpha": 16, "rank_pattern": {r"experts\.\w+": 4}, "use_rslora": True, "modules_to_save": ["gate"],
        "target_modules": ["q_proj", "v_proj"]}))
    spec = config.lora_spec
    assert {(stack, r) for _, stack, r, _ in spec.resolved} == {("gate_up_proj", 4), ("down_proj", 4)}
    model = debug_model("mixtral", seed=0)
    table = equivalence.scattered_placement(2, 6)
    master, workers = build_local(model, table, spec, OptimizerConfig(), seed=0)  # through ExpertManagerSpec
    state = workers.lora_state()
    assert state[(1, 5)]["lora_A_down"].shape[0] == 4
    trainable = [n for n, p in master.peft_model.named_parameters() if p.requires_grad]
    assert all(re.search(r"(q_proj|v_proj)\.lora_|gate\.modules_to_save", n) for n in trainable)


# --- whole jobs: the lora section through the runtime, checkpoints and resume -----------------------------


def _job(model_dir, out, lora: dict, steps: int = 4) -> dict:
    return job_dict(model_dir, out, steps=steps, lora=lora, placement={"profile": "uniform"},
                    checkpoint={"every": 1, "keep": 10}, training={"optimizer": {"lr": 3e-3}})


@pytest.mark.job
@pytest.mark.parametrize("lora", [
    # attention only, with backbone dropout: the master's RNG state in each checkpoint gives back the masks
    {"r": 4, "alpha": 8, "target_modules": r".*self_attn\.(q|k|v|o)_proj", "expert_stacks": [],
     "lora_dropout": 0.2},
    # experts at rank 4, attention at 16, the router trained in full, rsLoRA
    {"r": 16, "alpha": 16, "rank_pattern": {r"experts\.\w+": 4}, "modules_to_save": ["gate"], "use_rslora": True},
], ids=["attention_only_dropout", "combination"])
def test_a_job_with_lora_options_resumes_exactly_and_its_adapter_loads_in_peft(lora, model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.fixtures import run_in_process

    full = run_in_process(JobConfig.from_dict(_job(model_dir, tmp_path / "full", lora)))
    job = _job(model_dir, tmp_path / "resumed", lora)
    job["checkpoint"]["resume"] = str(tmp_path / "full" / "checkpoints" / "step-000002")
    resumed = run_in_process(JobConfig.from_dict(job))
    assert resumed.losses == full.losses
    a, b = (load_file(f"{s.adapter_dir}/adapter_model.safetensors") for s in (resumed, full))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    config = json.loads((tmp_path / "full" / "adapter" / "adapter_config.json").read_text())
    for name in ("lora_dropout", "rank_pattern", "modules_to_save", "use_rslora"):
        if name in lora:
            assert config[name] == lora[name], name
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), full.adapter_dir)
    loaded = {k.replace(".default", ""): v for k, v in reloaded.state_dict().items()}
    assert all(torch.equal(loaded[k], v) for k, v in a.items() if k in loaded)
    assert sum(k in loaded for k in a) > 0


@pytest.mark.job
def test_a_trained_router_moves_the_routing_and_the_report_shows_it(model_dir, tmp_path):
    """The same job with the router frozen (the paper) and trained in full: the same batches, so the steps'
    routing drift from the placed profile differs only where the router moved it; the report shows it."""
    from tests.fixtures import run_in_process

    runs = {}
    for name, lora in (("frozen", {"r": 4, "alpha": 8}), ("trained", {"r": 4, "alpha": 8, "modules_to_save": ["gate"]})):
        job = job_dict(model_dir, tmp_path / name, steps=4, lora=lora, placement={"profile": "measure"},
                       training={"optimizer": {"lr": 3e-2, "warmup_steps": 1}})
        runs[name] = run_in_process(JobConfig.from_dict(job))
    drift = {name: [r.routing_drift for r in run.history] for name, run in runs.items()}
    assert all(d is not None and len(d) == 2 for d in drift["trained"])
    assert drift["trained"][0] == drift["frozen"][0]  # step 1 routes with the untrained router in both
    assert drift["trained"][-1] != drift["frozen"][-1]
    report = (tmp_path / "trained" / "report.html").read_text()
    assert "Routing drift" in report and f"{drift['trained'][-1][0]:.3f}" in report
