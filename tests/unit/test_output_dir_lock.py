"""One run per output dir under concurrency too (issue 49, item 1): two runs started a second apart into one
`output.dir` must not both run. The process that drives a run holds the dir (`runs.hold_output_dir`, an OS
lock that dies with its holder) from preflight on; the second run is refused in one line naming the dir and
the holder's pid, and a holder killed by SIGKILL leaves no lock behind. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from tests.fixtures import job_dict, make_checkpoint, run_in_process, write_job
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig
from vela_ray.runs import RUN_FILE, RunIdentity, hold_output_dir, lock_path
from vela_ray.training.summary import RunSummary

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
VELA = Path(sys.executable).parent / "vela"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lock") / "model")


def _job(model_dir: Path, out: Path, lr: float, **sections) -> dict:
    return job_dict(model_dir, out, steps=2, training={"optimizer": {"lr": lr}}, **sections)


# --- the lock itself ------------------------------------------------------------------------


_HOLDER = """
import sys, time
from pathlib import Path
from vela_ray.runs import hold_output_dir
with hold_output_dir(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_dir_another_process_holds_is_refused_in_one_line_and_free_once_that_process_is_killed(tmp_path):
    out = tmp_path / "deep" / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError) as refused:
            with hold_output_dir(out):
                pytest.fail("two processes held one output dir")
        message = str(refused.value)
        assert "\n" not in message and f"output.dir {out} is in use by another run (pid {holder.pid} " in message
        assert "wait for that run to end or stop it, or choose another output.dir" in message
    finally:
        holder.kill()
        holder.wait()
    assert lock_path(out).is_file()  # SIGKILL left its file, but the OS dropped the lock with the process
    with hold_output_dir(out):
        pass
    assert list((tmp_path / "deep").iterdir()) == []  # the next holder deletes the file as it lets go


# --- two runs ---------------------------------------------------------------------------------


# A run as `vela train` runs it (preflight, then the run), in process, that pauses where the test says: at
# "launch" (output.dir held, nothing written yet: where a run spends seconds loading) or after "step-2" (its
# checkpoints written), until the file argv[2] exists. Prints "paused", then "done <run id>".
_PAUSING_RUN = """
import json, sys, time
from pathlib import Path
from tests.fixtures import run_in_process
from vela_ray.config import JobConfig
from vela_ray.runtime.local import InProcessPool

job, go, pause_at = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def pause():
    print("paused", flush=True)
    while not go.exists():
        time.sleep(0.05)

class PausingPool(InProcessPool):
    def launch(self, table):
        if pause_at == "launch":
            pause()
        super().launch(table)

between_steps = iter(range(1, 10**6))
def should_stop():
    if pause_at == "step-2" and next(between_steps) == 2:
        pause()
    return None

config = JobConfig.from_dict(job).preflight().config
summary = run_in_process(config, pool=PausingPool(config), should_stop=should_stop)
print("done", summary.run_id, flush=True)
"""


def _paused_run(job: dict, go: Path, pause_at: str, log: Path) -> subprocess.Popen:
    """A run in its own process, paused at `pause_at` (see `_PAUSING_RUN`) until `go` exists."""
    with log.open("w") as stderr:
        run = subprocess.Popen([sys.executable, "-c", _PAUSING_RUN, json.dumps(job), str(go), pause_at], cwd=ROOT,
                               env=ENV, stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = run.stdout.readline()
    if line.strip() != "paused":
        run.wait(timeout=60)
        pytest.fail(f"the run did not pause: {line!r}; {log.read_text()[-3000:]}")
    return run


def _finish(run: subprocess.Popen, go: Path, log: Path) -> str:
    """Let a paused run go on; its run id, once it exited 0."""
    go.touch()
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, log.read_text()[-3000:]
    return out.split()[-1]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


@pytest.mark.job
def test_a_second_run_into_a_dir_a_run_is_writing_is_refused_and_the_dir_holds_the_first_run(model_dir, tmp_path):
    out = tmp_path / "out"
    first_job, second_job = _job(model_dir, out, lr=1e-3), _job(model_dir, out, lr=5e-3)
    late = VelaJob(JobConfig.from_dict(second_job))  # a driver whose preflight passed before the first run began
    ray_was_up = ray.is_initialized()  # the suite's own Ray may be up in this process already
    first = _paused_run(first_job, tmp_path / "go", "launch", tmp_path / "first.log")
    try:
        assert not out.exists()  # held, nothing written yet: what the check "holds a run" cannot see
        holder = f"output.dir {out} is in use by another run (pid {first.pid} "

        second = subprocess.run([str(VELA), "train", "--config", str(write_job(tmp_path / "second.yaml", second_job))],
                                cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert len(_error_lines(second.stderr)) == 1 and holder in _error_lines(second.stderr)[0]

        with pytest.raises(ValueError) as in_use:
            late.run()
        assert str(in_use.value).startswith(holder) and "\n" not in str(in_use.value)
        assert ray.is_initialized() == ray_was_up  # refused before Ray started
    finally:
        run_id = _finish(first, tmp_path / "go", tmp_path / "first.log")

    # the first run, whole and alone: its identity, config, summary and adapter, nothing of the others
    assert RunIdentity.model_validate_json((out / RUN_FILE).read_text()).run_id == run_id
    assert json.loads((out / "config.json").read_text())["training"]["optimizer"]["lr"] == 1e-3
    summary = RunSummary.load(out)
    assert summary.run_id == run_id and summary.adapter_dir == str((out / "adapter").resolve())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]
    assert not lock_path(out).exists()  # let go with the run
    # and the late driver, now that the dir is free, still finds the run that ended there since its preflight
    with pytest.raises(ValueError) as ended_there:
        late.run()
    assert str(ended_there.value).startswith(f"output.dir {out} holds run {run_id} ")
    assert ray.is_initialized() == ray_was_up


@pytest.mark.job
def test_a_run_killed_by_sigkill_leaves_no_lock_and_its_resume_proceeds(model_dir, tmp_path):
    out = tmp_path / "out"
    job = _job(model_dir, out, lr=1e-3, checkpoint={"every": 1})
    job["training"]["steps"] = 3
    killed = _paused_run(job, tmp_path / "go", "step-2", tmp_path / "killed.log")
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert lock_path(out).is_file()  # the file stays; the lock went with the process

    resumed = run_in_process(JobConfig.from_dict(job).with_resume("latest").preflight().config)
    assert resumed.run_id == RunIdentity.model_validate_json((out / RUN_FILE).read_text()).run_id
    assert [r.step for r in resumed.resumes] == [2] and [h.step for h in resumed.history] == [1, 2, 3]
    assert not lock_path(out).exists()
