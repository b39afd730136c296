"""A whole vela-ray job in one process, without Ray: JobRunner over InProcessPool.

Profile -> place -> train -> checkpoint -> export -> summary -> report, against plain
transformers + peft on the same batches; and a run in which a worker holds no experts.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from placement import Placement, predict_step
from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.errors import RunInterrupted
from vela_ray.observability.metrics import MemoryMetricsBackend, MetricsSink
from vela_ray.observability.report import summary_text
from vela_ray.runtime.accounting import StepAccounting
from vela_ray.runtime.local import InProcessPool
from vela_ray.training import checkpoint
from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.master import master_device
from vela_ray.training.summary import RunSummary

pytestmark = pytest.mark.job  # every test here runs whole jobs

STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


def _run(job: dict) -> tuple[RunSummary, MemoryMetricsBackend]:
    backend = MemoryMetricsBackend()
    config = JobConfig.from_dict(job)
    config.preflight()
    return run_in_process(config, metrics=MetricsSink(backend)), backend


def _assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)


def test_a_whole_job_in_one_process_equals_peft(model_dir, tmp_path):
    out = tmp_path / "out"
    job = job_dict(model_dir, out, steps=STEPS, lora={"r": 4, "alpha": 8,
                                                       "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   placement={"solver": "improved", "profile": "measure"}, checkpoint={"every": 2},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    summary, metrics = _run(job)

    ref_losses, ref_state = reference_losses(JobConfig.from_dict(job))
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    exported = load_file(out / "adapter" / "adapter_model.safetensors")
    assert exported.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out / "adapter")

    assert RunSummary.load(out).model_dump_json() == summary.model_dump_json()  # written = returned
    assert summary.placement.problem is not None and (out / "profile.npy").is_file()
    # the step prediction's inputs, measured before training (the master's compute with the experts stood in
    # for: the losses above equal peft's, so it left no gradient and no state behind)
    placed, problem = summary.placement, summary.placement.problem
    assert problem.training_step.micro_batches == 2 and problem.training_step.in_flight == 1
    assert problem.latencies_s == [0.0] * 3 and problem.training_step.master_compute_s > 0
    assert problem.compute_seconds_per_row is not None and not problem.compute_in_objective  # cost_model: communication
    prediction = predict_step(problem, placed.tables())
    assert placed.expected_step_time_s == prediction.serial_s > problem.training_step.master_compute_s
    assert f"predicted step {placed.expected_step_time_s * 1e3:.3f} ms/step" in summary_text(summary)
    assert summary.timings_s["startup_s"] >= summary.timings_s["placement_s"] > 0  # placed before the first step
    assert f"(first step {summary.timings_s['startup_s']:.1f} s after the start)" in summary_text(summary)
    assert summary.worker_tiers == ["same_process"] * 3
    assert [int(p.name[5:]) for p in checkpoint.valid_checkpoints(out / "checkpoints")] == [2, 4]
    assert summary.checkpoint == str(out / "checkpoints" / "step-000004")
    assert "<svg" in (out / "report.html").read_text()
    assert metrics.value("vela_train_step") == STEPS


def _empty_worker_placement(model_dir: Path, path: Path, empty: int = 1) -> Path:
    """Every expert on workers other than `empty`."""
    from vela_ray.model.loading import moe_layout

    layers, experts = moe_layout(model_dir)
    others = [w for w in range(3) if w != empty]
    table = [[others[e % 2] for e in range(experts)] for _ in range(layers)]
    counts = np.bincount(np.ravel(table), minlength=3).tolist()
    Placement(expert_to_worker=table, num_workers=3, capacities=[max(counts)] * 3, solver="file",
              expected_step_time=0.0).to_json(path)
    return path


def test_a_worker_without_experts_trains_checkpoints_reports_and_resumes(model_dir, tmp_path):
    plan = _empty_worker_placement(model_dir, tmp_path / "placement.json")
    job = job_dict(model_dir, tmp_path / "full", steps=STEPS, checkpoint={"every": 2, "keep": 5},
                   placement={"solver": "file", "file": str(plan), "profile": "measure"},
                   training={"optimizer": {"lr": 3e-3}})
    full, metrics = _run(job)
    assert np.bincount(np.ravel(full.placement.expert_to_worker), minlength=3)[1] == 0
    assert full.worker_received_bytes[1] == 0 and full.traffic_bytes_by_worker[1] == 0
    assert full.placement.predicted_bytes_per_worker()[1] == 0
    assert metrics.value("vela_worker_experts", worker="1") == 0
    assert (tmp_path / "full" / "report.html").is_file()
    manifest = checkpoint.verify(tmp_path / "full" / "checkpoints" / "step-000002")
    assert {Path(f).name for f in manifest["files"] if f.startswith("experts/")} == {
        f"part-{n}.safetensors" for n in range(3)}  # the empty worker writes an empty part

    job["output"]["dir"] = str(tmp_path / "resumed")
    job["checkpoint"]["dir"] = str(tmp_path / "full" / "checkpoints")
    job["checkpoint"]["resume"] = str(tmp_path / "full" / "checkpoints" / "step-000002")
    resumed, _ = _run(job)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses), rtol=1e-5, atol=0)
    _assert_same_adapter(load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors"),
                         load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors"))


def test_a_stop_request_checkpoints_the_step_it_stopped_after_and_resume_finishes_the_run(model_dir, tmp_path):
    """What Ctrl-C / SIGTERM / a vanished driver do through the master: stop between steps, off the
    checkpoint cadence, with a verified checkpoint of that step; resuming it ends where an unstopped run does,
    and its summary's totals are the whole run's."""
    job = job_dict(model_dir, tmp_path / "full", steps=STEPS, checkpoint={"every": 2, "keep": 5},
                   training={"optimizer": {"lr": 3e-3}})
    full, _ = _run(job)

    job["output"]["dir"] = str(tmp_path / "stopped")
    config = JobConfig.from_dict(job)
    steps_seen = MemoryMetricsBackend()
    with pytest.raises(RunInterrupted) as stopped:
        run_in_process(config, metrics=MetricsSink(steps_seen),
                       should_stop=lambda: "interrupted (Ctrl-C)" if steps_seen.value("vela_train_step") == 3 else None)
    last = tmp_path / "stopped" / "checkpoints" / "step-000003"
    assert (stopped.value.step, stopped.value.checkpoint) == (3, str(last))
    assert str(stopped.value).startswith("interrupted (Ctrl-C): stopped after step 3;")
    assert f"--resume {last}" in str(stopped.value)
    checkpoint.verify(last)
    assert not (tmp_path / "stopped" / "adapter").exists()  # no export of an unfinished run

    resumed, _ = _run({**job, "checkpoint": {**job["checkpoint"], "resume": "latest"}})
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses), rtol=1e-5, atol=0)
    _assert_same_adapter(load_file(tmp_path / "stopped" / "adapter" / "adapter_model.safetensors"),
                         load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors"))
    # the summary counts both segments, as the unstopped run's does (issue 49: the last segment's only)
    assert resumed.traffic_bytes_by_tier == full.traffic_bytes_by_tier
    assert (resumed.traffic_bytes_by_worker, resumed.sent_bytes_by_worker) == (full.traffic_bytes_by_worker,
                                                                               full.sent_bytes_by_worker)
    timed = {"compute_seconds_per_row", "training_step"}  # timed at each run's start: two runs time them apart
    assert (resumed.placement.problem.model_dump_json(exclude=timed)
            == full.placement.problem.model_dump_json(exclude=timed))  # kept
    np.testing.assert_array_equal(resumed.placement.predicted_bytes_per_worker(),
                                  full.placement.predicted_bytes_per_worker())
    first_segment_s = json.loads((last / "trainer.json").read_text())["records"]["totals"]["train_s"]
    assert resumed.timings_s["train_s"] > first_segment_s > 0


def _flip_bytes(path: Path, count: int = 5) -> None:
    """`count` bytes near the end of `path` (tensor data) inverted in place: same size, another checksum."""
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[-1 - 7 * i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_resume_past_a_corrupt_newest_checkpoint_sets_it_aside_and_keeps_the_valid_one_before_it(
        model_dir, tmp_path, caplog):
    """keep 2, checkpoints of steps 2 and 3 (the stop's), step 3's files corrupted in place: the resume falls back
    to step 2, and its next checkpoint (4) must not prune step 2 while the corrupt step 3 stays."""
    job = job_dict(model_dir, tmp_path / "out", steps=STEPS, checkpoint={"every": 2, "keep": 2})
    steps_seen = MemoryMetricsBackend()
    with pytest.raises(RunInterrupted):
        run_in_process(JobConfig.from_dict(job), metrics=MetricsSink(steps_seen),
                       should_stop=lambda: "stop" if steps_seen.value("vela_train_step") == 3 else None)
    root = tmp_path / "out" / "checkpoints"
    assert [p.name for p in checkpoint.valid_checkpoints(root)] == ["step-000002", "step-000003"]
    for part in (root / "step-000003" / "experts").iterdir():
        _flip_bytes(part)

    with caplog.at_level("WARNING", logger="vela_ray.training.checkpoint"):
        resumed, _ = _run({**job, "checkpoint": {**job["checkpoint"], "resume": "latest"}})
    assert [r.step for r in resumed.resumes] == [2]
    kept = checkpoint.valid_checkpoints(root)
    assert [p.name for p in kept] == ["step-000002", "step-000004"]
    for path in kept:
        checkpoint.verify(path)  # checksums too: only valid checkpoints are kept
    aside = [p.name for p in root.iterdir() if p.name.startswith("step-000003.corrupt-")]
    assert len(aside) == 1 and caplog.text.count(f"moved aside to {aside[0]}") == 1  # said once, not deleted


class _RecordingPool(InProcessPool):
    """InProcessPool that notes when the runner launches, starts and closes it."""

    def __init__(self, config: JobConfig, events: list[str]):
        super().__init__(config)
        self.events = events

    def launch(self, table) -> None:
        self.events.append("launch")
        super().launch(table)

    def start(self, table):
        self.events.append("start")
        return super().start(table)

    def close(self) -> None:
        self.events.append("close")
        super().close()


def test_the_workers_are_launched_before_the_backbone_loads_and_closed_when_it_fails(model_dir, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the weights are fine, the backbone's load is not
        (broken / name).unlink()
    events: list[str] = []
    config = JobConfig.from_dict(job_dict(broken, tmp_path / "out", steps=1))
    with pytest.raises(ValueError, match="tokenizer"):
        run_in_process(config, pool=_RecordingPool(config, events))
    assert events == ["launch", "close"]  # launched from the checkpoint's skeleton alone, never started

    events.clear()
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "ok", steps=1))
    run_in_process(config, pool=_RecordingPool(config, events))
    assert events == ["launch", "start", "close"]


def _count_calls(cls: type, calls: list[str], monkeypatch) -> None:
    """Every public method of `cls` appends its name to `calls`, then runs as it is."""
    for name, method in list(vars(cls).items()):
        if callable(method) and not name.startswith("_"):
            def counting(self, *args, _real=method, _name=name, **kwargs):
                calls.append(_name)
                return _real(self, *args, **kwargs)
            monkeypatch.setattr(cls, name, functools.wraps(method)(counting))


@pytest.mark.parametrize("method, step_calls", [
    ("first_order", {"forward_rows", "backward_rows", "grad_sq_norm", "step"}),
    ("zo", {"zo_apply", "forward_rows"}),  # +eps z (with the last step's update), forward, -2 eps z, forward
])
def test_a_step_makes_no_worker_round_trip_that_carries_only_telemetry(model_dir, tmp_path, monkeypatch, method,
                                                                         step_calls):
    """With trackers and expert tiers on, each step calls the workers for what it needs (rows, the gradient norm and
    the optimizer step, or ZO's perturbations) and nothing else: the trackers' compute and the tiers' metrics are
    the counters the step's last fan-out answered (`ExpertWorkers.counters`)."""
    calls: list[str] = []
    _count_calls(ExpertManager, calls, monkeypatch)
    per_step: list[Counter] = []
    tracked: list[dict] = []
    real_tracked = StepAccounting.tracked
    monkeypatch.setattr(StepAccounting, "tracked", lambda *args: tracked.append(real_tracked(*args)) or tracked[-1])

    def step_ended() -> None:  # the runner asks between steps
        per_step.append(Counter(calls))
        calls.clear()

    job = job_dict(model_dir, tmp_path / "out", steps=4, expert_tiers={"enabled": True},
                   training={"method": method, "report_to": ["tensorboard"]})
    backend = MemoryMetricsBackend()
    run_in_process(JobConfig.from_dict(job), metrics=MetricsSink(backend), should_stop=step_ended)

    assert len(per_step) == 4
    # the first step's calls also hold the start (placement, the predictor, the first reports), the last's the
    # checkpoint at the end
    for counts in per_step[1:-1]:
        assert set(counts) == step_calls, counts
        assert counts["zo_apply" if method == "zo" else "step"] == 3 * (2 if method == "zo" else 1)  # 3 workers
    assert len(tracked) == 4 and all(values["time/worker_compute_max_s"] > 0 for values in tracked[1:])
    assert sum(backend.value("vela_tier_rows_total", worker=str(w), tier="cpu") for w in range(3)) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_master_gpu_without_cuda_is_refused_in_one_line_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"cluster.master_gpus is 1 but the master's process sees no CUDA"):
        master_device(True)
    assert master_device(False).type == "cpu"

