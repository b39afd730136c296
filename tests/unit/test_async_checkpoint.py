"""Asynchronous checkpoints (`checkpoint.asynchronous`): a snapshot of the step, written while training goes on.

The same files as synchronous checkpoints and an exact resume; a failed write is one line and
publishes nothing; a job SIGKILLed while one is being written leaves the previous checkpoint `latest`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.errors import CheckpointWriteError
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.training import checkpoint
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.master import build_local, master_state
from vela_ray.training.step import train_step

STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _job(model_dir: Path, out: Path, asynchronous: bool, steps: int = STEPS, **checkpoint_section) -> dict:
    # a checkpoint every step: each one first waits for the one before, written while that step trained
    return job_dict(model_dir, out, steps=steps, placement={"profile": "uniform"},
                    checkpoint={"every": 1, "keep": 10, "asynchronous": asynchronous, **checkpoint_section},
                    training={"optimizer": {"lr": 3e-3}})


def _flat(states: dict) -> dict[str, torch.Tensor]:
    return {f"l{layer}.e{expert}.{name}": value for (layer, expert), state in states.items()
            for name, value in state.items()}


def test_a_snapshot_holds_its_step_while_the_next_step_trains(tmp_path):
    table = torch.tensor([[0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0]])
    master, workers = build_local(debug_model("mixtral"), table, LoraSpec(4, 8), OptimizerConfig(lr=1e-2), seed=0)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    train_step(master, workers, [batch], lr=1e-2, max_grad_norm=1.0)  # non-zero LoRA B and AdamW moments
    experts_then = _flat(workers.lora_state())

    workers.snapshot_checkpoint_parts(str(checkpoint.begin(tmp_path, 1)))
    backbone = master_state(master, copy=True)
    backbone_then = {name: value.clone() for name, value in backbone.items()}
    train_step(master, workers, [batch], lr=1e-2, max_grad_norm=1.0)  # updates every tensor in place
    saved = {}
    for part in workers.finish_checkpoint_parts(poll_s=0.01):
        saved.update(load_file(part))

    experts_now = _flat(workers.lora_state())
    assert any(not torch.equal(experts_now[name], value) for name, value in experts_then.items())
    assert all(torch.equal(saved[name], value) for name, value in experts_then.items())
    now = master_state(master)
    assert any(not torch.equal(now[name], value) for name, value in backbone_then.items())
    assert all(torch.equal(backbone[name], value) for name, value in backbone_then.items())


@pytest.mark.job
def test_asynchronous_checkpoints_hold_the_same_bytes_as_synchronous_ones_and_resume_exactly(model_dir, tmp_path):
    sync = run_in_process(JobConfig.from_dict(_job(model_dir, tmp_path / "sync", asynchronous=False)))
    full = run_in_process(JobConfig.from_dict(_job(model_dir, tmp_path / "async", asynchronous=True)))
    assert full.losses == sync.losses
    assert full.checkpoint == str(tmp_path / "async" / "checkpoints" / f"step-{STEPS:06d}")
    assert len(full.timings_s["checkpoint_stall_s"]) == STEPS
    for step in range(1, STEPS + 1):
        a = checkpoint.verify(tmp_path / "async" / "checkpoints" / f"step-{step:06d}")
        s = checkpoint.verify(tmp_path / "sync" / "checkpoints" / f"step-{step:06d}")
        # every safetensors file byte for byte (sha256); trainer.json differs in its config only
        assert {n: e for n, e in a["files"].items() if n != "trainer.json"} == \
               {n: e for n, e in s["files"].items() if n != "trainer.json"}
        other_run = ("run_id",)  # each run's own id
        assert (a["experts"], {k: v for k, v in a["meta"].items() if k not in other_run}) == \
               (s["experts"], {k: v for k, v in s["meta"].items() if k not in other_run})
    assert checkpoint.staging_dirs(tmp_path / "async" / "checkpoints") == []

    job = _job(model_dir, tmp_path / "resumed", asynchronous=True)
    job["checkpoint"]["resume"] = str(tmp_path / "async" / "checkpoints" / "step-000002")
    resumed = run_in_process(JobConfig.from_dict(job))
    assert resumed.losses == full.losses  # the run's whole record: steps 1-2 restored, 3.. trained
    a, b = (load_file(Path(s.adapter_dir) / "adapter_model.safetensors") for s in (resumed, full))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.job
def test_a_failed_background_write_fails_the_run_in_one_line_and_publishes_nothing(model_dir, tmp_path,
                                                                                    monkeypatch):
    write_tensors = checkpoint.write_tensors

    def disk_full_at_step_2(path, tensors, metadata=None):
        if ".step-000002." in str(path) and path.name.startswith("part-"):
            raise OSError(28, "No space left on device")
        write_tensors(path, tensors, metadata)

    monkeypatch.setattr(checkpoint, "write_tensors", disk_full_at_step_2)
    with pytest.raises(CheckpointWriteError) as failed:
        run_in_process(JobConfig.from_dict(_job(model_dir, tmp_path / "out", asynchronous=True, steps=3)))
    root = tmp_path / "out" / "checkpoints"
    assert len(str(failed.value).splitlines()) == 1
    assert re.fullmatch(r"asynchronous checkpoint of step 2 failed: expert worker \d: writing its checkpoint part "
                        r"failed with OSError: \[Errno 28\] No space left on device; nothing of it was published; "
                        rf"resume from checkpoint {re.escape(str(root / 'step-000001'))} with .*", str(failed.value))
    assert [p.name for p in checkpoint.step_dirs(root)] == ["step-000001"]  # failed at the wait of step 3
    assert [p.name[:13] for p in checkpoint.staging_dirs(root)] == [".step-000002."]  # the next prune's


# A fork server: imports once, then runs each job it reads (one JSON line) in a forked child, printing
# the child's pid, and "ended <status>" once the child is gone (killed, or finished).
_JOBS = """
import json, os, sys
import torch
from tests.fixtures import run_in_process
from vela_ray.config import JobConfig
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        try:
            run_in_process(JobConfig.from_dict(json.loads(line)))
        finally:
            os._exit(0)
    print(pid, flush=True)
    print("ended", os.waitpid(pid, 0)[1], flush=True)
