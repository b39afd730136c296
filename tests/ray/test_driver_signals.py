"""`vela train` as a user runs it, stopped from outside: Ctrl-C, SIGTERM, a SIGKILLed driver or master.

The driver is a real `vela train` subprocess attached to the session's Ray (RAY_ADDRESS), so the
test can watch its MasterActor and ExpertManager processes (their pids are in `workers.json`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import ray

from tests.fixtures import job_dict, make_checkpoint, write_job
from tests.ray.head import BIN_DIR
from vela_ray import api
from vela_ray.training import checkpoint

STARTUP_TIMEOUT_S = 300  # a 2-core CI machine starts Ray workers slowly


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


class Training:
    """A long `vela train` subprocess, checkpointing every 2 steps."""

    def __init__(self, model_dir: Path, out: Path):
        self.out = out
        job = write_job(out.parent / f"{out.name}.yaml",
                        job_dict(model_dir, out, steps=10_000, checkpoint={"every": 2, "keep": 3}))
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
               "PATH": f"{BIN_DIR}:{os.environ['PATH']}"}
        self.proc = subprocess.Popen([str(BIN_DIR / "vela"), "train", "--config", str(job)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def wait_for_a_checkpoint(self) -> dict:
        """workers.json once the first checkpoint is on disk (the run is training)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            workers = self.out / "workers.json"
            if workers.is_file() and checkpoint.latest(self.out / "checkpoints") is not None:
                return json.loads(workers.read_text())
            time.sleep(0.2)
        self.proc.kill()
        raise TimeoutError(f"no checkpoint after {STARTUP_TIMEOUT_S} s: {self.proc.communicate()[1][-3000:]}")

    def finish(self, timeout_s: float = 180) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, err


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vela train: error:")]


def _all_gone(pids: list[int], timeout_s: float = 120) -> list[int]:
    """The pids still alive after `timeout_s` (none, when Ray tore the run down)."""
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    return alive


def test_ctrl_c_and_sigterm_are_each_a_stop_request_and_the_previous_handlers_come_back():
    """The driver's handler: each signal names its reason and counts (the second one kills the run); what
    follows the request is the same for both, so one whole run below carries it (Ctrl-C's)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with api._stop_requests() as request:
        signal.raise_signal(signal.SIGTERM)  # handled before it returns
        assert (request.reason, request.count) == ("terminated (SIGTERM)", 1)
        signal.raise_signal(signal.SIGINT)
        assert (request.reason, request.count) == ("interrupted (Ctrl-C)", 2)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_stops_after_the_step_with_a_checkpoint_and_prints_the_resume_command(ray_session, model_dir,
                                                                                      tmp_path):
    sig, reason = signal.SIGINT, "interrupted (Ctrl-C)"
    run = Training(model_dir, tmp_path / "out")
    processes = run.wait_for_a_checkpoint()
    run.proc.send_signal(sig)
    code, stderr = run.finish()

    assert code == 130, stderr[-3000:]
    errors = _errors(stderr)
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    last = checkpoint.latest(tmp_path / "out" / "checkpoints")
    assert errors[0].startswith(f"vela train: error: {reason}: stopped after step {last.name[5:].lstrip('0')};")
    assert errors[0].endswith(f"`vela train --config {tmp_path / 'out.yaml'} --resume {last}`")  # runnable as is
    checkpoint.verify(last)
    assert not list((tmp_path / "out" / "checkpoints").glob(".step-*"))  # no half-written staging dir
    assert _all_gone([processes["master_pid"], *processes["pids"]]) == []


def test_a_sigkilled_driver_takes_its_master_and_workers_with_it(ray_session, model_dir, tmp_path):
    run = Training(model_dir, tmp_path / "out")
    processes = run.wait_for_a_checkpoint()
    run.proc.kill()
    run.finish()
    assert _all_gone([processes["master_pid"], *processes["pids"]]) == []


def test_a_killed_master_reaches_the_user_as_one_line_with_the_checkpoint_to_resume(ray_session, model_dir,
                                                                                     tmp_path):
    run = Training(model_dir, tmp_path / "out")
    processes = run.wait_for_a_checkpoint()
    os.kill(processes["master_pid"], signal.SIGKILL)
    code, stderr = run.finish()

    assert code == 1, stderr[-3000:]
    errors = _errors(stderr)
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith("vela train: error: the MasterActor died (")
    last = checkpoint.latest(tmp_path / "out" / "checkpoints")
    assert last is not None and f"--resume {last}`" in errors[0]
    checkpoint.verify(last)
    assert _all_gone(processes["pids"]) == []


def test_ctrl_c_while_starting_up_is_one_line_not_a_traceback(model_dir, tmp_path):
    """Before the run can stop between steps (preflight, Ray's start), Ctrl-C ends `vela train` with one line
    and exit status 130, not a KeyboardInterrupt traceback."""
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out", steps=2))
    env = {**os.environ, "PATH": f"{BIN_DIR}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([str(BIN_DIR / "vela"), "train", "--config", str(job)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = proc.stderr.readline()  # the first log line: the start-up is under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=STARTUP_TIMEOUT_S)
    assert first and proc.returncode == 130, first + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == "vela train: interrupted (Ctrl-C)"


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_process_of_the_ray_it_started(model_dir, tmp_path):
    """`vela train` without an address starts a local Ray; SIGKILLed mid-run, every process of that Ray ends
    within seconds (its dashboard and runtime-env agents outlived it by one to two minutes: `local_ray`)."""
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out", steps=10_000, checkpoint={"every": 2}))
    env = {**os.environ, "PATH": f"{BIN_DIR}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([str(BIN_DIR / "vela"), "train", "--config", str(job)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while checkpoint.latest(tmp_path / "out" / "checkpoints") is None:  # training: every Ray process is up
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.1)
    reaper = [p for p in psutil.Process(proc.pid).children() if "sys.stdin.buffer.read()" in " ".join(p.cmdline())]
    ray_processes = [p for p in psutil.Process(proc.pid).children(recursive=True) if p not in reaper]
    assert len(reaper) == 1 and {"gcs_server", "raylet"} <= {p.name() for p in ray_processes}
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(ray_processes + reaper, timeout=30)
    assert not alive, [f"{p.pid} {p.name()}" for p in alive]
