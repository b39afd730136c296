"""Tracker history across a clean stop and a hard kill (issue 49, item 8): a run stopped after step 4, resumed,
killed by SIGKILL after step 11 (its last checkpoint: step 9), resumed to step 14 holds each step once in every
tracker, with the losses of the same run uninterrupted. Each tracker is read back with its own reader:
TensorBoard's EventAccumulator, MlflowClient, the W&B offline run files. A real process, a real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from tests.unit.test_trackers import _tensorboard_scalars, _wandb_history
from vela_ray.config import JobConfig
from vela_ray.errors import RunInterrupted

ROOT = Path(__file__).resolve().parents[2]
STEPS = 14

# A resumed run in its own process that pauses after its argv[2]-th step (its tracker queue drained, as a run's
# is seconds after a step) and prints "paused", to be killed there.
_PAUSING_RESUME = """
import json, sys, time
from tests.fixtures import run_in_process
from vela_ray.config import JobConfig

job, pause_after = json.loads(sys.argv[1]), int(sys.argv[2])
done = iter(range(1, 10**6))
def should_stop():
    if next(done) == pause_after:
        time.sleep(2)
        print("paused", flush=True)
        time.sleep(600)
    return None

run_in_process(JobConfig.from_dict(job).with_resume("latest").preflight().config, should_stop=should_stop)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


def _job(model_dir: Path, out: Path) -> dict:
    return job_dict(model_dir, out, steps=STEPS, checkpoint={"every": 3},
                    training={"report_to": ["tensorboard", "mlflow", "wandb"], "eval_every": 2})


def _kill_after(job: dict, steps: int, log: Path) -> None:
    """Resume `job` in a process of its own and SIGKILL it once it has done `steps` steps."""
    # its own wandb service, as a `vela train` of its own has: not this process's (WANDB_SERVICE), which would
    # outlive it and keep its W&B run open
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, "PYTHONPATH": str(ROOT)}
    with log.open("w") as stderr:
        run = subprocess.Popen([sys.executable, "-c", _PAUSING_RESUME, json.dumps(job), str(steps)], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert run.stdout.readline().strip() == "paused", log.read_text()[-3000:]
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=60)


@pytest.mark.job
def test_a_stop_a_sigkill_and_two_resumes_leave_each_step_once_with_the_uninterrupted_losses(model_dir, tmp_path,
                                                                                            monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uninterrupted = run_in_process(JobConfig.from_dict(_job(model_dir, tmp_path / "whole")).preflight().config)
    losses = dict(enumerate(uninterrupted.losses, start=1))
    evals = {h.step: h.eval_loss for h in uninterrupted.history if h.eval_loss is not None}

    out = tmp_path / "out"
    job = _job(model_dir, out)
    asked = iter([None, None, None, "Ctrl-C"])  # a stop asked after step 4
    with pytest.raises(RunInterrupted):
        run_in_process(JobConfig.from_dict(job).preflight().config, should_stop=lambda: next(asked, "Ctrl-C"))
    _kill_after(job, 7, tmp_path / "killed.log")  # steps 5..11
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))[-1] == "step-000009"
    time.sleep(1)  # the killed process's tracker services notice it is gone and exit
    resumed = run_in_process(JobConfig.from_dict(job).with_resume("latest").preflight().config)
    assert [r.step for r in resumed.resumes] == [4, 9]
    assert resumed.losses == pytest.approx(uninterrupted.losses, rel=1e-6)  # the resume itself is exact

    state = json.loads((out / "trackers.json").read_text())
    tensorboard = _tensorboard_scalars(out / "tensorboard", "train/loss")
    assert tensorboard == pytest.approx(losses, rel=1e-6)
    assert _tensorboard_scalars(out / "tensorboard", "eval/loss") == pytest.approx(evals, rel=1e-6)

    client = MlflowClient()
    for key, expected in (("train/loss", losses), ("eval/loss", evals)):
        history = client.get_metric_history(state["mlflow"]["run_id"], key)
        assert sorted(m.step for m in history) == sorted(expected)  # each step once
        assert {m.step: m.value for m in history} == pytest.approx(expected, rel=1e-6)

    rows = _wandb_history(out, state["wandb"]["id"])
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps)) == list(range(1, STEPS + 1))  # each step once, in order
    assert {row["_step"]: row["train/loss"] for row in rows} == pytest.approx(losses, rel=1e-6)
    assert {row["_step"]: row["eval/loss"] for row in rows if "eval/loss" in row} == pytest.approx(evals, rel=1e-6)
