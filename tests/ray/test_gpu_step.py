"""benchmarks/gpu_step.py's setup with the experts on CPU ExpertManager actors (gloo data plane), at toy
sizes on the CPU; and the whole command at toy sizes on a GPU (`make test-gpu`)."""

from __future__ import annotations

import json
import math

import pytest

from tests.scripts import load_script


def test_smoke_run_with_the_experts_on_two_cpu_expert_managers(ray_session, tmp_path):
    out = tmp_path / "gpu_step.json"
    argv = ["--device", "cpu", "--tiny", "--models", "olmoe", "--setups", "vela_cpu_workers", "--worker-cpus", "1",
            "--warmup", "0", "--steps", "2", "--out", str(out)]
    assert load_script("benchmarks/gpu_step.py").main(argv) == 0
    run = json.loads(out.read_text())["results"]["olmoe"]["vela_cpu_workers"]
    assert run["tokens_per_s"] > 0 and len(run["step_s"]) == 2
    assert all(abs(loss - math.log(512)) < 0.2 for loss in run["losses"])


@pytest.mark.gpu
def test_every_setup_runs_on_the_gpu_and_reports_its_memory(ray_session, tmp_path):
    out = tmp_path / "gpu_step.json"
    assert load_script("benchmarks/gpu_step.py").main(["--device", "cuda", "--tiny", "--worker-cpus", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    for model in ("olmoe", "qwen3"):
        for setup in ("peft", "vela_gpu", "vela_cpu_workers"):
            run = results[model][setup]
            assert "error" not in run, run
            assert run["tokens_per_s"] > 0 and run["peak_gpu_gib"] > 0
