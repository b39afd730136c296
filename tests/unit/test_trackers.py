"""Experiment trackers (`training.report_to`): what each stores, read back with the tracker's own reader.

TensorBoard's event files through TensorBoard's EventAccumulator, an MLflow run through MlflowClient on a
local file store, a W&B offline run through its own datastore reader; a resumed run appends to the same
tracker run, and each tracker gets the checkpointed steps it lacks and no step twice; the queue never blocks
a step; a tracker that fails is dropped, the run goes on, its closing lines say so; MLflow without
MLFLOW_TRACKING_URI logs to a file store in output.dir; a tracker whose package is missing, or that could not
log here, is refused by preflight in one line. A hard kill: tests/unit/test_trackers_kill.py.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray import config as config_module
from vela_ray.config import JobConfig, missing_tracker_packages
from vela_ray.observability.report import summary_text
from vela_ray.observability.trackers import Tracker, Trackers, flat_params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


@pytest.fixture
def tracker_env(tmp_path, monkeypatch) -> Path:
    """MLflow on a local file store and W&B offline, both under `tmp_path`."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def _job(model_dir: Path, out: Path, steps: int, **sections) -> JobConfig:
    job = job_dict(model_dir, out, steps=steps, checkpoint={"every": 2},
                   training={"report_to": ["tensorboard", "mlflow", "wandb"], "eval_every": 2}, **sections)
    return JobConfig.from_dict(job)


