"""benchmarks/gpu_step.py at toy sizes on the CPU, so the GPU benchmark cannot rot where there is no GPU.

The setups without Ray here (peft, vela-ray with its experts in the master's process); the one with
CPU ExpertManager actors is tests/ray/test_gpu_step.py, the whole command on a GPU is `make test-gpu`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks._harness import without_machine_paths
from tests.scripts import ROOT, load_script


@pytest.mark.job
def test_smoke_run_trains_both_models_with_peft_and_with_vela_experts_in_process(tmp_path):
    out = tmp_path / "gpu_step.json"
    argv = ["--device", "cpu", "--tiny", "--setups", "peft", "vela_gpu", "--warmup", "0", "--steps", "1",
            "--out", str(out)]
    assert load_script("benchmarks/gpu_step.py").main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == without_machine_paths("python benchmarks/gpu_step.py " + " ".join(argv))
    for model in ("olmoe", "qwen3"):
        for setup in ("peft", "vela_gpu"):
            run = result["results"][model][setup]
            assert run["tokens_per_s"] > 0 and len(run["step_s"]) == 1
            assert run["peak_gpu_gib"] is None  # no GPU, no GPU memory
            # random weights, uniform next-token guesses: each loss is about ln(vocab 512) = 6.24
            assert all(abs(loss - math.log(512)) < 0.2 for loss in run["losses"])


def test_without_cuda_it_exits_2_with_one_line_naming_the_fix(capsys, monkeypatch):
    """A GPU benchmark that passes on a machine without a GPU hides a broken CUDA: it must fail."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_script("benchmarks/gpu_step.py").main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "no CUDA device" in captured.err and "--device cpu" in captured.err


@pytest.mark.slow
def test_the_command_without_cuda_exits_non_zero():
    """The script as `make gpu-check` runs it, CUDA hidden (so the same on a GPU machine)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--setups", "peft"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr and "--device cpu" in done.stderr


def test_a_failing_setup_is_recorded_and_the_next_one_runs_with_the_json_already_on_disk(tmp_path, monkeypatch):
    gpu_step = load_script("benchmarks/gpu_step.py")
    out = tmp_path / "gpu_step.json"
    on_disk_when_vela_built = {}

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    def vela_after_reading_the_json(*args):
        on_disk_when_vela_built.update(json.loads(out.read_text()))
        return gpu_step.build_vela(*args, cpu_workers=False)

    monkeypatch.setitem(gpu_step.BUILDERS, "peft", broken)
    monkeypatch.setitem(gpu_step.BUILDERS, "vela_gpu", vela_after_reading_the_json)
    argv = ["--device", "cpu", "--tiny", "--models", "olmoe", "--setups", "peft", "vela_gpu", "--warmup", "0",
            "--steps", "1", "--out", str(out)]
    assert gpu_step.main(argv) == 0
    error = {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert on_disk_when_vela_built["results"] == {"olmoe": {"peft": error}}  # written before the next setup
    runs = json.loads(out.read_text())["results"]["olmoe"]
    assert runs["peft"] == error and runs["vela_gpu"]["tokens_per_s"] > 0
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write's temporary file is renamed, not left


def test_a_layer_count_qwen3_lacks_fails_the_command_not_each_setup():
    with pytest.raises(SystemExit):
        load_script("benchmarks/gpu_step.py").parse_args(["--layers", "49"])
