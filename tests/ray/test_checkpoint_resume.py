"""Checkpoints through the real runtime: exact resume (same and other worker count), a killed worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks._harness import kill_when  # the kill benchmarks/checkpoint_recovery.py measures
from vela_ray.errors import WorkerLostError
from tests.fixtures import job_dict, make_checkpoint
from vela_ray.training import checkpoint
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig

STEPS, EVERY = 16, 4


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    """One full run with a checkpoint every EVERY steps: the reference for every resume."""
    root = tmp_path_factory.mktemp("uninterrupted")
    model_dir = make_checkpoint(root / "model")
    job = job_dict(model_dir, root / "out", steps=STEPS, checkpoint={"every": EVERY, "keep": 10},
                   training={"optimizer": {"lr": 3e-3, "warmup_steps": 2}})
    summary = VelaJob(JobConfig.from_dict(job)).run()
    return {"job": job, "summary": summary, "root": root}


def _adapter(summary) -> dict[str, torch.Tensor]:
    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


def _assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)


def _resumed(uninterrupted, out: Path, resume: str, **cluster) -> dict:
    job = json.loads(json.dumps(uninterrupted["job"]))
    job["output"]["dir"] = str(out)
    job["checkpoint"]["dir"] = str(uninterrupted["root"] / "out" / "checkpoints")
    job["cluster"].update(cluster)
    return VelaJob(JobConfig.from_dict(job).with_resume(resume)).run()


def test_checkpoints_are_written_every_n_steps_and_verify(uninterrupted):
    root = uninterrupted["root"] / "out" / "checkpoints"
    steps = [int(p.name.split("-")[1]) for p in checkpoint.valid_checkpoints(root)]
    assert steps == list(range(EVERY, STEPS + 1, EVERY))
    manifest = checkpoint.verify(root / f"step-{STEPS:06d}")
    assert len({f for f in manifest["experts"].values()}) == 3  # each worker wrote its own part


@pytest.mark.parametrize("num_workers", [3, 2], ids=["same-placement", "two-workers"])
def test_resume_continues_with_identical_losses_and_adapter(uninterrupted, tmp_path, num_workers):
    mid = STEPS // 2
    ckpt = uninterrupted["root"] / "out" / "checkpoints" / f"step-{mid:06d}"
    summary = _resumed(uninterrupted, tmp_path / "out", str(ckpt), num_workers=num_workers)
    assert [r.step for r in summary.resumes] == [mid]
    torch.testing.assert_close(torch.tensor(summary.losses),
                               torch.tensor(uninterrupted["summary"].losses), rtol=1e-5, atol=0)
    _assert_same_adapter(_adapter(summary), _adapter(uninterrupted["summary"]))


def test_a_killed_expert_manager_stops_the_run_naming_it_and_the_checkpoint(uninterrupted, tmp_path):
    """Over object refs; the collective plane's loss is named by the recovery test below (the same
    `lost_workers` path) and by tests/ray/test_collective_data_plane.py."""
    job = json.loads(json.dumps(uninterrupted["job"]))
    job["output"]["dir"] = str(tmp_path / "out")
    job["checkpoint"] = {"every": 2, "keep": 10}
    ckpt_root = tmp_path / "out" / "checkpoints"
    killer, killed = kill_when(tmp_path / "out", lambda: checkpoint.latest(ckpt_root) is not None)
    with pytest.raises(WorkerLostError) as err:  # the actor's own error, not Ray's wrapper
        VelaJob(JobConfig.from_dict(job)).run()
    stopped = time.monotonic()
    killer.join(timeout=10)
    assert killed, "the worker was never killed"
    assert stopped - killed["at"] < 30  # a dead peer is noticed, never waited on until a timeout
    message = str(err.value)
    assert "ExpertManager worker(s) [1] died" in message
    last = checkpoint.latest(ckpt_root)
    assert last is not None and str(last) in message
    checkpoint.verify(last)  # intact

    # and resuming from it finishes exactly like the uninterrupted run
    job["checkpoint"]["resume"] = "latest"
    summary = VelaJob(JobConfig.from_dict(job)).run()
    done = int(last.name.split("-")[1])
    assert [r.step for r in summary.resumes] == [done]  # the summary covers the whole run, its resume marked
    torch.testing.assert_close(torch.tensor(summary.losses),
                               torch.tensor(uninterrupted["summary"].losses), rtol=1e-5, atol=0)
    _assert_same_adapter(_adapter(summary), _adapter(uninterrupted["summary"]))


def test_resume_with_another_lora_rank_is_refused(uninterrupted, tmp_path):
    job = json.loads(json.dumps(uninterrupted["job"]))
    job["output"]["dir"] = str(tmp_path / "out")
    job["checkpoint"]["dir"] = str(uninterrupted["root"] / "out" / "checkpoints")
    job["lora"] = {"r": 4}
    with pytest.raises(ValueError, match=r"lora_r: checkpoint 8 vs this job 4"):
        VelaJob(JobConfig.from_dict(job).with_resume("latest")).run()


def test_with_two_masters_a_killed_master_is_restarted_and_the_run_equals_the_uninterrupted_one(
        uninterrupted, tmp_path):
    job = json.loads(json.dumps(uninterrupted["job"]))
    job["output"]["dir"] = str(tmp_path / "out")
    job.update(fault_tolerance={"on_worker_loss": "recover"}, masters={"count": 2})
    job["checkpoint"] = {"every": 2, "keep": 10}
    killer, killed = kill_when(tmp_path / "out", (tmp_path / "out" / "checkpoints" / "step-000002").is_dir,
                               delay_s=0.2, victim="master_pids")
    summary = VelaJob(JobConfig.from_dict(job)).run()
    killer.join(timeout=10)
    assert killed, "master 1 was never killed"

    [recovery] = summary.recoveries  # master 0 saw master 1 fail at once (it does not wait in the sum)
    assert recovery.workers == [] and len(summary.master_nodes) == 2
    pids = json.loads((tmp_path / "out" / "workers.json").read_text())["master_pids"]
    assert len(pids) == 2 and pids[1] != killed["pid"]
    assert [h.step for h in summary.history] == list(range(1, STEPS + 1))
    # two masters, rolled back and replayed, still train like the one uninterrupted master
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(uninterrupted["summary"].losses),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("transport, tiers", [("object_ref", True), ("collective", False)],
                         ids=["object_ref-tiered", "collective"])
def test_a_killed_expert_manager_is_replaced_in_place_and_the_run_finishes_as_if_nothing_happened(
        uninterrupted, tmp_path, transport, tiers):
    job = json.loads(json.dumps(uninterrupted["job"]))
    job["output"]["dir"] = str(tmp_path / "out")
    # tiered workers (no device here: every expert on the CPU tier) compute as untiered ones do
    job.update(data_plane={"transport": transport}, fault_tolerance={"on_worker_loss": "recover"},
               expert_tiers={"enabled": tiers})
    job["checkpoint"] = {"every": 2, "keep": 10}
    ckpt_root = tmp_path / "out" / "checkpoints"
    # killed once step 2 is checkpointed, some steps before the end: the run must roll back and replay
    killer, killed = kill_when(tmp_path / "out", (ckpt_root / "step-000002").is_dir)
    summary = VelaJob(JobConfig.from_dict(job)).run()
    killer.join(timeout=10)
    assert killed, "the worker was never killed"

    [recovery] = summary.recoveries
    # which checkpoint it rolls back to depends on how far the run got before the kill landed
    assert recovery.workers == [1] and recovery.checkpoint_step % 2 == 0
    assert 2 <= recovery.checkpoint_step < recovery.step <= STEPS
    new_pids = json.loads((tmp_path / "out" / "workers.json").read_text())["pids"]
    assert new_pids[1] != killed["pid"]
    assert [h.step for h in summary.history] == list(range(1, STEPS + 1))  # replayed steps are not doubled
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(uninterrupted["summary"].losses),
                               rtol=1e-5, atol=0)
    _assert_same_adapter(_adapter(summary), _adapter(uninterrupted["summary"]))
    if tiers:  # the replacement got the popularity predictor too: it scored forecasts while replaying
        assert [stats.worker for stats in summary.expert_tiers] == [0, 1, 2]
        assert all(stats.predictions > 0 for stats in summary.expert_tiers)
