"""Frozen weights held quantized (`model.quantization`, `vela_ray.model.quantization`): each format's storage and
rounding, the multiply that never keeps a full-width weight, and training equal to peft on the dequantized model:
in one process for four families and every format, and as a whole job."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from peft import PeftModel, get_peft_model_state_dict

from tests.equivalence import micro_batches, reference_adapter_state, run_both
from tests.fixtures import (
    init_adapter, job_dict, make_checkpoint, peft_job, reference_losses, run_equal_to_peft, run_in_process,
    side_by_side,
)
from vela_ray.config import JobConfig
from vela_ray.export import export_run
from vela_ray.model.experts import ExpertShard
from vela_ray.model.families import debug_model
from vela_ray.model.shipped import write_shipped
from vela_ray.model.quantization import FORMATS, NF4_CODES, QuantizedLinear, frozen_matmul
from vela_ray.model.quantized_model import QuantizationSpec, quantizable_linears, quantize_backbone, round_trip_model
from vela_ray.model.modeling import experts_prototypes
from vela_ray.training import equivalence
from vela_ray.training.adapter_io import export
from vela_ray.training.optim import make_adamw
from vela_ray.training.schedule import lr_at


def export_dir(pair, tmp_path):
    export(pair.master, pair.workers, tmp_path / "adapter")
    return tmp_path / "adapter"

# widths every format's blocks divide (fp8: 128 x 128)
WIDE = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_format_holds_its_bytes_in_integer_codes_and_reads_back_within_its_rounding(name):
    fmt = FORMATS[name]
    w = torch.randn(3, 256, 128, generator=torch.Generator().manual_seed(0))  # an expert stack [E, out, in]
    parts = fmt.quantize(w)
    assert set(parts) == set(fmt.parts)
    assert all(not t.is_floating_point() or t.dtype == torch.float32 for t in parts.values())
    assert all(t.shape[0] == 3 for t in parts.values())  # per expert: slices, stacks and migrates as weights do
    assert sum(t.nbytes for t in parts.values()) == fmt.nbytes(tuple(w.shape))
    back = fmt.dequantize(parts, torch.float32)
    assert back.shape == w.shape
    # each format's rounding: half a step of its grid at the block's scale
    bound = {"fp8": 2 ** -4 * w.abs().max(), "int8": w.abs().amax(-1, keepdim=True) / 127 / 2,
             "nf4": w.abs().max() * max(b - a for a, b in zip(NF4_CODES, NF4_CODES[1:])) / 2,
             "mxfp4": w.abs().max() * 2 ** -1}[name]
    assert bool(((back - w).abs() <= bound + 1e-6).all())
    assert torch.equal(fmt.dequantize(parts, torch.float32), back)  # the same every time
    # the bytes a worker holds against bf16's
    ratio = fmt.nbytes(tuple(w.shape)) / (w.numel() * 2)
    assert ratio <= {"fp8": 0.55, "int8": 0.55, "nf4": 0.3, "mxfp4": 0.3}[name], ratio


@pytest.mark.parametrize("name", ["nf4", "mxfp4"])
def test_a_weight_no_whole_number_of_blocks_covers_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"to {name}: its .out, in. = .100, 100. is not a whole number"):
        FORMATS[name].quantize(torch.randn(100, 100))
    assert FORMATS["int8"].unfit((100, 100)) is None  # a scale per output channel fits any shape


def test_fp8_covers_a_partial_edge_block_as_deepseek_v3s_checkpoint_does():
    """DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168]: its scale_inv is [5, 56], the last block row half full."""
    w = torch.randn(576 // 4, 7168 // 28) * 0.02  # [144, 256]: 1.125 x 2 blocks
    parts = FORMATS["fp8"].quantize(w)
    assert parts["codes"].shape == (144, 256) and parts["scale_inv"].shape == (2, 2)
    back = FORMATS["fp8"].dequantize(parts, torch.float32)
    assert float((back - w).abs().max()) <= 2 ** -4 * float(w.abs().max())


def test_the_multiply_keeps_no_full_width_weight_between_forward_and_backward():
    linear = torch.nn.Linear(256, 128, bias=True)
    quantized = QuantizedLinear(linear, FORMATS["nf4"])
    x = torch.randn(4, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = quantized(x)
    assert all(n < linear.weight.numel() for n in saved), saved
    y.square().sum().backward()
    # the gradient is that of the dequantized weight's layer
    reference = torch.nn.Linear(256, 128)
    with torch.no_grad():
        reference.weight.copy_(quantized.dequantized())
        reference.bias.copy_(linear.bias)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    # no gradient reaches the frozen parts; the whole layer holds nf4's bytes
    assert not any(t.requires_grad for t in quantized.weight_parts.values())
    assert sum(t.nbytes for t in quantized.weight_parts.values()) == FORMATS["nf4"].nbytes((128, 256))


def test_frozen_matmul_without_grad_is_one_multiply():
    w = torch.randn(8, 4)
    x = torch.randn(3, 8)
    assert torch.equal(frozen_matmul(x, lambda: w), x @ w)


# AdamW with an eps above rounding-level gradients: its first steps otherwise move an element whose gradient is
# a rounding error from 0 by a whole lr, either way, and quantized weights leave more such elements (the step-0
# gradients agree to 3e-6 of their largest either way).
OPTIM = equivalence.OPTIM.model_copy(update={"eps": 1e-5})


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_training_on_quantized_weights_equals_peft_on_the_dequantized_model(family, name, tmp_path):
    """Experts on three shards and the backbone's linears held in `name`; peft trains the same model with those
    weights dequantized: losses rel 1e-5 and the exported adapter equal over 3 steps (fp32)."""
    spec = QuantizationSpec(name)
    overrides = {"mixtral": {k: WIDE[k] for k in ("hidden_size", "intermediate_size")},
                 "qwen3_moe": {**WIDE, "head_dim": 32}, "gpt_oss": {**WIDE, "head_dim": 32}
                 }.get(family, WIDE)  # some attention layers in whole blocks
    make_model = functools.partial(debug_model, family, seed=0, **overrides)
    pair = equivalence.build_pair(make_model, quantization=spec, optim=OPTIM)
    for shard in pair.trainers:  # every hosted stack is held as its format's parts, none at full width
        for layer in shard.shard.layers.values():
            assert set(layer.quantized) == set(layer.stacks)
            assert not any(p.dim() == 3 for p in layer.module.parameters())
    quantized = [m for m in pair.master.peft_model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized, "no backbone linear layer was quantized"
    ref_losses, vela_losses = run_both(pair, steps=3)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # The export is peft's adapter: on the dequantized model, plain peft computes what vela-ray's model computes.
    # (Not compared tensor by tensor with the reference's: AdamW's first steps move an element whose gradient is a
    # rounding error from 0 by up to 2 lr; the losses above are the equality check, as in test_every_family.)
    reloaded = PeftModel.from_pretrained(round_trip_model(make_model(), spec), export_dir(pair, tmp_path))
    assert get_peft_model_state_dict(reloaded).keys() == reference_adapter_state(pair).keys()
    batch = micro_batches(99)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batch).loss, pair.master.peft_model.eval()(**batch).loss,
                                   rtol=1e-5, atol=0)


def test_weights_of_a_quantized_shard_move_as_their_parts():
    """Migration and replicas take a shard's `weights()`: quantized experts leave as their parts and rebuild into an
    equal shard, never dequantized on the way."""
    pair = equivalence.build_pair(functools.partial(debug_model, "mixtral", seed=0, hidden_size=128,
                                                    intermediate_size=128), quantization=QuantizationSpec("nf4"))
    shard = pair.trainers[0].shard
    weights = shard.weights()
    assert all(any(":nf4:" in name for name in params) for params in weights.values())
    prototypes = experts_prototypes(pair.master.peft_model.get_base_model().config)
    rebuilt = ExpertShard.from_weights(weights, equivalence.LORA, prototypes, dtype=torch.float32)
    layer = next(iter(shard.layers))
    ids = torch.tensor(shard.layers[layer].expert_ids * 2)
    rows = torch.randn(len(ids), 128)
    rebuilt.load_lora_state(shard.lora_state())
    torch.testing.assert_close(rebuilt.forward_rows(int(layer), ids, rows), shard.forward_rows(int(layer), ids, rows))


def test_the_backbone_keeps_lm_head_and_modules_trained_in_full_at_full_width():
    model = debug_model("qwen3_moe", seed=0, **WIDE)
    quantize_backbone(model, QuantizationSpec("int8", keep_full=("o_proj",)))
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["lm_head"] == "Linear"
    assert kinds["model.layers.0.self_attn.o_proj"] == "Linear"
    assert kinds["model.layers.0.self_attn.q_proj"] == "QuantizedLinear"


def test_bad_settings_are_one_line_before_anything_runs(tmp_path):
    base = job_dict(tmp_path / "model", tmp_path / "out")
    for section, fix in [({"mode": "expert_parallel"}, "model.quantization, training.preference\\).* Fix: use mode: vela"),
                         ({"cluster": {"master_tp": 2}}, "model.quantization.backbone: false, or master_tp: 1"),
                         ({"masters": {"count": 2, "shard_frozen_backbone": True}},
                          "model.quantization.backbone: false, or master_tp: 1")]:
        raw = {**base, **{k: {**base.get(k, {}), **v} if isinstance(v, dict) else v for k, v in section.items()}}
        raw["model"] = {**raw["model"], "quantization": {"format": "nf4"}}
        with pytest.raises(ValueError, match=fix):
            JobConfig.from_dict(raw)
    with pytest.raises(ValueError, match="model.quantization.format"):
        JobConfig.from_dict({**base, "model": {**base["model"], "quantization": {"format": "nf3"}}})


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("quantized") / "model", hidden_size=128, intermediate_size=128)


@pytest.mark.job
@pytest.mark.parametrize("name", ["fp8", "nf4"])
def test_a_quantized_job_trains_equal_to_peft_on_the_dequantized_checkpoint(wide_model, tmp_path, name):
    """The whole job in one process: workers quantize each expert as they read it, the master its backbone after
    reading it; plain peft on the checkpoint with those weights dequantized gives the same losses."""
    config, _ = run_equal_to_peft(peft_job(wide_model, tmp_path, model={"quantization": {"format": name}}))
    # exported as peft's adapter, or merged into what the run computed with (the weights it held quantized,
    # dequantized): both compute what the trained model computes
    from transformers import AutoModelForCausalLM

    export_run(tmp_path / "out", "peft", tmp_path / "peft")
    export_run(tmp_path / "out", "merged", tmp_path / "merged")
    trained = PeftModel.from_pretrained(round_trip_model(AutoModelForCausalLM.from_pretrained(wide_model),
                                                         config.quantization_spec), tmp_path / "peft")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained.eval()(ids).logits, rtol=1e-4, atol=1e-5)


# --- checkpoints shipped quantized: DeepSeek-V3's FP8, gpt-oss's MXFP4 ---------------------------------------------

SHIPPED = {  # family -> (format, the debug widths its blocks need, what the shipped layout quantizes)
    "deepseek_v3": ("fp8", dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128,
                                kv_lora_rank=128), {}),
    "gpt_oss": ("mxfp4", dict(hidden_size=128, intermediate_size=128), {"backbone": False}),
}


@pytest.fixture(scope="module")
def shipped_models(tmp_path_factory):
    """{family: (full-width checkpoint, the same written as the family ships it quantized)}."""
    root = tmp_path_factory.mktemp("shipped")
    out = {}
    for family, (name, widths, _) in SHIPPED.items():
        full = make_checkpoint(root / family, family=family, **widths)
        out[family] = (full, write_shipped(full, root / f"{family}-{name}", name))
    return out


def test_shipped_layouts_dequantize_as_transformers_does():
    """gpt-oss's MXFP4 read as transformers' own integration reads it; DeepSeek-V3's FP8 as its Fp8Dequantize op."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(1))  # gpt-oss's [E, in, out]
    parts = FORMATS["mxfp4"].quantize(w.transpose(-2, -1))
    theirs = convert_moe_packed_tensors(parts["blocks"], parts["scales"], dtype=torch.float32)
    torch.testing.assert_close(FORMATS["mxfp4"].dequantize(parts, torch.float32).transpose(-2, -1), theirs,
                               rtol=0, atol=0)
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(2))
    parts = FORMATS["fp8"].quantize(w)
    theirs = Fp8Dequantize(None)._dequantize_one(parts["codes"].view(torch.float8_e4m3fn), parts["scale_inv"],
                                                 torch.float32)
    torch.testing.assert_close(FORMATS["fp8"].dequantize(parts, torch.float32), theirs, rtol=0, atol=0)


