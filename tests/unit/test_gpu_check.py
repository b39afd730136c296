"""A GPU check that cannot pass empty (issue 33): VELA_REQUIRE_GPU=1 turns a skipped `gpu` test into a failure
(tests/conftest.py), and scripts/gpu_check.py (`make gpu-check`) fails without CUDA, records each part's
outcome and fails a part on a timeout, an exit code or a setup its benchmark records as an error. All on the
CPU: CUDA is hidden (CUDA_VISIBLE_DEVICES="") where a machine has it, so these say the same on a GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.scripts import ROOT, load_script

NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}

FAKE_TESTS = '''
import pytest

@pytest.mark.gpu
@pytest.mark.skip(reason="pretend the CUDA driver is broken")
def test_marker_skip():
    pass

@pytest.mark.gpu
def test_needs_cuda():
    pass

@pytest.mark.gpu
@pytest.mark.skip(reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
def test_two_gpus():
    pass

@pytest.mark.skip(reason="not a gpu test")
def test_other_skip():
    pass

def test_plain():
    pass
'''


def run_fake_tests(tmp_path: Path, require_gpu: bool) -> subprocess.CompletedProcess:
    """pytest on FAKE_TESTS with the repository's conftest as a plugin (`-p tests.conftest`), CUDA hidden: the
    machine with broken CUDA, where the conftest skips every `gpu` test."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    (tmp_path / "test_fake.py").write_text(textwrap.dedent(FAKE_TESTS))
    env = {**NO_CUDA, "PYTHONPATH": str(ROOT), "VELA_REQUIRE_GPU": "1" if require_gpu else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA",
                           "test_fake.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_without_require_gpu_skipped_gpu_tests_pass(tmp_path):
    done = run_fake_tests(tmp_path, require_gpu=False)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 4 skipped" in done.stdout


@pytest.mark.slow
def test_require_gpu_fails_each_skipped_gpu_test_naming_it_and_the_reason(tmp_path):
    done = run_fake_tests(tmp_path, require_gpu=True)
    assert done.returncode == 1, done.stdout
    out = done.stdout
    assert ("VELA_REQUIRE_GPU=1: the gpu test test_fake.py::test_marker_skip was skipped: "
            "pretend the CUDA driver is broken") in out
    assert ("VELA_REQUIRE_GPU=1: the gpu test test_fake.py::test_needs_cuda was skipped: needs a CUDA device "
            "(run `make test-gpu` on a GPU machine) (torch ") in out
    assert "1 passed, 2 skipped, 2 errors" in out  # a skip at setup (a marker) fails as an error
    # too few GPUs for a multi-GPU test, and skips of tests that are not `gpu`, stay skips
    assert re.search(r"SKIPPED \[1\] test_fake.py:\d+: NCCL refuses two ranks on one GPU: needs 2 GPUs", out)
    assert re.search(r"SKIPPED \[1\] test_fake.py:\d+: not a gpu test", out)


@pytest.mark.slow
def test_without_cuda_gpu_check_exits_2_with_one_line():
    done = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, env=NO_CUDA, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("gpu_check: no CUDA (") and "machine with a working CUDA GPU" in done.stderr


@pytest.mark.slow
def test_env_part_alone_on_the_cpu_writes_the_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--only", "env", "--allow-cpu", "--out",
                           str(out)], cwd=ROOT, env=NO_CUDA, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["cuda_available"] is False and report["ok"] is True and list(report["parts"]) == ["env"]
    env = report["parts"]["env"]
    assert env["status"] == "ok" and env["seconds"] > 0 and "no CUDA device" in env["reason"]
    facts = env["facts"]
    assert facts["torch"] == torch.__version__ and facts["cuda_available"] is False
    assert facts["nccl"] == {"status": "skipped", "reason": "no CUDA device"}
    grouped = facts["grouped_mm_bf16"]  # the kernel's CPU path: the check itself is exercised
    assert grouped["status"] == "ok" and grouped["device"] == "cpu" and grouped["empty_group_grad_zero"]
    assert not list(tmp_path.glob("*.tmp"))


def test_commands_the_results_record_name_no_machine_path():
    """The parts' JSONs are committed (benchmarks/results/gpu/): their commands name the results folder
    relative to the repository and the interpreter as `python`."""
    gpu_check = load_script("scripts/gpu_check.py")
    for each in gpu_check.PARTS:
        argv = each.argv(gpu_check.BATTERY_OUT.parent, cpu=False)
        assert not [arg for arg in argv[1:] if str(ROOT) in arg], argv
    assert "benchmarks/results/gpu/gpu_step.json" in gpu_check.PARTS[2].argv(gpu_check.BATTERY_OUT.parent, False)