"""

KILLS = [(3, 0.0), (4, 0.01), (5, 0.04)]  # (checkpoint step whose staging dir appeared, seconds until SIGKILL)


def _wait_for_staging(root: Path, step: int, pid: int, deadline_s: float = 120.0) -> None:
    """Until the job `pid` begins the checkpoint of `step` or a later one (a staging directory appears; one
    written faster than a poll is caught at the next checkpoint instead)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if root.is_dir() and any(name.startswith(".step-") and ".tmp-" in name and int(name[6:12]) >= step
                                 for name in os.listdir(root)):
            return
        os.kill(pid, 0)  # ProcessLookupError: the job ended early (its error went to the fork server's stderr)
        time.sleep(0.0005)
    raise AssertionError(f"no checkpoint of step {step} began under {root} in {deadline_s} s")


@pytest.mark.job
def test_sigkill_while_an_asynchronous_checkpoint_is_written_leaves_the_previous_one_latest(model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    server = subprocess.Popen([sys.executable, "-c", _JOBS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env)
    landed, pid = [], None
    try:
        assert server.stdout.readline().strip() == "ready"
        for run, (step, delay_s) in enumerate(KILLS):
            job = _job(model_dir, tmp_path / f"run-{run}", asynchronous=True, steps=100, keep=2)
            server.stdin.write(json.dumps(job) + "\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            root = tmp_path / f"run-{run}" / "checkpoints"
            _wait_for_staging(root, step, pid)
            time.sleep(delay_s)
            os.kill(pid, signal.SIGKILL)
            assert server.stdout.readline().split() == ["ended", str(signal.SIGKILL)]

            left = sorted(os.listdir(root))
            published = checkpoint.step_dirs(root)
            for path in published:  # no torn step directory: each one is complete, checksums and all
                checkpoint.verify(path)
            latest = checkpoint.latest(root)
            assert latest == published[-1] and int(latest.name[5:]) >= step - 1, left
            # Staging directories of later steps: the checkpoint being written, the one after `latest`. (Older
            # ones are checkpoints the kill caught being pruned: renamed out of the way, for the next prune.)
            writing = [int(p.name[6:12]) for p in checkpoint.staging_dirs(root) if p.name[1:12] > latest.name]
            assert writing in ([], [int(latest.name[5:]) + 1]), left
            landed.append(bool(writing))
    finally:
        if pid is not None and server.poll() is None:  # a failed assert may leave the job running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.kill()
        server.wait()
    assert any(landed), f"no kill landed while a checkpoint was written: {landed}"
