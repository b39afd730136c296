"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed by master 0 (`training.report_to`).

    trackers = Trackers.open(names, out_dir, project, run_name, first_step, logged)  # starts or continues each
    trackers.params(config)                 # the resolved config, flattened ("training.optimizer.lr")
    values = trackers.step(step, values)    # per step: queued, never blocks; returns the numbers it queued
    trackers.finish(summary, [report.html, placement.json], "FINISHED")   # flushes, then ends each run
    trackers.described()                    # where each logged, or why it stopped: the run's closing lines

Every call only puts work on a queue; one background thread talks to the trackers, so a slow tracker
(MLflow over HTTP, a wandb service starting) never holds up a step for more than the time it takes to
queue a dict. A tracker that fails is named in one warning and dropped; the run goes on without it, and
its closing lines say so (`described`). `finish` (also on an interrupt, and on a clean stop after a lost
worker: the runner calls it in a `finally`) waits for the queue, then ends each tracker run with its status.

Where each writes: TensorBoard to `output.dir/tensorboard`. MLflow to `MLFLOW_TRACKING_URI`, or without it
to a file store in `output.dir/mlruns`: mlflow-skinny's own default, `sqlite:///mlflow.db`, needs
sqlalchemy, which it does not install, and the file store is the one store it writes without more
packages. MLflow keeps that store in "maintenance mode" and opens it only with MLFLOW_ALLOW_FILE_STORE=true,
which this process sets (when unset) for the store it chose; read it back with the same variable set
(`MlflowClient("file:///.../mlruns")`). W&B where its environment says: online with an API key
(WANDB_API_KEY, `wandb login`), or WANDB_MODE=offline into `output.dir/wandb`, uploaded later by
`wandb sync`. Preflight refuses a tracker that could not log here (`config.tracker_problem`) before Ray
starts.
Nothing here logs an environment variable.