def _tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def _wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a W&B offline run file (`run-<id>.wandb`): a 7-byte ":W&B" header, then
    LevelDB's log format (32 KiB blocks of records: crc32, length, type FULL/FIRST/MIDDLE/LAST, data).
    wandb 0.31 ships no Python reader of its own files any more, so the test reads the format, apart from
    `trackers.wandb_records` (what a resume reads a killed run's W&B files with): the oracle is not the code."""
    data, records, partial = path.read_bytes(), [], b""
    assert data[:4] == b":W&B", path
    position, block = 7, 32768
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a record header is padding
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        if kind == 0 and length == 0:
            break
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    return records


def _wandb_history(out: Path, run_id: str) -> list[dict]:
    """Every `history` record of the W&B offline runs of `run_id` under `out` (one per process that ran, in the
    order they began: `offline-run-<time>-<id>`, and `-1`, `-2`, ... after it for more in the same second)."""
    from wandb.proto import wandb_internal_pb2

    def began(path: Path) -> tuple[str, int]:
        time, _, suffix = path.parent.name.removeprefix("offline-run-").partition(f"-{run_id}")
        return time, int(suffix[1:] or 0)

    rows = []
    for path in sorted(out.glob(f"wandb/offline-run-*/run-{run_id}.wandb"), key=began):
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.job
def test_each_tracker_stores_the_steps_the_summary_and_a_resume_appends(model_dir, tracker_env):
    from mlflow import MlflowClient

    out = tracker_env / "out"
    first = _job(model_dir, out, steps=2)
    first.preflight()
    run_in_process(first)
    state = json.loads((out / "trackers.json").read_text())
    resumed = _job(model_dir, out, steps=4).with_resume("latest")
    resumed.preflight()
    summary = run_in_process(resumed)
    resumed_state = json.loads((out / "trackers.json").read_text())
    assert resumed_state["mlflow"]["run_id"] == state["mlflow"]["run_id"]  # the same tracker runs continued
    assert resumed_state["wandb"]["id"] == state["wandb"]["id"]
    assert (state["wandb"]["through"], resumed_state["wandb"]["through"]) == (2, 4)  # the last step each left

    losses = dict(enumerate(summary.losses, start=1))
    # TensorBoard: one scalar series per metric, steps 1..4 across both processes' event files
    tb_loss = _tensorboard_scalars(out / "tensorboard", "train/loss")
    assert sorted(tb_loss) == [1, 2, 3, 4]
    assert tb_loss == pytest.approx(losses, rel=1e-6)
    assert set(_tensorboard_scalars(out / "tensorboard", "eval/loss")) == {2, 4}
    assert all(v > 0 for v in _tensorboard_scalars(out / "tensorboard", "train/tokens_per_s").values())

    # MLflow: one run, its step history, the config as parameters, the summary and the artifacts
    client = MlflowClient()
    run = client.get_run(state["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(losses, rel=1e-6)
    assert {m.step for m in client.get_metric_history(run.info.run_id, "train/grad_norm")} == {1, 2, 3, 4}
    assert run.data.params["training.report_to"] == json.dumps(["tensorboard", "mlflow", "wandb"])
    assert float(run.data.params["training.optimizer.lr"]) == resumed.training.optimizer.lr
    assert run.data.metrics["final/loss"] == pytest.approx(summary.losses[-1])
    assert {"report.html", "placement.json", "summary.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert any(key.startswith("bytes/") for key in run.data.metrics)

    # W&B offline: the same run id in both processes, steps 1..4 with the losses
    rows = _wandb_history(out, state["wandb"]["id"])
    wandb_loss = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert wandb_loss == pytest.approx(losses, rel=1e-6)


def test_a_step_never_waits_for_a_slow_tracker_and_a_failing_one_is_dropped(tmp_path, caplog):
    release, seen = threading.Event(), []

    class Slow(Tracker):
        name = "slow"

        def where(self):
            return "logged nowhere"

        def metrics(self, step, values):
            release.wait(30)  # a tracker server that hangs until released
            seen.append(step)

        def finish(self, status):
            seen.append(status)

    class Failing(Slow):
        name = "failing"

        def metrics(self, step, values):
            raise ConnectionError("server gone\nsecond line")

    trackers = Trackers([Slow(), Failing()], tmp_path)
    for step in (1, 2, 3):
        trackers.step(step, {"loss": 1.0 / step, "eval": None})
    assert seen == []  # every step queued while the first is still being sent
    release.set()
    assert trackers.flush(30)
    assert seen == [1, 2, 3] and trackers.names == ["slow"]
    assert "tracker failing failed (ConnectionError: server gone); the run goes on without it" in caplog.text
    assert trackers.described()["failing"] == "dropped: ConnectionError: server gone"  # for the closing lines
    trackers.finish(None, [], "FINISHED")
    trackers.finish(None, [], "FAILED")  # idempotent: the runner's finally calls it again
    assert seen == [1, 2, 3, "FINISHED"]


def test_a_missing_tracker_package_is_refused_before_ray_in_one_line(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(config_module.TRACKER_PACKAGES, "wandb", ("vela_no_such_module", "wandb"))
    assert missing_tracker_packages(["tensorboard", "mlflow"]) is None
    config = _job(model_dir, tmp_path / "out", steps=2)
    with pytest.raises(ValueError) as err:
        config.preflight()
    assert str(err.value) == ("training.report_to names wandb, not installed here: pip install 'vela-ray[wandb]' "
                              "(or remove it from training.report_to)")
    assert not (tmp_path / "out").exists()


def test_flat_params_name_each_nested_field():
    assert flat_params({"training": {"optimizer": {"lr": 0.1}, "report_to": ["mlflow"]}, "a": "x"}) == {
        "training.optimizer.lr": "0.1", "training.report_to": '["mlflow"]', "a": "x"}


@pytest.mark.job
def test_an_interrupted_run_flushes_its_steps_and_ends_the_tracker_run_as_killed(model_dir, tracker_env):
    from mlflow import MlflowClient

    from vela_ray.errors import RunInterrupted

    out = tracker_env / "out"
    config = JobConfig.from_dict(job_dict(model_dir, out, steps=6,
                                          training={"report_to": ["tensorboard", "mlflow"]}))
    config.preflight()
    asked = iter([None, "Ctrl-C"])  # a stop asked after the second step
    with pytest.raises(RunInterrupted):
        run_in_process(config, should_stop=lambda: next(asked, "Ctrl-C"))
    run = MlflowClient().get_run(json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"])
    assert run.info.status == "KILLED"
    assert {m.step for m in MlflowClient().get_metric_history(run.info.run_id, "train/loss")} == {1, 2}
    assert sorted(_tensorboard_scalars(out / "tensorboard", "train/loss")) == [1, 2]


def _logged_steps(name: str, out: Path) -> dict[int, list[float]]:
    """Every value of `train/loss` the tracker `name` holds of the run in `out`, by step, read with its reader."""
    from mlflow import MlflowClient

    state = json.loads((out / "trackers.json").read_text())
    if name == "tensorboard":
        return {step: [value] for step, value in _tensorboard_scalars(out / "tensorboard", "train/loss").items()}
    rows = ([(m.step, m.value) for m in MlflowClient().get_metric_history(state["mlflow"]["run_id"], "train/loss")]
            if name == "mlflow" else [(r["_step"], r["train/loss"]) for r in _wandb_history(out, state["wandb"]["id"])])
    steps: dict[int, list[float]] = {}
    for step, value in rows:
        steps.setdefault(step, []).append(value)
    return steps


@pytest.mark.parametrize("name", ["tensorboard", "mlflow", "wandb"])
@pytest.mark.parametrize("held", [3, 11])
def test_a_resume_sends_a_tracker_the_checkpointed_steps_it_lacks_and_no_step_twice(name, held, tracker_env):
    """A killed run leaves a tracker fewer steps than its checkpoint (9) holds (`held` 3: a queue or a service's
    buffer lost the rest) or more (11: steps the resume redoes). The resume, from the checkpoint's record of
    what each step sent, leaves every step in it once."""
    out = tracker_env / name
    out.mkdir()
    loss = {step: 1.0 / step for step in range(1, 13)}
    killed = Trackers.open([name], out, "vela-test", "run")
    for step in range(1, held + 1):
        killed.step(step, {"train/loss": loss[step]})
    killed.finish(None, [], "KILLED")

    logged = {step: {"train/loss": loss[step]} for step in range(1, 10)}  # what checkpoint 9 kept
    resumed = Trackers.open([name], out, "vela-test", "run", first_step=10, logged=logged)
    for step in (10, 11, 12):
        resumed.step(step, {"train/loss": loss[step]})
    resumed.finish(None, [], "FINISHED")
    assert resumed.names == [name]
    assert _logged_steps(name, out) == {step: [pytest.approx(value)] for step, value in loss.items()}


@pytest.mark.job
def test_mlflow_without_a_tracking_uri_logs_to_a_file_store_in_the_output_dir_and_the_closing_lines_say_so(
        model_dir, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores the environment the run changes
        monkeypatch.delenv(name)
    out = tmp_path / "out"
    config = JobConfig.from_dict(job_dict(model_dir, out, steps=2, training={"report_to": ["tensorboard", "mlflow"]}))
    config.preflight()
    summary = run_in_process(config)

    store = (out / "mlruns").resolve().as_uri()
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(store)  # MLflow opens its file store with MLFLOW_ALLOW_FILE_STORE=true, as the run set
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2]
    assert summary.trackers == {"tensorboard": f"logged to {out / 'tensorboard'}",
                                "mlflow": f"logged to {store}, run {run_id}"}
    assert (f"trackers: tensorboard logged to {out / 'tensorboard'}; mlflow logged to {store}, run {run_id}"
            in summary_text(out).splitlines())


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    """W&B as on a machine where nobody logged in: no key in the environment or a netrc, no mode set."""
    import wandb

    def new_session():  # wandb reads its environment once per session; WANDB_SERVICE names a session's service
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    new_session()
    yield
    new_session()


def test_wandb_without_a_key_and_not_offline_is_refused_before_ray_in_one_line(model_dir, tmp_path, no_wandb_key):
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "out", steps=2, training={"report_to": "wandb"}))
    with pytest.raises(ValueError) as refused:
        config.preflight()
    assert str(refused.value) == (
        "training.report_to names wandb, but W&B is online and has no API key here: set WANDB_API_KEY (or run "
        "`wandb login`), or WANDB_MODE=offline to log to output.dir/wandb and upload it later with `wandb sync`")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("uri, allow, problem", [
    ("sqlite:///{tmp}/mlflow.db", None, "is a database store, which needs sqlalchemy (mlflow-skinny does not install "
                                        "it): pip install sqlalchemy, or unset MLFLOW_TRACKING_URI"),
    ("file://{tmp}/mlruns", None, "is a file store, which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true: set "
                                  "it, or unset MLFLOW_TRACKING_URI"),
    (None, "false", "MLFLOW_ALLOW_FILE_STORE is false and forbids the file store in output.dir/mlruns"),
])
def test_an_mlflow_store_that_cannot_open_here_is_refused_before_ray_in_one_line(uri, allow, problem, model_dir,
                                                                                 tmp_path, monkeypatch):
    for name, value in (("MLFLOW_TRACKING_URI", uri), ("MLFLOW_ALLOW_FILE_STORE", allow)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value.format(tmp=tmp_path))
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "out", steps=2, training={"report_to": "mlflow"}))
    with pytest.raises(ValueError) as refused:
        config.preflight()
    message = str(refused.value)
    assert message.startswith("training.report_to names mlflow, but ") and problem in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []  # nothing written: no database, no store, no output.dir
