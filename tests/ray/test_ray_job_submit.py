"""`ray job submit ... -- vela train --config job.yaml` against a head started with `ray start`, token auth on."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.fixtures import job_dict, make_checkpoint, write_job
from tests.ray.head import BIN_DIR, auth_env, free_port, ray_head

REPO = Path(__file__).resolve().parents[2]


def test_ray_job_submit_runs_vela_train_and_writes_adapter_and_summary(tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out", steps=2))
    env = auth_env()
    gcs_port, dash_port = free_port(), free_port()
    with ray_head(env, f"--port={gcs_port}", f"--dashboard-port={dash_port}", "--num-cpus=4",
                  "--include-dashboard=true", wait_port=dash_port):
        submit = [str(BIN_DIR / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash_port}",
                  "--working-dir", str(REPO), "--", "vela", "train", "--config", str(job)]
        for _ in range(20):  # the dashboard answers before its job agent is up ("try again later")
            result = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=480)
            if "No available agent to submit job" not in result.stdout + result.stderr:
                break
            time.sleep(3)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "succeeded" in result.stdout + result.stderr

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    adapter = tmp_path / "out" / "adapter"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)  # loads cleanly
