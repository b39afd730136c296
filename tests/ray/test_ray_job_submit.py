"""`ray job submit ... -- vela train --config job.yaml` against a head started with `ray start`, token auth on;
and `vela train` beside such a head, with no address: a local Ray of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.fixtures import job_dict, make_checkpoint, write_job
from tests.ray.head import BIN_DIR, auth_env, free_port, ray_head

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


@pytest.fixture(scope="module")
def head() -> tuple[dict[str, str], int, int]:
    """One `ray start --head` (token auth, dashboard) for both tests: (its env, GCS port, dashboard port). The
    second test only needs some head running beside it; starting one costs several seconds of CI."""
    env = auth_env()
    env.pop("RAY_ADDRESS", None)
    gcs_port, dash_port = free_port(), free_port()
    with ray_head(env, f"--port={gcs_port}", f"--dashboard-port={dash_port}", "--num-cpus=4",
                  "--include-dashboard=true", wait_port=dash_port):
        yield env, gcs_port, dash_port


def test_ray_job_submit_runs_vela_train_and_writes_adapter_and_summary(head, model_dir, tmp_path):
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out", steps=2))
    env, _, dash_port = head
    submit = [str(BIN_DIR / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash_port}",
              "--working-dir", str(REPO), "--", "vela", "train", "--config", str(job)]
    for _ in range(60):  # the dashboard answers before its job agent is up ("try again later")
        result = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=480)
        if "No available agent to submit job" not in result.stdout + result.stderr:
            break
        time.sleep(1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout + result.stderr

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    adapter = tmp_path / "out" / "adapter"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)  # loads cleanly


def test_vela_train_without_an_address_starts_its_own_ray_beside_a_running_cluster(head, model_dir, tmp_path):
    """A `ray start --head` already up on the machine (recorded as the current cluster, as `ray start` records
    it): `vela train` with `cluster.address: null` and no RAY_ADDRESS starts a local Ray of its own instead of
    joining that one (which refused the CPUs it asks for: "When connecting to an existing cluster, num_cpus and
    num_gpus must not be provided"). RAY_TMPDIR keeps the record away from the machine's own /tmp/ray."""
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out", steps=2))
    env, gcs_port, _ = head
    ray_tmp = Path(tempfile.mkdtemp(prefix="vt", dir="/tmp"))  # short: Ray's socket paths under it
    try:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{gcs_port}")
        result = subprocess.run([str(BIN_DIR / "vela"), "train", "--config", str(job)],
                                env={**env, "RAY_TMPDIR": str(ray_tmp)}, capture_output=True, text=True,
                                timeout=480)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2
