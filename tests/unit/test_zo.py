"""Zeroth-order training (`training.method: zo`, vela_ray.training.zo) against MeZO in one process.

The reference is plain transformers + peft on the tiny debug Mixtral: MeZO's loop (perturb +εz,
forward, −2εz, forward, restore, step) with z of each peft tensor built from the per-tensor noise
rule; expert factors are peft's fused matrices, assembled from each logical expert's z as
`fuse_expert_factors` lays them out. vela-ray runs the same steps with the experts split over
workers that each draw their own experts' z, and the update fused into the next step's first pass.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import ParamWrapper
from safetensors.torch import load_file

from placement import sequential_table
from tests.equivalence import micro_batches, scattered_placement
from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.model.adapters import full_lora_config, fuse_expert_factors
from vela_ray.model.experts import LoraSpec, slot_name
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.observability.metrics import MemoryMetricsBackend, MetricsSink
from vela_ray.observability.report import summary_text
from vela_ray.training.optim import zo_noise
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.adapter_io import export, import_adapter
from vela_ray.training.master import build_local
from vela_ray.training.zo import ZoTrainer, step_seed

LORA = LoraSpec(r=4, alpha=8)
# ZO divides the loss difference by 2ε, so float noise in a forward is amplified: vela's expert math and
# peft's fold may round a loss near 4.8 one fp32 ulp apart (4.8e-7), 2.4e-5 of g at ε = 1e-2, at most
# lr * 2.4e-5 * |z| ~ 1e-6 in an adapter entry per step (measured: 2.8e-6 of a tensor's scale after 4 steps).
# The default ε = 1e-3 makes that 10x larger, too close to the 1e-5 tolerance.
EPS, LR, SEED, STEPS = 1e-2, 1e-2, 7, 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def adapter_dir() -> str:
    """A random adapter (non-zero B) both sides start from."""
    model = debug_model("mixtral", seed=0)
    cfg = full_lora_config(model, LORA)
    cfg.init_lora_weights = False
    torch.manual_seed(1)
    out = tempfile.mkdtemp(prefix="vela-zo-")
    get_peft_model(model, cfg).save_pretrained(out)
    return out


# --- the reference: MeZO on transformers + peft ---------------------------------------------------------------


def reference_model(adapter_dir: str) -> PeftModel:
    return PeftModel.from_pretrained(debug_model("mixtral", seed=0), adapter_dir, is_trainable=True)


def reference_noise(model, seed: int) -> dict[str, torch.Tensor]:
    """z of every trainable peft tensor in step `seed`: a backbone tensor's by its own name; an experts
    module's fused lora_A [r*E, in] / lora_B [out, r*E] from each logical expert's z ("l{layer}.e{e}...")."""
    layer_of = {b.experts_path: b.index for b in find_moe_blocks(debug_model("mixtral"))}  # MoE layer numbers
    z = {name: zo_noise(seed, name, p) for name, p in model.named_parameters() if p.requires_grad}
    for name, module in model.named_modules():
        if not isinstance(module, ParamWrapper):
            continue
        layer = layer_of[re.sub(r"^base_model\.model\.|(\.base_layer)+$", "", name)]
        slot = slot_name(module.parameter_name)
        fused_A, fused_B = module.lora_A["default"].weight, module.lora_B["default"].weight
        num_experts = fused_A.shape[0] // LORA.r
        A_like, B_like = torch.empty(LORA.r, fused_A.shape[1]), torch.empty(fused_B.shape[0], LORA.r)
        per_expert = [(zo_noise(seed, f"l{layer}.e{e}.lora_A_{slot}", A_like),
                       zo_noise(seed, f"l{layer}.e{e}.lora_B_{slot}", B_like)) for e in range(num_experts)]
        z[f"{name}.lora_A.default.weight"], z[f"{name}.lora_B.default.weight"] = fuse_expert_factors(per_expert)
    return z


def full_reference_noise(model, seed: int) -> dict[str, torch.Tensor]:
    """z of every floating tensor of the peft model (full-parameter ZO): the adapter's as `reference_noise`; a
    frozen backbone tensor's by its own name; an experts module's weight stack [E, ...] from each logical
    expert's z ("l{layer}.e{e}.{stack}"), stacked."""
    layer_of = {b.experts_path: b.index for b in find_moe_blocks(debug_model("mixtral"))}
    z = reference_noise(model, seed)
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        module, _, stack = re.sub(r"^base_model\.model\.|\.base_layer", "", name).rpartition(".")
        z[name] = (torch.stack([zo_noise(seed, f"l{layer_of[module]}.e{e}.{stack}", p[e]) for e in range(len(p))])
                   if module in layer_of else zo_noise(seed, name, p))
    return z