@pytest.mark.job
@pytest.mark.parametrize("family", sorted(SHIPPED))
@pytest.mark.parametrize("held", ["shipped", "none"])
def test_a_shipped_checkpoint_trains_equal_to_peft_on_its_dequantized_weights(shipped_models, tmp_path, family,
                                                                                held):
    """The workers read each expert's stacks as shipped and keep them so (`format` = the shipped one) or dequantize
    them (`none`); the master dequantizes its FP8 backbone as it reads it. Plain peft on the dequantized weights
    (the full-width checkpoint, rounded through the format) gives the same losses."""
    full, shipped = shipped_models[family]
    name, _, where = SHIPPED[family]
    quantization = {"format": name if held == "shipped" else "none", **where}
    job = peft_job(shipped, tmp_path, model={"quantization": quantization})
    job["lora"]["init_adapter"] = str(init_adapter(full, tmp_path / "init"))
    config = JobConfig.from_dict(job)
    config.preflight()
    summary = run_in_process(config)
    reference = config.model_copy(update={"model": config.model.model_copy(update={
        "path": full, "quantization": config.model.quantization.model_copy(update={"format": name, **where})})})
    ref_losses, _ = reference_losses(reference)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    if held == "shipped":  # merged: into the weights dequantized to bf16, which any engine loads
        from transformers import AutoModelForCausalLM

        exported = export_run(tmp_path / "out", "merged", tmp_path / "merged")
        assert f"ships in {name}" in exported.note
        assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
        export_run(tmp_path / "out", "peft", tmp_path / "peft")
        trained = PeftModel.from_pretrained(round_trip_model(AutoModelForCausalLM.from_pretrained(full),
                                                             reference.quantization_spec), tmp_path / "peft")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():  # bf16 weights: within their rounding
            want, got = trained.eval()(ids).logits, merged(ids).logits
        assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())


