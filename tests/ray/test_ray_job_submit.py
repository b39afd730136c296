"""`ray job submit ... -- vela train --config job.yaml` against a head started with `ray start`, token auth on."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.fixtures import job_dict, make_checkpoint, write_job

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_dashboard(port: int, head: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start exited with {head.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(1)
    raise TimeoutError(f"dashboard not up on port {port} after {timeout_s} s")


def test_ray_job_submit_runs_vela_train_and_writes_adapter_and_summary(tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out", steps=2))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    gcs_port, dash_port = _free_port(), _free_port()
    temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={gcs_port}", f"--dashboard-port={dash_port}",
         "--num-cpus=4", "--include-dashboard=true", "--disable-usage-stats",
         f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_dashboard(dash_port, head)
        submit = [str(bin_dir / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash_port}",
                  "--working-dir", str(REPO), "--", "vela", "train", "--config", str(job)]
        for _ in range(20):  # the dashboard answers before its job agent is up ("try again later")
            result = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=480)
            if "No available agent to submit job" not in result.stdout + result.stderr:
                break
            time.sleep(3)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "succeeded" in result.stdout + result.stderr
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head's whole process group: GCS, raylet, dashboard, workers
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    adapter = tmp_path / "out" / "adapter"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)  # loads cleanly