def mezo_reference(model, steps: int, full: bool = False, lr: float = LR
                   ) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """MeZO's ZO-SGD, one pass per perturbation, on the adapter or (`full`) on every tensor; returns (L+, L−) per
    step and the final adapter (`full`: every tensor, by peft name)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad or full}
    model.eval()

    def loss(batches) -> float:
        with torch.no_grad():
            return sum(float(model(**b).loss / len(batches)) for b in batches)

    def add(z, coefficient):
        with torch.no_grad():
            for name, p in params.items():
                p.add_(z[name], alpha=coefficient)

    losses = []
    for step in range(steps):
        batches = micro_batches(step)
        z = (full_reference_noise if full else reference_noise)(model, step_seed(SEED, step))
        add(z, EPS)
        plus = loss(batches)
        add(z, -2 * EPS)
        minus = loss(batches)
        add(z, EPS)
        add(z, -lr * (plus - minus) / (2 * EPS))
        losses.append((plus, minus))
    if full:
        return losses, {name: p.detach().clone() for name, p in params.items()}
    return losses, {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}


# --- vela-ray --------------------------------------------------------------------------------------------------


def vela(adapter_dir: str, table):
    master, workers = build_local(debug_model("mixtral", seed=0), table, LORA, OptimizerConfig())
    import_adapter(master, workers, adapter_dir)
    return master, workers


def vela_zo(master, workers, steps: int, settle_every_step: bool = False, parameters: str = "lora",
            lr: float = LR):
    zo = ZoTrainer(EPS, SEED, parameters)
    results = []
    for step in range(steps):
        results.append(zo.step(master, workers, micro_batches(step), lr, step))
        if settle_every_step:
            zo.settle(master, workers)
    zo.settle(master, workers)
    return results


def exported(master, workers) -> dict[str, torch.Tensor]:
    out = tempfile.mkdtemp(prefix="vela-zo-export-")
    export(master, workers, out)
    return load_file(f"{out}/adapter_model.safetensors")


def test_zo_equals_mezo_on_peft_under_two_placements(adapter_dir):
    ref_losses, ref_state = mezo_reference(reference_model(adapter_dir), STEPS)
    initial = get_peft_model_state_dict(reference_model(adapter_dir))
    # experts scattered over 3 workers, and in sequential blocks over 2: each worker draws its own experts' z
    for table in (scattered_placement(2, 6, 3), sequential_table(2, 6, 2)):
        master, workers = vela(adapter_dir, table)
        results = vela_zo(master, workers, STEPS)
        torch.testing.assert_close(torch.tensor([(r.loss_plus, r.loss_minus) for r in results]),
                                   torch.tensor(ref_losses), rtol=1e-5, atol=0)
        state = exported(master, workers)
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            # relative to the tensor's scale (entries near 0 have no relative precision); a z drawn for the
            # wrong tensor or expert moves entries by lr * g * |z| ~ 1e-2 of it
            scale = float(value.abs().max())
            assert float((state[key] - value).abs().max()) <= 1e-5 * scale, key
            assert float((value - initial[key]).abs().max()) >= 1e-2 * scale, f"{key} did not train"
        moved = torch.tensor(master.dispatcher.traffic().bytes)  # forwards only: no gradient rows, no graphs kept
        assert moved[:, :, :2].sum() > 0 and moved[:, :, 2:].sum() == 0
        assert all(not m.shard._saved for m in master.dispatcher.transport.shards)


def test_fused_update_ends_with_the_bits_of_settling_after_every_step(adapter_dir):
    """§5.3's fusion changes how many passes there are, not the numbers: a run that settles for a checkpoint
    after every step ends with exactly the adapters and losses of one that never settles."""
    fused_master, fused_workers = vela(adapter_dir, scattered_placement(2, 6, 3))
    fused = vela_zo(fused_master, fused_workers, 3)
    plain_master, plain_workers = vela(adapter_dir, scattered_placement(2, 6, 3))
    plain = vela_zo(plain_master, plain_workers, 3, settle_every_step=True)
    assert fused == plain
    a, b = exported(fused_master, fused_workers), exported(plain_master, plain_workers)
    assert all(torch.equal(a[k], b[k]) for k in a)


FULL_LR = 1e-4  # every weight moves: MeZO's full-parameter learning rates are ~100x its LoRA ones


def vela_full_state(master) -> dict[str, torch.Tensor]:
    """Every tensor vela-ray trained, named as in the full peft model: the master's by peft name, each worker's
    expert stacks (frozen slices and LoRA factors) put back together as peft's tensors."""
    state = {name: p.detach().clone() for name, p in master.peft_model.named_parameters()}
    layer_of = {b.experts_path: b.index for b in find_moe_blocks(debug_model("mixtral"))}
    hosted = {key: tensors for manager in master.dispatcher.transport.shards
              for key, tensors in manager.shard.weights().items()}
    reference = reference_model_names()
    for name, shape in reference.items():
        module, _, stack = re.sub(r"^base_model\.model\.|\.base_layer", "", name).rpartition(".")
        if module in layer_of and "lora_" not in name:
            state[name] = torch.stack([hosted[(layer_of[module], e)][stack] for e in range(shape[0])])
    return state