def part(gpu_check, code: str, timeout_s: int = 60, results_json: str | None = None, cpu_args=None):
    return gpu_check.Part("fake", [sys.executable, "-c", code], timeout_s, results_json, cpu_args)


def test_a_part_fails_on_a_timeout_an_exit_code_or_a_setup_error(tmp_path, capsys):
    gpu_check = load_script("scripts/gpu_check.py")

    def run_part(part, left_s: float = 600):
        return gpu_check.run_part(part, tmp_path, False, left_s)
    slow = run_part(part(gpu_check, "import time; time.sleep(60)", timeout_s=6))
    assert slow["status"] == "failed" and slow["reason"] == "timed out after 6 s" and slow["seconds"] < 30

    crash = run_part(part(gpu_check, "import sys; print('Traceback\\nRuntimeError: CUDA error: "
                                     "unspecified launch failure', file=sys.stderr); sys.exit(3)"))
    assert crash["status"] == "failed"
    assert crash["reason"] == "exit 3: RuntimeError: CUDA error: unspecified launch failure"

    results = tmp_path / "bench.json"
    write = ("import json, sys; open(sys.argv[1], 'w').write(json.dumps({'results': {'olmoe': {"
             "'peft': {'error': 'out of GPU memory: 80 GiB'}, 'vela_gpu': {'tokens_per_s': 1.0}}}}))")
    bench = gpu_check.Part("fake", [sys.executable, "-c", write, str(results)], 60, results.name)
    failed = run_part(bench)  # exit 0, but a setup failed
    assert failed["status"] == "failed" and failed["reason"] == "olmoe/peft: out of GPU memory: 80 GiB"

    missing = run_part(part(gpu_check, "pass", results_json="never.json"))
    assert missing["status"] == "failed" and missing["reason"] == "no results JSON written"

    ok = run_part(part(gpu_check, "print('3 passed in 1.0s')"))
    assert ok["status"] == "ok" and ok["reason"] == "3 passed in 1.0s"
    assert "3 passed in 1.0s" in capsys.readouterr().out  # a part's output passes through


def test_the_budget_caps_each_part_and_a_part_without_time_or_a_cpu_form_is_not_run(tmp_path):
    gpu_check = load_script("scripts/gpu_check.py")
    capped = gpu_check.run_part(part(gpu_check, "import time; time.sleep(60)", timeout_s=600), tmp_path, False, 6)
    assert capped["reason"] == "timed out after 6 s" and capped["timeout_s"] == 6
    spent = gpu_check.run_part(part(gpu_check, "print('ran')"), tmp_path, False, 2)
    assert spent["status"] == "failed" and spent["reason"] == "not run: the check's time budget was spent"
    gpu_only = gpu_check.run_part(part(gpu_check, "print('ran')"), tmp_path, True, 600)
    assert gpu_only["status"] == "failed" and gpu_only["reason"] == "needs a CUDA device (this part has no CPU form)"
    cpu_form = gpu_check.run_part(part(gpu_check, "import sys; print(sys.argv[1:])", cpu_args=["--device", "cpu"]),
                                  tmp_path, True, 600)
    assert cpu_form["status"] == "ok" and cpu_form["reason"] == "['--device', 'cpu']"


def test_the_battery_is_every_part_but_the_ray_tests_within_its_budget():
    gpu_check = load_script("scripts/gpu_check.py")
    args = gpu_check.parse_args(["--battery"])
    assert args.only == ["env", "exactness", "speed", "tiers", "nccl"] and args.budget_s == 360
    assert args.out == gpu_check.ROOT / "benchmarks" / "results" / "gpu" / "battery.json"
    assert sum(p.timeout_s for p in gpu_check.PARTS if p.name in args.only) <= 360
    assert gpu_check.parse_args([]).only == [*args.only, "tests"]


def test_setup_errors_reads_both_benchmarks_shapes():
    gpu_check = load_script("scripts/gpu_check.py")
    assert gpu_check.setup_errors({"vela_tiers": {"tokens_per_s": 2.0, "info": {}},
                                   "vela_zo": {"error": "RuntimeError: x", "info": {}}}) == ["vela_zo: RuntimeError: x"]
    assert gpu_check.setup_errors({"qwen3": {"peft": {"tokens_per_s": 1.0}}}) == []
