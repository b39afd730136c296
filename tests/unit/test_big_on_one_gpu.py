"""benchmarks/big_on_one_gpu.py (issue 18) at toy sizes on the CPU, so the GPU benchmark cannot rot where there
is no GPU; its offloaded peft baseline through accelerate's hooks (disk offload, the CPU executing); the
sizes its docstring states; and, `gpu`-marked, two real Mixtral-8x7B layers on a GPU (`make test-gpu`).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from benchmarks import big_on_one_gpu as bench
from benchmarks._harness import without_machine_paths

SETUPS = ("peft_offload", "vela_tiers", "vela_zo", "vela_streamed")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.job
def test_smoke_run_trains_every_setup_and_reports_the_tiers_and_the_stream(tmp_path):
    out = tmp_path / "big.json"
    argv = ["--device", "cpu", "--tiny", "--warmup", "1", "--steps", "2", "--offload-dir", str(tmp_path),
            "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == without_machine_paths("python benchmarks/big_on_one_gpu.py " + " ".join(argv))
    runs = result["results"]
    assert list(runs) == list(SETUPS)
    for name in SETUPS:
        run = runs[name]
        assert "error" not in run, run
        assert run["tokens_per_s"] > 0 and len(run["step_s"]) == 2
        assert run["peak_gpu_gib"] is None and run["peak_host_rss_gib"] > 0  # no GPU: host memory only
        # random weights, uniform next-token guesses: each loss is about ln(vocab 512) = 6.24
        assert all(abs(loss - math.log(512)) < 0.2 for loss in run["losses"])
    peft = runs["peft_offload"]["info"]
    assert peft["load"] == "from_pretrained" and "no GPU" in peft["note"]
    assert peft["device_map"]["layers"] == {"cpu": 2}
    assert not list(tmp_path.glob("big_on_one_gpu-*"))  # its checkpoint is gone with it
    # the tiered ExpertManager computed every routed row (2 x 32 tokens, top-2, 2 layers), on the CPU here
    tiers = runs["vela_tiers"]["tiers"]
    assert runs["vela_tiers"]["info"]["method"] == "first_order"
    assert tiers["per_step"]["rows_cpu"] + tiers["per_step"]["rows_device"] == 2 * 32 * 2 * 2
    assert tiers["cpu_s_per_row"] > 0 and tiers["device_s_per_row"] is None
    zo = runs["vela_zo"]
    assert zo["info"]["method"] == "zo"
    assert zo["tiers"]["per_step"]["rows_cpu"] == 2 * 2 * 32 * 2 * 2  # two forwards a step, no backward
    streamed = runs["vela_streamed"]
    assert streamed["losses"] == runs["vela_tiers"]["losses"]  # the same model and steps, its layers streamed
    assert 0 < streamed["info"]["peak_buffer_gb"] <= streamed["info"]["streamed_layers_gb"]
    assert set(result["ratios"]) >= {"vela_tiers/peft_offload", "vela_zo/peft_offload", "vela_streamed/peft_offload"}
    assert result["ratios"]["goal_met"] is None  # nothing offloaded on a CPU: not a measurement of the goal
    assert {p["paper"] for p in result["papers"]} == {"APTMoE (SC'24)", "ZO-Offloading"}


@pytest.mark.parametrize("load", ["from_pretrained", "dispatch"])
def test_offloaded_peft_trains_as_the_model_without_offload(load, tmp_path):
    """accelerate's hooks (layer 1 on disk, loaded for each forward) with the peft fix-ups: the same losses
    and LoRA as the model without offload, from the same adapter."""
    args = bench.parse_args(["--device", "cpu", "--tiny", "--offload-dir", str(tmp_path), "--peft-load", load])
    config, device = bench.mixtral_config(args), torch.device("cpu")
    plain = bench.build_peft_offload(config, torch.bfloat16, device, args)
    args.emulate_offload = True
    offloaded = bench.build_peft_offload(config, torch.bfloat16, device, args)
    try:
        assert offloaded.info["device_map"]["layers"] == {"cpu": 1, "disk": 1}
        # layer 1's LoRA (4 attention projections, 2 expert stacks) was on the meta device; its experts' hook moved
        assert offloaded.info["fixups"] == {"lora_factors_made_off_meta": 6, "experts_hooks_moved_to_peft_wrapper": 1}
        lora = {n: p for n, p in offloaded.model.named_parameters() if p.requires_grad}
        reference = {n: p for n, p in plain.model.named_parameters() if p.requires_grad}
        assert lora.keys() == reference.keys() and all(p.device.type == "cpu" for p in lora.values())
        with torch.no_grad():
            for name, param in reference.items():
                param.normal_(std=0.02)  # B non-zero, so every factor gets a gradient in step 1
                lora[name].copy_(param)
        ids = torch.randint(config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        for _ in range(2):
            assert offloaded.step(batch) == pytest.approx(plain.step(batch), abs=1e-6)
        for name, param in reference.items():
            torch.testing.assert_close(lora[name], param, rtol=0, atol=1e-6, msg=name)
        experts = offloaded.model.base_model.model.model.layers[1].mlp.experts.get_base_layer()
        assert experts.gate_up_proj.is_meta  # offloaded again after the step
    finally:
        plain.close()
        offloaded.close()


def test_the_sizes_in_the_docstring():
    """Mixtral-8x7B at 32 layers is 93.4 GB in bf16 (352 MB an expert, 3.2 GB the rest); the default budget of
    40 GiB leaves the vela setups a cache of 49 experts after ~21 GB of estimated activations (meta tensors) and
    the largest device call's working set."""
    args = bench.parse_args([])
    config = bench.mixtral_config(args)
    backbone, expert = bench.model_bytes(config, torch.bfloat16)
    assert expert == 3 * 4096 * 14336 * 2
    assert (backbone + 32 * 8 * expert) / 1e9 == pytest.approx(93.4, abs=0.05)
    assert backbone / 1e9 == pytest.approx(3.2, abs=0.05)
    cache, sums = bench.cache_experts_for(args, config, torch.bfloat16)
    assert cache == 49 and sums["activations_gb_estimate"] == pytest.approx(20.9, abs=0.1)
    # the slack is the largest device call's working set (a layer's 4096 routed rows, 1.11 GB, and its 8
    # experts' LoRA factors, 0.02 GB) plus 64 MiB of kernels' workspace, not a constant: it grows with the batch
    assert sums["working_gb"] == pytest.approx(1.1076 + 0.0197 + 0.0671, abs=1e-3)
    assert bench.cache_experts_for(bench.parse_args(["--batch", "8"]), config, torch.bfloat16)[1]["working_gb"] == (
        pytest.approx(2 * 1.1076 + 0.0197 + 0.0671, abs=1e-3))
    assert bench.cache_experts_for(bench.parse_args(["--cache-experts", "7"]), config, torch.bfloat16)[0] == 7