def test_a_shipped_checkpoint_dequantizes_to_its_full_width_values(shipped_models, tmp_path):
    """`write_dequantized` (what a merged export of a shipped checkpoint starts from) in fp32: every tensor the value
    the shipped one stands for, under transformers' names, loadable without a quantization_config."""
    from transformers import AutoModelForCausalLM

    from vela_ray.model.shipped import write_dequantized

    for family, (full, shipped) in shipped_models.items():
        name, _, where = SHIPPED[family]
        out = write_dequantized(shipped, tmp_path / family, torch.float32)
        want = round_trip_model(AutoModelForCausalLM.from_pretrained(full), QuantizationSpec(name, **where))
        got = AutoModelForCausalLM.from_pretrained(out)
        for key, value in want.state_dict().items():
            torch.testing.assert_close(got.state_dict()[key], value, rtol=0, atol=0, msg=key)


def _without(path, drop: str, out):
    """A copy of the checkpoint at `path` without tensor `drop`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    del tensors[drop]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_bad_quantized_checkpoints_and_settings_are_one_line_before_ray(shipped_models, tmp_path):
    full, shipped = shipped_models["deepseek_v3"]
    scale = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"

    def preflight(model_dir, **quantization):
        job = job_dict(model_dir, tmp_path / "out", model={"quantization": quantization})
        return JobConfig.from_dict(job).preflight()

    with pytest.raises(ValueError, match=f"q_a_proj.weight is stored in fp8 without its {scale}"):
        preflight(_without(shipped, scale, tmp_path / "no-scale"), format="fp8")
    misshapen = tmp_path / "misshapen"
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(shipped, misshapen)
    tensors = load_file(misshapen / "model.safetensors")
    tensors[scale] = torch.ones(2, 2)  # as 64 x 64 blocks would scale it
    save_file(tensors, misshapen / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_scale_inv is \[2, 2\], but 128x128 blocks .* need \[1, 1\]"):
        preflight(misshapen, format="fp8")
    with pytest.raises(ValueError, match="shipped in fp8: set fp8 to train it as shipped, or none"):
        preflight(shipped, format="nf4")
    gptq = tmp_path / "gptq"
    shutil.copytree(full, gptq)
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="quantization_config is 'gptq', which vela-ray does not read"):
        preflight(gptq)
    narrow = make_checkpoint(tmp_path / "narrow")  # hidden 32: no whole 64-input NF4 block
    with pytest.raises(ValueError, match="nf4 cannot hold MixtralExperts.gate_up_proj of MoE layer 0"):
        preflight(narrow, format="nf4")


_LOAD_PEAK = """
import json, sys, threading, time
from vela_ray.model.loading import checkpoint_layout, moe_layout
from vela_ray.training.expert_spec import ExpertManagerSpec, load_expert_weights
from vela_ray.model.quantized_model import QuantizationSpec

