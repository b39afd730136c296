"""Live migration in one process: experts move between live ExpertManagers and training does not notice.

Also the job's start (spawn once, move only what the solver moved), online re-placement on
routing drift (adopted exactly when its saving pays for the move) and elastic resume by the
checkpoint's own profile.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from placement import sequential_table
from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.model.loading import checkpoint_prototypes
from vela_ray.model.quantized_model import frozen_bytes_per_expert
from vela_ray.observability.report import summary_text
from vela_ray.data.datasets import batch_rows, micro_batches
from vela_ray.runtime.local import InProcessPool
from vela_ray.runtime.migration import MigrationPlan
from vela_ray.runtime.runner import Backbone
from vela_ray.training.schedule import lr_at
from vela_ray.training.master import build_master
from vela_ray.training.step import train_step
from vela_ray.training.summary import LinkRecord, RunSummary

STEPS, MOVE_AT = 6, 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Mixtral and, beside it, a random adapter every run starts from (non-zero B: every
    LoRA factor gets gradients from the first step)."""
    model = make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")
    init_adapter(model, model.parent / "adapter")
    return model


def _config(model_dir: Path, out: Path, **sections) -> JobConfig:
    sections.setdefault("training", {"optimizer": {"lr": 5e-3, "warmup_steps": 1}})
    sections.setdefault("lora", {"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")})
    return JobConfig.from_dict(job_dict(model_dir, out, steps=STEPS, **sections))


def _train(config: JobConfig, table: np.ndarray, moves: dict[int, np.ndarray]):
    """STEPS steps over an InProcessPool; before step s in `moves`, migrate to `moves[s]`."""
    backbone = Backbone.load(config)
    pool = InProcessPool(config)
    hosted = pool.start(table)
    master = build_master(backbone.model, table, hosted.transport, config.lora_spec, config.training.optimizer)
    cfg, losses, snapshots = config.training, [], {}
    for step in range(STEPS):
        if step in moves:
            snapshots["before"] = {n: m.expert_states(m.keys) for n, m in enumerate(pool.managers)}
            snapshots["stats"] = pool.migrate(moves[step])
            master.dispatcher.rebind(moves[step])
            snapshots["after"] = {n: m.expert_states(m.keys) for n, m in enumerate(pool.managers)}
        rows = batch_rows(backbone.train_set, step, cfg.batch_size, cfg.seed)
        micro = micro_batches(backbone.train_set.rows(rows), cfg.micro_batch_size)
        losses.append(train_step(master, hosted.workers, micro, lr_at(cfg.optimizer, step, cfg.steps),
                                 cfg.optimizer.max_grad_norm))
    return losses, hosted.workers.lora_state(), snapshots, pool


def _scattered(shape: tuple[int, int], num_workers: int, seed: int = 3) -> np.ndarray:
    """Every worker hosts some experts of every layer, none where the sequential table put it."""
    table = (sequential_table(*shape, num_workers) + 1 + np.random.default_rng(seed).integers(
        0, num_workers - 1, size=shape)) % num_workers
    return table


@pytest.mark.parametrize("held", ["none", "int8"])
def test_migrating_experts_mid_run_trains_exactly_like_not_moving_them(model_dir, tmp_path, held):
    """Also with the frozen weights held quantized (`model.quantization`, int8: its per-channel scales fit the debug
    width): an arriving expert is read from the checkpoint and quantized as at start, never moved dequantized."""
    config = _config(model_dir, tmp_path / "out", model={"quantization": {"format": held}})
    backbone = Backbone.load(config)
    start = sequential_table(*backbone.shape, 3)
    moved_to = _scattered(backbone.shape, 3)
    assert (moved_to != start).all()

    still, still_state, _, _ = _train(config, start, {})
    moved, moved_state, snap, pool = _train(config, start, {MOVE_AT: moved_to})

    torch.testing.assert_close(torch.tensor(moved), torch.tensor(still), rtol=1e-6, atol=0)
    assert moved_state.keys() == still_state.keys()
    for key in still_state:
        for name in still_state[key]:
            torch.testing.assert_close(moved_state[key][name], still_state[key][name], rtol=1e-5, atol=1e-7)

    # each expert arrived with exactly the LoRA factors and AdamW moments it left with
    before = {k: v for part in snap["before"].values() for k, v in part.items()}
    after = {k: v for part in snap["after"].values() for k, v in part.items()}
    assert before.keys() == after.keys() and len(after) == int(np.prod(backbone.shape))
    for key, state in before.items():
        assert state.keys() == after[key].keys() and any(n.endswith(".exp_avg") for n in state)
        for name, value in state.items():
            assert torch.equal(after[key][name], value), (key, name)
    for worker, manager in enumerate(pool.managers):
        assert manager.keys == MigrationPlan.between(start, moved_to).keys_of(worker)

    # what travelled: every expert's state once, and every expert's frozen weights read once (int8: its bytes)
    state_bytes = sum(t.numel() * t.element_size() for s in before.values() for t in s.values())
    assert sum(s.state_bytes for s in snap["stats"]) == state_bytes
    assert sum(s.arrived for s in snap["stats"]) == moved_to.size
    hosted = [layer for manager in pool.managers for layer in manager.shard.layers.values()]
    assert all(bool(layer.quantized) == (held != "none") for layer in hosted)
    prototype = checkpoint_prototypes(model_dir)[0]
    per_expert = frozen_bytes_per_expert(prototype, None if held == "none" else held, torch.float32)
    assert sum(s.frozen_bytes for s in snap["stats"]) == moved_to.size * per_expert