def reference_model_names() -> dict[str, torch.Size]:
    model = get_peft_model(debug_model("mixtral", seed=0), full_lora_config(debug_model("mixtral"), LORA))
    return {name: p.shape for name, p in model.named_parameters()}


def test_full_parameter_zo_equals_mezo_on_every_weight_under_two_placements(adapter_dir):
    """`zo.parameters: full`: the frozen weights are perturbed and stepped too, the master's backbone by peft name,
    each worker's expert stacks expert by expert, and the run equals MeZO over every tensor of the peft model."""
    ref_losses, ref_state = mezo_reference(reference_model(adapter_dir), STEPS, full=True, lr=FULL_LR)
    initial = {name: p.detach().clone() for name, p in reference_model(adapter_dir).named_parameters()}
    for table in (scattered_placement(2, 6, 3), sequential_table(2, 6, 2)):
        master, workers = vela(adapter_dir, table)
        results = vela_zo(master, workers, STEPS, parameters="full", lr=FULL_LR)
        torch.testing.assert_close(torch.tensor([(r.loss_plus, r.loss_minus) for r in results]),
                                   torch.tensor(ref_losses), rtol=1e-5, atol=0)
        ours, adapter = vela_full_state(master), exported(master, workers)
        for name, value in ref_state.items():
            if "lora_" in name and "experts" in name:  # fused expert factors: compared through the export below
                continue
            scale = float(value.abs().max())
            assert float((ours[name] - value).abs().max()) <= 1e-5 * scale, name
            assert not torch.equal(value, initial[name]), f"{name} did not train"
        for key, value in get_peft_model_state_dict(_loaded(adapter_dir, ref_state)).items():
            assert float((adapter[key] - value).abs().max()) <= 1e-5 * float(value.abs().max()), key


def _loaded(adapter_dir: str, state: dict[str, torch.Tensor]):
    model = reference_model(adapter_dir)
    model.load_state_dict(state, strict=False)
    return model


def test_noise_is_a_function_of_step_seed_and_name_only():
    like = torch.empty(3, 5)
    z = zo_noise(11, "l0.e3.lora_A_down", like)
    assert torch.equal(z, zo_noise(11, "l0.e3.lora_A_down", torch.zeros(3, 5, dtype=torch.float64)).float())
    assert not torch.equal(z, zo_noise(11, "l0.e4.lora_A_down", like))
    assert not torch.equal(z, zo_noise(12, "l0.e3.lora_A_down", like))
    assert step_seed(0, 1) != step_seed(0, 2) and step_seed(0, 1) != step_seed(1, 1)


# --- a whole job ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


def _run(job: dict) -> tuple:
    backend = MemoryMetricsBackend()
    config = JobConfig.from_dict(job)
    return run_in_process(config, metrics=MetricsSink(backend)), backend


@pytest.mark.job
def test_a_zo_job_reports_zo_moves_no_gradients_and_checkpoints_unperturbed_adapters(model_dir, tmp_path):
    job = job_dict(model_dir, tmp_path / "full", steps=3, checkpoint={"every": 2, "keep": 5},
                   training={"method": "zo", "zo": {"eps": 1e-3}, "optimizer": {"lr": 1e-2}})
    summary, metrics = _run(job)
    assert summary.method == "zo" and summary.steps == 3
    assert "3 zeroth-order (ZO-SGD) steps" in summary_text(summary).splitlines()[0]
    by_direction: dict[str, float] = {}
    for tags, nbytes in metrics.counters["vela_expert_traffic_bytes_total"].items():
        by_direction[dict(tags)["direction"]] = by_direction.get(dict(tags)["direction"], 0.0) + nbytes
    assert by_direction.keys() == {"dispatch", "gather"}  # no grad_dispatch / grad_gather recorded

    # step 2's checkpoint holds θ_2 itself (no pending update, no perturbation): resuming it ends as the full run
    job["output"]["dir"] = str(tmp_path / "resumed")
    job["checkpoint"]["dir"] = str(tmp_path / "full" / "checkpoints")
    job["checkpoint"]["resume"] = str(tmp_path / "full" / "checkpoints" / "step-000002")
    resumed, _ = _run(job)
    assert resumed.losses == summary.losses  # steps 1-2 from the checkpoint's record, the rest trained again
    full = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    again = load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(full[k], again[k]) for k in full)