def anon():  # resident anonymous memory: what loading holds (read pages stay the kernel's cache)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

model_dir, fmt = sys.argv[1], sys.argv[2]
layers, experts = moe_layout(model_dir)
checkpoint_layout(model_dir)
spec = ExpertManagerSpec(worker=0, model_dir=model_dir, keys=[(l, e) for l in range(layers) for e in range(experts)],
                         dtype="bfloat16", quantization=QuantizationSpec(fmt) if fmt != "none" else None)
before, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon()); time.sleep(0.001)
thread = threading.Thread(target=sample); thread.start()
weights, _ = load_expert_weights(spec)
done.set(); thread.join()
held = sum(t.nbytes for params in weights.values() for t in params.values())
print(json.dumps({"peak": max(peak[0], anon()) - before, "held": held, "experts": len(weights)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_shipped_checkpoint_loads_without_a_full_width_copy(tmp_path, family):
    """A worker reading DeepSeek-V3's FP8 or gpt-oss's MXFP4 experts holds at most 1.15x their shipped bytes at any
    moment while loading (anonymous memory, in a fresh process; the pages read stay the kernel's cache);
    dequantizing them to bf16 on the way (`format: none`) needs over twice that."""
    import sys

    name = SHIPPED[family][0]
    widths = {"deepseek_v3": dict(hidden_size=1024, moe_intermediate_size=1024, intermediate_size=128,
                                  q_lora_rank=128, kv_lora_rank=128, n_routed_experts=8),
              "gpt_oss": dict(hidden_size=1024, intermediate_size=1024, num_local_experts=8)}[family]
    full = make_checkpoint(tmp_path / "full", family=family, **widths)
    shipped = write_shipped(full, tmp_path / name, name)

    held, dequantized = (json.loads(out.strip().splitlines()[-1]) for out in side_by_side(
        [[sys.executable, "-c", _LOAD_PEAK, str(shipped), fmt] for fmt in (name, "none")]))
    weights = held["experts"] * 3 * 1024 * 1024  # each expert: 3 [1024, 1024] matrices
    stacks = FORMATS[name].nbytes((1024, 1024)) * 3 * held["experts"]  # their parts, shipped
    assert stacks <= held["held"] <= stacks + held["experts"] * 3 * 1024 * 4  # (gpt-oss's fp32 biases beside them)
    assert held["peak"] <= 1.15 * held["held"], held
    assert dequantized["held"] >= 2 * weights and dequantized["peak"] >= 2 * held["held"]


_MASTER_PEAK = """
import json, sys, threading, time
import torch
from vela_ray.model.loading import checkpoint_layout
from vela_ray.model.quantization import QuantizedLinear
from vela_ray.model.quantized_model import QuantizationSpec
from vela_ray.model.experts import LoraSpec
from vela_ray.training.master import MasterSpec, seeded_backbone
from vela_ray.training.schedule import OptimizerConfig

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

model_dir, fmt = sys.argv[1], sys.argv[2]
checkpoint_layout(model_dir)
spec = MasterSpec(model_dir=model_dir, dtype=torch.float32, lora=LoraSpec(), optim=OptimizerConfig(),
                  quantization=QuantizationSpec(fmt) if fmt != "none" else None)
before, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon()); time.sleep(0.001)
thread = threading.Thread(target=sample); thread.start()
model = seeded_backbone(spec)
done.set(); thread.join()
quantized = sum(isinstance(m, QuantizedLinear) for m in model.modules())
print(json.dumps({"peak": max(peak[0], anon()) - before, "quantized": quantized}))
"""


@pytest.mark.slow
def test_a_master_holds_its_backbone_quantized_as_it_reads_it(tmp_path):
    """A lone master quantizes each linear layer as soon as it has read it: its peak while loading is the quantized
    backbone and a tensor or two at full width, well under the full-width backbone's (fp32 attention of four
    [2048, 2048] projections in each of 4 layers here: 268 MB; in NF4 38 MB)."""
    import sys

    model_dir = make_checkpoint(tmp_path / "model", hidden_size=2048, num_attention_heads=8, num_key_value_heads=8,
                                num_hidden_layers=4, intermediate_size=64)

    full, nf4 = (json.loads(out.strip().splitlines()[-1]) for out in side_by_side(
        [[sys.executable, "-c", _MASTER_PEAK, str(model_dir), fmt] for fmt in ("none", "nf4")]))
    assert full["quantized"] == 0 and nf4["quantized"] == 16
    attention = 4 * 4 * 2048 * 2048 * 4
    assert full["peak"] >= attention, full
    # the NF4 layers (38 MB), two [2048, 2048] tensors at full width (the one read, the one before: 34 MB) and the
    # quantization's temporaries (a few MB of rows at a time) beside the rest of the model
    assert nf4["peak"] <= 0.45 * full["peak"], (nf4, full)


def test_nf4_equals_peft_qlora_on_bitsandbytes_4bit_layers():
    """peft's own QLoRA: the backbone's linears as bitsandbytes `Linear4bit` (NF4, 64-weight blocks, no double
    quantization, fp32 compute: what runs on a CPU), peft's LoRA over them. bitsandbytes cannot hold 3-D expert
    stacks, so its side gets them dequantized from vela-ray's NF4, whose blocks it reads bitwise the same way (the
    first check). Over 3 steps both sides' losses agree to rel 1e-5, as with peft on the dequantized model."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))
    codes, state = quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    assert torch.equal(dequantize_4bit(codes, state), FORMATS["nf4"].dequantize(FORMATS["nf4"].quantize(w),
                                                                                 torch.float32))
    make_model = functools.partial(debug_model, "mixtral", seed=0, hidden_size=128, intermediate_size=128)
    pair = equivalence.build_pair(make_model, quantization=QuantizationSpec("nf4"), optim=OPTIM)

    qlora = round_trip_model(make_model(), QuantizationSpec("nf4", backbone=False))
    for parent, name, _ in quantizable_linears(qlora, QuantizationSpec("nf4")):
        linear = getattr(parent, name)
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=torch.float32, compress_statistics=False, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, compress_statistics=False,
                                         quant_type="nf4", blocksize=64)
        setattr(parent, name, layer.to("cpu"))  # quantized here, as on a move to a device
    qlora.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=BitsAndBytesConfig(...)) sets
    qlora = PeftModel.from_pretrained(qlora, pair.adapter_dir, is_trainable=True)
    assert any(type(m).__module__.startswith("peft.tuners.lora.bnb") for m in qlora.modules())
    bnb_pair = dataclasses.replace(pair, reference=qlora, ref_optimizer=make_adamw(
        [p for p in qlora.parameters() if p.requires_grad], OPTIM))
    ref_losses, vela_losses = run_both(pair, steps=3)
    qlora_losses = [equivalence.reference_step(bnb_pair, micro_batches(step), lr_at(OPTIM, step, 3))
                    for step in range(3)]
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(qlora_losses), torch.tensor(vela_losses), rtol=1e-5, atol=0)


def test_vela_place_sizes_capacities_by_the_bytes_of_a_quantized_expert(wide_model, tmp_path, capsys):
    """An expert of the wide debug Mixtral: [256, 128] + [128, 128] weights, 196608 B in fp32, 27648 B in NF4 (half a
    byte per weight and a 4-byte absmax per 64): 0.0003 GB per worker holds 10 of them."""
    from vela_ray.cli import main

    (tmp_path / "profile.json").write_text(json.dumps([[1 / 3] * 6] * 2))
    flags = ["place", "--profile", str(tmp_path / "profile.json"), "--bandwidths", "10,10,10", "--model",
             str(wide_model), "--time-budget", "0.2"]
    assert main([*flags, "--capacities", "4"]) == 0
    assert "frozen weights per expert: 0.20 MB (torch.float32)" in capsys.readouterr().out
    assert main([*flags, "--quantization", "nf4", "--memory", "0.0003"]) == 0
    out = capsys.readouterr().out
    assert "frozen weights per expert: 0.03 MB (nf4); 0.0003 GB per worker holds 10" in out
    assert main([*flags, "--memory", "1", "--capacities", "4"]) != 0
    assert "give --capacities or --memory, not both" in capsys.readouterr().err


@pytest.mark.job
def test_a_tiered_job_holds_uploads_and_computes_quantized_experts_equal_to_peft(wide_model, tmp_path, monkeypatch):
    """APTMoE's tiers over NF4 experts: the host keeps the parts, an upload moves them (0.28x of fp32's bytes per
    expert here: the speeds the workers report), the device tier dequantizes at use; equal to peft on the dequantized
    model. Speeds as if a device were there, so both tiers compute (as tests/unit/test_tiers.py does)."""
    from vela_ray.training import tiered as tiered_module
    from vela_ray.training.tiers import TierSpeeds

    measured = []

    def speeds(tiered):
        measured.append(sum(t.nbytes for t in tiered.upload_params(next(iter(tiered.shard.keys))).values()))
        return TierSpeeds(cpu_s_per_row=1e-5, device_s_per_row=1e-7, upload_bytes_per_s=1e8, bytes_per_expert=10**4)

    monkeypatch.setattr(tiered_module, "measure_speeds", speeds)
    _, summary = run_equal_to_peft(peft_job(wide_model, tmp_path, steps=2, model={"quantization": {"format": "nf4"}},
                                            cluster={"num_workers": 2},
                                            expert_tiers={"enabled": True, "cache_experts": 3}))
    assert measured and set(measured) == {FORMATS["nf4"].nbytes((256, 128)) + FORMATS["nf4"].nbytes((128, 128))}
    for stats in summary.expert_tiers:
        assert stats.experts_cpu > 0 and stats.experts_device > 0 and stats.uploads > 0


def test_a_shard_keeps_its_parts_only_where_its_module_holds_them():
    """Moving or pinning a shard replaces its buffers: the old parts must go (a GPU worker would otherwise keep a
    host copy of every expert), and the moved ones compute."""
    import gc
    import weakref

    pair = equivalence.build_pair(functools.partial(debug_model, "mixtral", seed=0, hidden_size=128,
                                                    intermediate_size=128), quantization=QuantizationSpec("nf4"))
    layer = next(iter(pair.trainers[0].shard.layers.values()))
    ids = torch.tensor(layer.expert_ids * 2)
    rows = torch.randn(len(ids), 128)
    before = layer(ids, rows).detach()
    old = {name: weakref.ref(t) for name, t in layer.module._buffers.items() if ":nf4:" in name}
    layer.module._apply(lambda t: t.clone())  # what .to(device) and pinning do to each buffer
    gc.collect()
    assert old and all(ref() is None for ref in old.values())
    torch.testing.assert_close(layer(ids, rows), before, rtol=0, atol=0)
