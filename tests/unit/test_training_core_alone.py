"""The training core runs with torch, transformers, peft, safetensors, numpy, pydantic and pyyaml only (issue 45):
a bare GPU node has no Ray, cvxpy, datasets or matplotlib, and the GPU battery must still run there.

Each test runs Python in a subprocess whose `sitecustomize` makes the cluster's packages unimportable
(`sys.modules[name] = None`: `import ray` raises, `importlib.util.find_spec("ray")` is None, as where it is
not installed), inherited by every process it starts: a whole in-process job (placement by the improved
solver's greedy start, a report without charts) and the battery's CPU form.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.scripts import ROOT

ABSENT = ("ray", "datasets", "pyarrow", "pandas", "cvxpy", "highspy", "scipy", "matplotlib", "mlflow", "wandb",
          "tensorboard")

JOB = '''
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from pathlib import Path
from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from placement import build_problem, solve, synthetic_probs

out = Path(sys.argv[1])
job = job_dict(make_checkpoint(out / "model"), out / "run", steps=2,
               placement={"solver": "improved", "profile": "measure", "profile_batches": 2})
config = JobConfig.from_dict(job)
config.preflight()
summary = run_in_process(config)
try:
    solve(build_problem(probs=synthetic_probs(2, 4, 2, concentration=1.0), top_k=2, tokens_per_step=64,
                        hidden_size=16, bandwidths=[1e9, 1e9], capacities=[4, 4]), "vela")
    refused = None
except ValueError as exc:
    refused = str(exc)
loaded = sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] in ABSENT_NAMES)
print(json.dumps({"losses": summary.losses, "lower_bound_s": summary.placement.lower_bound_s,
                  "solver": summary.placement.solver, "vela_refused": refused, "loaded": loaded}))
'''.replace("ABSENT_NAMES", repr(set(ABSENT)))


def without_cluster_packages(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import `ABSENT` (a `sitecustomize` on PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        for name in {ABSENT!r}:
            sys.modules[name] = None
    """))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "CUDA_VISIBLE_DEVICES": ""}


def test_the_blocking_itself_holds(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import importlib.util as u; import ray"], cwd=tmp_path,
                          env=without_cluster_packages(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "import of ray halted" in done.stderr


@pytest.mark.job
def test_a_two_step_in_process_job_needs_no_ray_datasets_cvxpy_or_matplotlib(tmp_path):
    done = subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], cwd=ROOT, env=without_cluster_packages(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["losses"]) == 2 and all(loss > 0 for loss in result["losses"])
    assert result["loaded"] == []
    # placement: the improved solver's greedy start, without the LP's bound, said in one log line
    assert result["solver"] == "improved" and result["lower_bound_s"] is None
    assert "cvxpy/highspy not installed, so the improved solver starts from the greedy construction" in done.stderr
    assert result["vela_refused"].startswith("placement.solver: vela solves the paper's LP with cvxpy and highspy")
    # the report is written, its charts' places say why they are empty
    report = (tmp_path / "run" / "report.html").read_text()
    assert report.count("Chart left out: matplotlib is not installed") == 4 and "<svg" not in report
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def battery_run(tmp_path: Path) -> tuple[list[str], dict, Path]:
    """The battery's CPU form without the cluster packages: (command, `Popen`'s keywords, its report's path)."""
    out = tmp_path / "gpu" / "battery.json"
    return ([sys.executable, "scripts/gpu_check.py", "--battery", "--allow-cpu", "--out", str(out)],
            {"cwd": ROOT, "env": without_cluster_packages(tmp_path), "stdout": subprocess.PIPE,
             "stderr": subprocess.PIPE}, out)


@pytest.mark.job
@pytest.mark.slow
def test_the_battery_s_cpu_form_runs_without_the_cluster_packages(request, tmp_path):
    """`scripts/gpu_check.py --battery --allow-cpu`: every part in its CPU form, none importing Ray, cvxpy,
    datasets or matplotlib, within the battery's budget. CI's run started it in the background while Ray's tests
    ran (`conftest.pytest_collection_finish`): its result is taken here."""
    started = getattr(request.config, "battery_cpu_form", None)
    if started is not None:
        future, out = started
        done = future.result(timeout=900)
    else:
        command, popen, out = battery_run(tmp_path)
        done = subprocess.run(command, text=True, timeout=900, **popen)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert list(parts) == ["env", "exactness", "speed", "tiers", "nccl"] and report["ok"] is True
    assert {name: p["status"] for name, p in parts.items()} == {
        "env": "ok", "exactness": "ok", "speed": "ok", "tiers": "ok", "nccl": "skipped"}
    assert report["seconds"] < report["budget_s"] == 360
    packages = parts["env"]["facts"]["packages"]
    assert packages["torch"] and packages["peft"] and packages["pydantic"]
    exactness = json.loads((out.parent / "exactness.json").read_text())["results"]
    for family in ("mixtral", "qwen3_moe"):
        assert exactness[family]["fp32_job"]["max_rel_diff"] <= 1e-4
        assert exactness[family]["fp32_job"]["lower_bound_s"] is None  # the greedy start: no cvxpy
        assert exactness[family]["bf16_factors"]["status"] == "ok"
        assert exactness[family]["streamed_job"]["max_rel_diff"] <= 1e-4  # the backbone streamed through 2 slots
    assert "the same exchange over gloo on the CPU" in parts["nccl"]["reason"]
    assert parts["nccl"]["facts"]["gloo_smoke"] == {"backend": "gloo", "exact": True, "on_master_device": True}