def test_a_migration_plan_moves_only_what_changed():
    old = np.array([[0, 0, 1, 1], [2, 2, 0, 1]])
    new = np.array([[0, 1, 1, 1], [2, 0, 0, 1]])
    plan = MigrationPlan.between(old, new)
    assert plan.moved == [(0, 1), (1, 1)]
    assert plan.by_pair() == {(0, 1): [(0, 1)], (2, 0): [(1, 1)]}
    assert plan.touched() == [0, 1, 2]
    assert plan.keys_of(0) == [(0, 0), (1, 1), (1, 2)]
    assert plan.senders_to(0) == [(2, 0)]
    with pytest.raises(ValueError, match="shapes"):
        MigrationPlan.between(old, new[:1])


def _run(config: JobConfig, links: list[LinkRecord] | None = None) -> RunSummary:
    config.preflight()
    return run_in_process(config, links=links)


@pytest.mark.job
def test_the_job_start_moves_only_the_experts_the_solver_moved_and_equals_peft(model_dir, tmp_path):
    config = _config(model_dir, tmp_path / "out", placement={"solver": "improved"})
    summary = _run(config)
    start = sequential_table(*np.asarray(summary.placement.expert_to_worker).shape, 3)
    changed = int((summary.placement.table != start).sum())
    assert changed > 0, "the solver kept the sequential table: the test shows nothing"
    [migration] = summary.migrations
    assert (migration.reason, migration.step, migration.version, migration.moved) == ("start", 0, 1, changed)
    assert migration.state_bytes > 0 and migration.frozen_bytes > 0
    assert migration.expert_to_worker == summary.placement.expert_to_worker
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


SLOW_LINKS = [LinkRecord(latency_s=0.0, bandwidth_bytes_per_s=2e4)] * 3


def _skewed_profile(path: Path, shape: tuple[int, int], top_k: int) -> Path:
    """A profile whose hot experts are the first 2*top_k of every layer: what the tiny model's routing is not."""
    probs = np.zeros(shape)
    probs[:, :2 * top_k] = 0.5
    np.save(path, probs)
    return path


@pytest.mark.job
def test_a_synthetic_drift_triggers_exactly_one_replacement_that_pays_for_itself(model_dir, tmp_path):
    backbone = Backbone.load(_config(model_dir, tmp_path / "probe"))
    profile = _skewed_profile(tmp_path / "skewed.npy", backbone.shape, top_k=2)
    config = _config(model_dir, tmp_path / "out", placement={
        "solver": "improved", "profile": str(profile), "replan": {"every": 2, "drift_threshold": 0.25, "horizon_steps": 200}})
    summary = _run(config, links=SLOW_LINKS)

    drift_moves = [m for m in summary.migrations if m.reason == "drift"]
    assert len(drift_moves) == 1 and [r.adopted for r in summary.replans] == [True]
    [replan], [move] = summary.replans, drift_moves
    assert replan.step == 2 and replan.drift > 0.25 and replan.moved == move.moved > 0
    assert move.expected_saving_s > move.expected_cost_s > 0 and move.version == 2
    assert replan.candidate_step_s < replan.current_step_s
    page = (tmp_path / "out" / "report.html").read_text()
    assert 'id="changes"' in page and "moved" in page and "placement v2" in page
    assert "re-placement at step 2" in summary_text(tmp_path / "out")
    # the summary's placement is the adopted one, solved for the recent routing, not the file's
    assert summary.placement.problem.probs.tolist() != np.load(profile).tolist()
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


@pytest.mark.job
def test_a_drift_too_small_to_pay_for_its_migration_moves_nothing(model_dir, tmp_path):
    config = _config(model_dir, tmp_path / "out", placement={
        "solver": "improved", "profile": "measure", "replan": {"every": 2, "drift_threshold": 0.0,
                                                               "horizon_steps": 1}})
    summary = _run(config, links=SLOW_LINKS)
    assert [r.step for r in summary.replans] == [2, 4]  # re-solved at every check (threshold 0) ...
    assert not any(r.adopted for r in summary.replans)  # ... and never worth a migration
    assert all(r.expected_saving_s <= r.expected_cost_s for r in summary.replans)
    assert [m.reason for m in summary.migrations] == ["start"]


@pytest.mark.job
def test_an_elastic_resume_places_by_the_checkpoints_profile(model_dir, tmp_path):
    first = _run(_config(model_dir, tmp_path / "a", placement={"solver": "improved"}, checkpoint={"every": 3}))
    job = job_dict(model_dir, tmp_path / "b", steps=STEPS, placement={"solver": "improved"},
                   cluster={"num_workers": 2}, checkpoint={"dir": str(tmp_path / "a" / "checkpoints"),
                                                           "resume": "latest"},
                   training={"optimizer": {"lr": 5e-3, "warmup_steps": 1}},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")})
    job["checkpoint"]["resume"] = str(tmp_path / "a" / "checkpoints" / "step-000003")
    second = _run(JobConfig.from_dict(job))
    # the run's profile files are the checkpoint's (written for the resumed run, not measured again)
    for name in ("profile.json", "profile.npy"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name
    np.testing.assert_array_equal(second.placement.problem.probs, first.placement.problem.probs)
    assert np.asarray(second.placement.expert_to_worker).max() == 1
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(first.losses), rtol=1e-5, atol=0)
