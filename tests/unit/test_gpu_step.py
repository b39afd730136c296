"""benchmarks/gpu_step.py at toy sizes on the CPU, so the GPU benchmark cannot rot where there is no GPU.

The setups without Ray here (peft, vela-ray with its experts in the master's process); the one with
CPU ExpertManager actors is tests/ray/test_gpu_step.py, the whole command on a GPU is `make test-gpu`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_gpu_step():
    """The benchmark script as a module (benchmarks/ is not a package)."""
    if "gpu_step" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "benchmarks" / "gpu_step.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_step"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_step"]


def test_smoke_run_trains_both_models_with_peft_and_with_vela_experts_in_process(tmp_path):
    out = tmp_path / "gpu_step.json"
    argv = ["--device", "cpu", "--tiny", "--setups", "peft", "vela_gpu", "--warmup", "0", "--steps", "1",
            "--out", str(out)]
    assert load_gpu_step().main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python benchmarks/gpu_step.py " + " ".join(argv)
    for model in ("olmoe", "qwen3"):
        for setup in ("peft", "vela_gpu"):
            run = result["results"][model][setup]
            assert run["tokens_per_s"] > 0 and len(run["step_s"]) == 1
            assert run["peak_gpu_gib"] is None  # no GPU, no GPU memory
            # random weights, uniform next-token guesses: each loss is about ln(vocab 512) = 6.24
            assert all(abs(loss - math.log(512)) < 0.2 for loss in run["losses"])


def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_gpu_step().main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out and "--device cpu --tiny" in out
