"""One run per output dir, resume that continues the same run, history across resumes (issue 31, items 1-2),
and the small input items (7): `~` paths, preflight leaving nothing behind, field pointers, our own wording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures import job_dict, make_checkpoint, run_in_process, write_job
from vela_ray.cli import main
from vela_ray.config import JobConfig
from vela_ray.errors import RunInterrupted
from vela_ray.observability.report import summary_text
from vela_ray.runs import RUN_FILE, RunIdentity, math_of
from vela_ray.training import checkpoint
from vela_ray.training.summary import RunSummary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("runs") / "model")


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _stop_after(step: int):
    """A should_stop that asks to stop once `step` steps are done (the runner asks between steps)."""
    asked = {"n": 0}

    def should_stop() -> str | None:
        asked["n"] += 1
        return "test stop" if asked["n"] >= step else None
    return should_stop


# --- identity and the math that must match --------------------------------------------------


def test_the_math_of_a_run_is_its_model_data_lora_optimizer_and_seed_not_its_cadence(model_dir, tmp_path):
    job = job_dict(model_dir, tmp_path / "out", steps=4)
    base = math_of(JobConfig.from_dict(job).model_dump(mode="json"))
    assert {"model.path", "data.path", "lora.r", "training.optimizer.lr", "training.seed"} <= set(base)
    for section, change in [("training", {"steps": 40, "eval_every": 2, "log_every": 3}),
                            ("checkpoint", {"every": 1, "keep": 9}), ("cluster", {"num_workers": 2})]:
        other = json.loads(json.dumps(job))
        other[section] = {**other.get(section, {}), **change}
        assert math_of(JobConfig.from_dict(other).model_dump(mode="json")) == base, section
    other = json.loads(json.dumps(job))
    other["training"]["optimizer"] = {"lr": 1e-3}
    assert math_of(JobConfig.from_dict(other).model_dump(mode="json")) != base


# --- one run per output dir -----------------------------------------------------------------


@pytest.mark.job
def test_a_second_run_into_a_dir_with_a_run_is_refused_in_one_line_and_nothing_is_touched(model_dir, tmp_path):
    out = tmp_path / "out"
    first = run_in_process(JobConfig.from_dict(job_dict(model_dir, out, steps=2)))
    before = _listing(out)
    identity = RunIdentity.model_validate_json((out / RUN_FILE).read_text())
    assert first.run_id == identity.run_id
    with pytest.raises(ValueError) as err:
        JobConfig.from_dict(job_dict(model_dir, out, steps=2)).preflight()
    message = str(err.value)
    assert "\n" not in message and f"output.dir {out} holds run {identity.run_id}" in message
    assert "--resume latest" in message and "another output.dir" in message and "--overwrite" in message
    assert _listing(out) == before  # nothing written, nothing deleted

    # --overwrite moves the old run aside, whole, and the new one starts in the dir
    job = job_dict(model_dir, out, steps=2, output={"overwrite": True})
    second = run_in_process(JobConfig.from_dict(job).preflight().config)
    aside = out.with_name(f"out.old-{identity.run_id}")
    assert _listing(aside) == before
    assert second.run_id != first.run_id and (out / "summary.json").is_file()


@pytest.mark.job
def test_a_run_moved_aside_names_its_own_files_not_the_new_runs(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    job = job_dict(model_dir, out, steps=2, checkpoint={"every": 1}, output={"overwrite": True})
    first = run_in_process(JobConfig.from_dict(job))
    second = run_in_process(JobConfig.from_dict(job))
    aside = out.with_name(f"out.old-{first.run_id}").resolve()
    files = {"adapter_dir": aside / "adapter", "report": aside / "report.html",
             "checkpoint": aside / "checkpoints" / "step-000002"}
    moved = RunSummary.load(aside)
    assert {name: Path(getattr(moved, name)) for name in files} == files
    assert json.loads((aside / "summary.json").read_text())["checkpoint"] == "checkpoints/step-000002"
    assert main(["report", str(aside)]) == 0  # `vela report` on it: its own files, none of the new run's
    text = capsys.readouterr().out
    assert all(f"{name}: {path}" in text for name, path in [("adapter", files["adapter_dir"]),
                                                            ("checkpoint", files["checkpoint"])])
    assert f"{out}/" not in text
    # the new run in the dir, as it closes and as it loads, names its own
    closing = summary_text(second)
    assert f"adapter: {(out / 'adapter').resolve()}\n" in closing and f"{aside}/" not in closing
    assert RunSummary.load(out).adapter_dir == second.adapter_dir == str((out / "adapter").resolve())


def test_the_default_output_dir_is_the_config_files_name_not_one_shared_dir(model_dir, tmp_path):
    job = job_dict(model_dir, tmp_path / "unused")
    del job["output"]
    config = JobConfig.from_yaml(write_job(tmp_path / "mixtral-chat.yaml", job))
    assert config.output.dir == Path("runs/mixtral-chat")
    assert JobConfig.from_dict(job).output.dir.parent == Path("runs")  # in Python: runs/run-<date-time>


def test_preflight_leaves_no_output_dir_behind(model_dir, tmp_path):
    out = tmp_path / "deep" / "out"
    JobConfig.from_dict(job_dict(model_dir, out)).preflight()
    assert not (tmp_path / "deep").exists()  # the run creates it, after the cluster's checks too


# --- resume continues the same run, with its history ----------------------------------------


@pytest.mark.job
def test_resume_is_refused_on_other_math_allowed_on_more_steps_and_keeps_every_steps_history(model_dir, tmp_path):
    out = tmp_path / "out"
    job = job_dict(model_dir, out, steps=4, checkpoint={"every": 1, "keep": 10},
                   training={"optimizer": {"lr": 2e-3}})
    with pytest.raises(RunInterrupted):
        run_in_process(JobConfig.from_dict(job), should_stop=_stop_after(2))
    run_id = RunIdentity.model_validate_json((out / RUN_FILE).read_text()).run_id

    changed = json.loads(json.dumps(job))
    changed["training"]["optimizer"]["lr"] = 1e-3
    for attempt in (lambda c: c.preflight(), lambda c: run_in_process(c)):
        with pytest.raises(ValueError, match=r"training.optimizer.lr: checkpoint 0.002 vs this job 0.001") as err:
            attempt(JobConfig.from_dict(changed).with_resume("latest"))
        assert "\n" not in str(err.value)

    # resumed twice (the second time with more steps): the summary covers steps 1..5, each resume marked
    with pytest.raises(RunInterrupted):
        run_in_process(JobConfig.from_dict(job).with_resume("latest").preflight().config,
                       should_stop=_stop_after(1))
    longer = json.loads(json.dumps(job))
    longer["training"]["steps"] = 5
    summary = run_in_process(JobConfig.from_dict(longer).with_resume("latest").preflight().config)
    assert [h.step for h in summary.history] == [1, 2, 3, 4, 5] and len(summary.losses) == 5
    assert [r.step for r in summary.resumes] == [2, 3] and summary.run_id == run_id
    assert RunSummary.model_validate_json((out / "summary.json").read_text()).history == summary.history
    assert "resumed after step 2" in summary_text(summary) and "resumed after step 3" in summary_text(summary)
    assert "resumed in a new process" in (out / "report.html").read_text()


def test_pruning_keeps_every_checkpoint_of_another_run(tmp_path):
    root = tmp_path / "checkpoints"
    for run_id, steps, keep in (("other", [1, 2, 3], 10), ("mine", [4, 5, 6], 1)):
        for step in steps:
            staging = checkpoint.begin(root, step)
            checkpoint.write_json(staging / "trainer.json", {"step": step})
            checkpoint.finalize(staging, step, {"run_id": run_id}, keep=keep)
    assert [p.name for p in checkpoint.valid_checkpoints(root)] == [
        "step-000001", "step-000002", "step-000003", "step-000006"]


# --- small input items -------------------------------------------------------------------------


def test_a_tilde_path_is_the_home_directory(model_dir, tmp_path):
    home = Path.home()
    job = job_dict(model_dir, tmp_path / "out")
    job["model"]["path"] = "~/" + str(model_dir.relative_to(home)) if model_dir.is_relative_to(home) else "~"
    job["output"]["dir"] = "~/vela-runs/x"
    config = JobConfig.from_dict(job)
    assert not str(config.model.path).startswith("~") and config.output.dir == home / "vela-runs" / "x"


@pytest.mark.parametrize("section, key, pointer", [
    ("training", "learning_rate", "training.optimizer.lr"),
    ("training", "max_steps", "training.steps"),
    ("training", "num_train_epochs", "training.steps"),
    ("lora", "lora_rank", "lora.r"),
    (None, "model_name_or_path", "model.path"),  # LLaMA-Factory's flat files
    (None, "learning_rate", "training.optimizer.lr"),
    (None, "lora_rank", "lora.r"),
    (None, "num_train_epochs", "training.steps"),
])
def test_another_tools_field_name_points_to_ours(model_dir, tmp_path, section, key, pointer):
    job = job_dict(model_dir, tmp_path / "out")
    (job.setdefault(section, {}) if section else job)[key] = 3
    field = f"{section}.{key}" if section else key
    with pytest.raises(ValueError, match=rf"^config: {field}: unknown field \(vela-ray calls it '{pointer}'") as err:
        JobConfig.from_dict(job)
    if key == "num_train_epochs":
        assert "it counts optimizer steps, not epochs" in str(err.value)


@pytest.mark.parametrize("change", [
    {"training": {"steps": 0}}, {"training": {"method": "sgd"}}, {"lora": {"init_adapter": "/nonexistent"}},
], ids=["bound", "literal", "own-validator"])
def test_refusals_are_in_our_words_not_pydantics(model_dir, tmp_path, change):
    job = job_dict(model_dir, tmp_path / "out")
    for section, values in change.items():
        job[section] = {**job.get(section, {}), **values}
    with pytest.raises(ValueError) as err:
        JobConfig.from_dict(job)
    assert "Value error" not in str(err.value) and "Input should be" not in str(err.value)


def test_one_tracker_may_be_named_as_a_string_as_hugging_face_takes_it(model_dir, tmp_path):
    job = job_dict(model_dir, tmp_path / "out", training={"report_to": "tensorboard"})
    assert JobConfig.from_dict(job).training.report_to == ["tensorboard"]


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_pattern_key_that_is_no_regex_names_the_field_and_the_key(model_dir, tmp_path, field):
    job = job_dict(model_dir, tmp_path / "out", lora={field: {"experts.(gate": 8}})
    with pytest.raises(ValueError, match=rf"^config: lora: lora.{field} key 'experts.\(gate' is not a regular "
                                         r"expression \(missing \), unterminated subpattern at position 8\); peft"):
        JobConfig.from_dict(job)