Resume, and a hard kill. A resume continues the same tracker runs (their ids are in `output.dir/trackers.json`),
and each step must be in each tracker once, with its value. A run killed by SIGKILL leaves each tracker what
reached it: steps past its last checkpoint, which the resume redoes, and maybe not every step before it
(what was still queued here; W&B's service writes its `.wandb` file every 15 s and, when its parent dies,
exits without writing the rest). So the checkpoint keeps what each step sent (`RunState.tracked`, `logged`
here), and on resume each tracker reads back, with its own reader, which steps it holds; it is sent the
checkpointed steps it lacks, then the resumed ones:
  - TensorBoard can take steps back: its writer purges (`purge_step`) from the first step it does not hold
    whole, and that step and the ones after it are written again;
  - MLflow and W&B cannot (MLflow appends to a metric's history; W&B renumbers a step behind its last one):
    they keep the steps they hold past the checkpoint and are not sent the resumed copies, the same values
    recomputed from the same state (a resume is exact: the same losses).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

from vela_ray.errors import first_line

logger = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
FLUSH_TIMEOUT_S = 120.0  # the longest `finish` waits for the queue (a tracker server that hangs)
Logged = dict[int, dict[str, float]]  # step -> the values sent for it


def flat_params(value: object, prefix: str = "") -> dict[str, str]:
    """A nested config as {"training.optimizer.lr": "0.0002"}: what every tracker takes as parameters.
    Lists stay one JSON value (a parameter per list item would say nothing)."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flat_params(item, f"{prefix}{key}."))
        return out
    text = value if isinstance(value, str) else json.dumps(value)
    return {prefix[:-1]: text[:6000]}  # MLflow's limit on a parameter's length


def mlflow_tracking_uri(out_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, or the file store in `out_dir/mlruns` (the module docstring says why)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()


# --- what a tracker holds -------------------------------------------------------------------------


def complete_through(logged: Logged, last: dict[str, int]) -> int:
    """The last step of `logged` whose every value a tracker holds, `last` being the last step it holds of each
    metric (a killed writer leaves out a tail, so the steps before it are held too); 0 when none."""
    for step in sorted(logged, reverse=True):
        if all(last.get(key, 0) >= step for key in logged[step]):
            return step
    return 0


def tensorboard_last_steps(log_dir: Path) -> dict[str, int]:
    """The last step of each scalar that TensorBoard's event files in `log_dir` hold, as its reader sees them:
    a writer's `purge_step` (a START event) drops the steps from there on that earlier files hold."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    last: dict[str, int] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):  # by name: by the time each was begun
        for event in EventFileLoader(str(path)).Load():
            if event.session_log.status == SessionLog.START:
                last = {tag: min(step, event.step - 1) for tag, step in last.items()}
            for value in event.summary.value:
                last[value.tag] = max(last.get(value.tag, 0), event.step)
    return last


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B run file (`run-<id>.wandb`, what `wandb sync` uploads): a 7-byte ":W&B" header, then
    LevelDB's log format (32 KiB blocks of chunks: crc32c, length, type FULL/FIRST/MIDDLE/LAST, data). The
    records end where a killed service stopped writing. wandb 0.31 ships no Python reader of its files."""
    data, partial = path.read_bytes(), b""
    position, block = 7, 32768
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        end = position + 7 + length
        if kind == 0 or end > len(data):
            return
        chunk, position = data[position + 7:end], end
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            yield partial


def wandb_last_step(path: Path) -> int:
    """The last history step a W&B run file holds; 0 when none."""
    from wandb.proto import wandb_internal_pb2

    last = 0
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            last = max(last, record.history.step.num)
    return last


# --- the trackers ---------------------------------------------------------------------------------


class Tracker:
    """What each tracker shares: it says which values it holds (`holds`), so a resume sends it the checkpointed
    steps it lacks (`catch_up`) and no step twice, and where it logged (`where`), for the run's closing lines."""

    name = ""

    def where(self) -> str:
        raise NotImplementedError

    def state(self) -> dict:
        """What a resumed process continues its run from (`trackers.json`)."""
        return {}

    def holds(self, step: int, key: str) -> bool:
        return False

    def metrics(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def catch_up(self, logged: Logged) -> None:
        """The checkpointed steps (`logged`) this tracker lacks, in order."""
        for step in sorted(logged):
            values = {key: value for key, value in logged[step].items() if not self.holds(step, key)}
            if values:
                self.metrics(step, values)


class _TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, log_dir: Path, first_step: int, logged: Logged):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.kept = self._kept(log_dir, first_step, logged)
        # on resume the steps after those kept are purged (the redone ones, a killed writer's incomplete tail)
        self.writer = SummaryWriter(str(log_dir), purge_step=self.kept + 1 if first_step > 1 else None)

    @staticmethod
    def _kept(log_dir: Path, first_step: int, logged: Logged) -> int:
        """The last step its files keep: none for a new run; on resume the last checkpointed step (`logged`) they
        hold whole; every step before `first_step` when the checkpoint kept no record (an older one's)."""
        if first_step == 1:
            return 0
        if not logged:
            return first_step - 1
        return complete_through(logged, tensorboard_last_steps(log_dir))

    def holds(self, step: int, key: str) -> bool:
        return step <= self.kept

    def where(self) -> str:
        return f"logged to {self.log_dir}"

    def params(self, params: dict[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self.writer.add_text("config", "| parameter | value |\n|---|---|\n" + table, 0)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def summary(self, values: dict[str, float | str]) -> None:
        self.writer.add_text("summary", json.dumps(values, indent=1), 0)

    def artifact(self, path: Path) -> None:
        pass  # TensorBoard keeps no files; the run's directory holds them

    def finish(self, status: str) -> None:
        self.writer.flush()
        self.writer.close()


class _Mlflow(Tracker):
    name = "mlflow"

    def __init__(self, project: str, run_name: str, previous: dict, out_dir: Path):
        from mlflow import MlflowClient

        self.uri = mlflow_tracking_uri(out_dir)
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's opt-in to the store chosen here
        self.client = MlflowClient(self.uri)
        self.last: dict[str, int] = {}  # the last step of each metric the run holds
        if previous.get("run_id"):
            self.run_id = previous["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self.last = {key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
                         for key in self.client.get_run(self.run_id).data.metrics}
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def state(self) -> dict:
        return {"run_id": self.run_id}

    def holds(self, step: int, key: str) -> bool:
        return step <= self.last.get(key, 0)

    def where(self) -> str:
        return f"logged to {self.uri}, run {self.run_id}"

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params  # a resumed run's: MLflow refuses to change one
        items = [Param(k, v) for k, v in params.items() if k not in have]
        for start in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """`values` it does not hold yet: a step redone after a resume (or a rollback) is not logged twice."""
        from mlflow.entities import Metric

        values = {k: v for k, v in values.items() if not self.holds(step, k)}
        if not values:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])
        self.last.update(dict.fromkeys(values, step))

    def summary(self, values: dict[str, float | str]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        numbers = [Metric(f"final/{k}", float(v), now, 0) for k, v in values.items() if isinstance(v, (int, float))]
        tags = [RunTag(f"final/{k}", str(v)) for k, v in values.items() if not isinstance(v, (int, float))]
        self.client.log_batch(self.run_id, metrics=numbers, tags=tags)

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


class _Wandb(Tracker):
    name = "wandb"

    def __init__(self, project: str, run_name: str, previous: dict, out_dir: Path):
        import wandb

        self.wandb = wandb
        self.run_id = previous.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=project, name=run_name, id=self.run_id, resume="allow",
                              dir=str(out_dir), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        # the last step the run holds; `through`: as a process that ended it (`finish`) left it
        self.last = max(self._last_step(out_dir), previous.get("through", 0)) if previous.get("id") else 0

    def _last_step(self, out_dir: Path) -> int:
        """The last step W&B holds of this run: online, the server's; offline, the last one in the run files of
        the run's earlier processes (a killed one's ends where its service last wrote)."""
        if self.run.disabled:
            return 0
        if not self.run.offline:
            return max(self.run.starting_step - 1, 0)
        own = Path(self.run.settings.sync_dir).resolve()
        files = [path for path in (out_dir / "wandb").glob(f"offline-run-*/run-{self.run_id}.wandb")
                 if path.parent.resolve() != own]  # offline-run-<time>-<id>, a "-1" after it when the time is taken
        return max((wandb_last_step(path) for path in files), default=0)

    def state(self) -> dict:
        """The run's id and the last step it holds. After `finish` its service still writes the run's file for a
        moment, so a resume in this same process may read the file short: it goes by this too."""
        return {"id": self.run_id, "through": self.last}

    def holds(self, step: int, key: str) -> bool:
        return step <= self.last

    def where(self) -> str:
        if self.run.disabled:
            return "logged nothing (WANDB_MODE=disabled)"
        if self.run.offline:
            return f"logged offline to {self.run.settings.sync_dir} (`wandb sync` uploads it)"
        return f"logged to {self.run.url}"

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """A step it does not hold yet: one redone after a resume (or a rollback) is not logged again."""
        if self.holds(step, ""):
            return
        self.run.log(values, step=step)
        self.last = step

    def summary(self, values: dict[str, float | str]) -> None:
        self.run.summary.update({f"final/{k}": v for k, v in values.items()})

    def artifact(self, path: Path) -> None:
        artifact = self.wandb.Artifact(f"run-{self.run_id}-{path.stem}", type="run-output")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


# --- the queue ----------------------------------------------------------------------------------


def _read_state(out_dir: Path) -> dict:
    """`trackers.json`: each tracker's `state`, as the run's last process left it; {} when there is none."""
    path = out_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_state(out_dir: Path, state: dict) -> None:
    """`trackers.json`, replaced whole (a SIGKILL leaves the old one or the new one)."""
    staging = out_dir / f"{STATE_FILE}.tmp"
    staging.write_text(json.dumps(state, indent=1))
    staging.replace(out_dir / STATE_FILE)


class Trackers:
    """The run's trackers behind one background thread; see the module docstring. Empty `report_to`: every
    method is a no-op and no thread starts."""

    def __init__(self, trackers: list[Tracker], out_dir: Path, dropped: dict[str, str] | None = None):
        self.trackers = trackers
        self.out_dir = out_dir
        self.dropped = dict(dropped or {})  # name -> why it logs no more
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._finished = False
        self.busy_s: dict[str, float] = {t.name: 0.0 for t in trackers}  # each tracker's time, on the thread
        if trackers:
            self._thread = threading.Thread(target=self._serve, name="vela-trackers", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, names: Iterable[str], out_dir: Path, project: str, run_name: str, first_step: int = 1,
             logged: Logged | None = None) -> "Trackers":
        """Start (or, with `trackers.json` in `out_dir` from the run being resumed, continue) each tracker of
        `names`; on resume (`first_step` > 1) send each the steps of `logged`, the resumed checkpoint's record
        of what each step sent, that it lacks. A tracker that cannot start is named in one warning and left
        out."""
        names, logged = list(dict.fromkeys(names)), logged or {}
        if not names:
            return cls([], out_dir)
        previous = _read_state(out_dir) if first_step > 1 else {}
        makers = {
            "tensorboard": lambda: _TensorBoard(out_dir / "tensorboard", first_step, logged),
            "mlflow": lambda: _Mlflow(project, run_name, previous.get("mlflow", {}), out_dir),
            "wandb": lambda: _Wandb(project, run_name, previous.get("wandb", {}), out_dir),
        }
        trackers, dropped = [], {}
        for name in names:
            try:
                trackers.append(makers[name]())
            except Exception as err:  # the run goes on; the user sees which tracker and why
                dropped[name] = f"did not start: {type(err).__name__}: {first_line(err)}"
                logger.warning("tracker %s did not start, the run goes on without it: %s: %s", name,
                               type(err).__name__, first_line(err))
        _write_state(out_dir, {t.name: t.state() for t in trackers})
        opened = cls(trackers, out_dir, dropped)
        if first_step > 1 and logged:
            opened._each("catch_up", logged)
        return opened

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def described(self) -> dict[str, str]:
        """Each tracker and where it logged the run, or why it stopped: for the run's closing lines."""
        return {t.name: t.where() for t in self.trackers} | self.dropped

    def params(self, params: dict[str, str]) -> None:
        self._each("params", params)

    def step(self, step: int, values: dict[str, float | None]) -> dict[str, float]:
        """Queue one step's metrics (numbers only; None values are left out); returns the numbers queued."""
        numbers = {k: float(v) for k, v in values.items() if v is not None}
        self._each("metrics", step, numbers)
        return numbers

    def finish(self, summary: dict[str, float | str] | None, artifacts: Iterable[Path], status: str) -> None:
        """The run's last words to every tracker: `summary`, the `artifacts` that exist, the end `status`
        (FINISHED, KILLED or FAILED); then waits for the queue (at most `FLUSH_TIMEOUT_S`). Idempotent: the
        runner calls it on every way out."""
        if self._finished or not self.trackers:
            return
        self._finished = True
        if summary:
            self._each("summary", summary)
        for path in artifacts:
            if path.is_file():
                self._each("artifact", path)
        self._each("finish", status)
        self._queue.put(None)
        self._thread.join(FLUSH_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("trackers %s still busy after %.0f s at the end of the run; not waiting longer",
                           ", ".join(self.names), FLUSH_TIMEOUT_S)
        _write_state(self.out_dir, _read_state(self.out_dir) | {t.name: t.state() for t in self.trackers})

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until everything queued so far has reached the trackers; False on timeout."""
        if not self.trackers or self._finished:
            return True
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)

    def _each(self, method: str, *args) -> None:
        for tracker in self.trackers:
            self._queue.put(lambda t=tracker: self._call(t, method, *args))

    def _call(self, tracker, method: str, *args) -> None:
        if tracker not in self.trackers:
            return
        start = time.perf_counter()
        try:
            getattr(tracker, method)(*args)
            self.busy_s[tracker.name] += time.perf_counter() - start
        except Exception as err:
            logger.warning("tracker %s failed (%s: %s); the run goes on without it", tracker.name,
                           type(err).__name__, first_line(err))
            self.dropped[tracker.name] = f"dropped: {type(err).__name__}: {first_line(err)}"
            self.trackers = [t for t in self.trackers if t is not tracker]

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            work()