def test_without_cuda_it_exits_2_with_one_line_naming_the_fix(capsys, monkeypatch):
    """A GPU benchmark that passes on a machine without a GPU hides a broken CUDA: it must fail."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "no CUDA device" in captured.err and "--device cpu" in captured.err


def test_a_failing_setup_is_recorded_and_the_next_ones_run_with_the_json_already_on_disk(tmp_path, monkeypatch):
    out = tmp_path / "big.json"
    on_disk_when_vela_ran = []

    def broken(*args):
        raise RuntimeError("cudaErrorLaunchFailure\nsecond line")

    real_run = bench.VelaHost.run

    def run_after_reading_the_json(self, method):
        on_disk_when_vela_ran.append(json.loads(out.read_text())["results"])
        return real_run(self, method)

    monkeypatch.setattr(bench, "build_peft_offload", broken)
    monkeypatch.setattr(bench.VelaHost, "run", run_after_reading_the_json)
    argv = ["--device", "cpu", "--tiny", "--warmup", "0", "--steps", "1", "--offload-dir", str(tmp_path),
            "--out", str(out), "--setups", "peft_offload", "vela_tiers", "vela_zo"]
    assert bench.main(argv) == 0
    assert [list(r) for r in on_disk_when_vela_ran] == [["peft_offload"], ["peft_offload", "vela_tiers"]]
    assert on_disk_when_vela_ran[0]["peft_offload"]["error"] == "RuntimeError: cudaErrorLaunchFailure"
    runs = json.loads(out.read_text())["results"]
    assert runs["peft_offload"]["error"] == "RuntimeError: cudaErrorLaunchFailure"
    assert runs["vela_tiers"]["tokens_per_s"] > 0 and runs["vela_zo"]["tokens_per_s"] > 0
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.gpu
def test_two_real_layers_on_the_gpu_offload_and_tier(tmp_path):
    """Two Mixtral-8x7B layers (6.3 GB) under a 4 GiB budget: peft_offload offloads layers to the CPU; the
    vela setups cache 8 of the 16 experts on the GPU and upload the others as Eq. 1 asks."""
    torch.set_num_threads(os.cpu_count() or 1)  # CPU experts at real size: every core (the fixture restores the count)
    out = tmp_path / "big.json"
    argv = ["--layers", "2", "--gpu-memory", "4", "--cache-experts", "8", "--warmup", "1", "--steps", "2",
            "--offload-dir", str(tmp_path), "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    runs = result["results"]
    for name in SETUPS:
        assert "error" not in runs[name], runs[name]
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["peak_gpu_gib"] > 0
    assert runs["peft_offload"]["info"]["device_map"]["layers"].get("cpu", 0) >= 1
    assert runs["peft_offload"]["info"]["fixups"]["lora_factors_made_off_meta"] > 0
    for name in ("vela_tiers", "vela_zo"):
        tiers = runs[name]["tiers"]
        assert tiers["device_s_per_row"] > 0 and tiers["upload_gb_per_s"] > 0
        assert tiers["per_step"]["rows_device"] > 0 and tiers["per_step"]["uploads"] > 0, tiers
    assert result["ratios"]["goal_met"] is not None