@pytest.mark.parametrize("section, value, message", [
    ("masters", {"count": 2}, r"training.method: zo and several master processes .* Fix: use masters.count: 1"),
    ("fault_tolerance", {"on_worker_loss": "recover"},
     r"zo and fault_tolerance.on_worker_loss: recover do not combine: .* Fix: use on_worker_loss: stop"),
    ("training", {"condensation": {"enabled": True}}, r"zo and training.condensation.enabled do not combine"),
])
def test_zo_refuses_what_it_does_not_support(model_dir, tmp_path, section, value, message):
    job = job_dict(model_dir, tmp_path, training={"method": "zo"})
    job[section] = {**job.get(section, {}), **value}
    with pytest.raises(ValueError, match=message):
        JobConfig.from_dict(job)


@pytest.mark.job
def test_a_full_parameter_zo_job_resumes_by_replaying_its_trajectory(model_dir, tmp_path):
    """A checkpoint keeps the adapters and the steps' (lr, projected gradient); resuming one loads the base weights
    and replays the trajectory onto them, so the resumed run ends with the full run's losses, eval loss (which reads
    every weight) and adapter, bit for bit."""
    training = {"method": "zo", "zo": {"eps": 1e-2, "parameters": "full"}, "optimizer": {"lr": FULL_LR}}
    job = job_dict(model_dir, tmp_path / "full", steps=3, checkpoint={"every": 2, "keep": 5}, training=training)
    summary, _ = _run(job)
    assert "3 zeroth-order (ZO-SGD, every weight) steps" in summary_text(summary).splitlines()[0]
    saved = json.loads((tmp_path / "full" / "stepper.json").read_text())
    assert saved["parameters"] == "full" and len(saved["trajectory"]) == 3
    job["output"]["dir"] = str(tmp_path / "resumed")
    job["checkpoint"]["dir"] = str(tmp_path / "full" / "checkpoints")
    job["checkpoint"]["resume"] = str(tmp_path / "full" / "checkpoints" / "step-000002")
    resumed, _ = _run(job)
    assert resumed.losses == summary.losses and resumed.eval_loss == summary.eval_loss
    assert json.loads((tmp_path / "resumed" / "stepper.json").read_text()) == saved
    full = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    again = load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(full[k], again[k]) for k in full)


@pytest.mark.parametrize("extra, message", [
    ({"model": {"quantization": {"format": "int8"}}}, r"parameters: full and model.quantization do not combine"),
    ({"placement": {"replan": {"every": 2}}}, r"parameters: full and placement.replan.every above 0 do not combine"),
])
def test_full_parameter_zo_refuses_what_would_lose_its_weights(model_dir, tmp_path, extra, message):
    job = job_dict(model_dir, tmp_path, training={"method": "zo", "zo": {"parameters": "full"}})
    for section, value in extra.items():
        job[section] = {**job.get(section, {}), **value}
    with pytest.raises(ValueError, match=message):
        JobConfig.from_dict(job)


def test_a_replay_holds_one_step_noise_at_a_time(monkeypatch):
    """Resuming full-parameter ZO replays every step's terms in one pass: each seed's noise is drawn once and dropped
    after its last term, so a tensor never holds more than one step's noise beside it (not thousands)."""
    import weakref

    from vela_ray.training import optim
    from vela_ray.training.zo import replayed_terms

    alive, most, draws = [], [0], [0]
    drawn = optim.zo_noise

    def counted(seed, name, like):
        noise = drawn(seed, name, like)
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive))  # noises still held when a new one is drawn
        alive.append(weakref.ref(noise))
        draws[0] += 1
        return noise

    monkeypatch.setattr(optim, "zo_noise", counted)
    tensor = torch.zeros(4, 4)
    optim.apply_zo_terms({"w": tensor}, replayed_terms(0, 1e-3, [(1e-2, 0.5)] * 5))
    assert draws[0] == 5 and most[0] == 0  # one draw per step, none kept past its step
