"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed by master 0 (`training.report_to`).

    trackers = Trackers.open(config, out_dir, run_id, resuming=step > 0)   # starts (or continues) each run
    trackers.params(config)                 # the resolved config, flattened ("training.optimizer.lr")
    trackers.step(record, lr=..., grad_norm=..., placement_version=...)   # per step: queued, never blocks
    trackers.finish(summary, [report.html, placement.json], "FINISHED")   # flushes, then ends each run

Every call only puts work on a queue; one background thread talks to the trackers, so a slow tracker
(MLflow over HTTP, a wandb service starting) never holds up a step for more than the time it takes to
queue a dict. A tracker that fails is named in one warning and dropped; the run goes on without it.
`finish` (also on an interrupt, and on a clean stop after a lost worker: the runner calls it in a
`finally`) waits for the queue, then ends each tracker run with its status.

Resume continues the same tracker runs: their ids are kept in `output.dir/trackers.json`; TensorBoard
writes into the same directory with `purge_step`, so the steps redone after a resume replace the ones
logged after the checkpoint instead of doubling them.

Which server or directory each tracker writes to comes from its own environment, as anywhere else
(`MLFLOW_TRACKING_URI`; `WANDB_MODE`, `WANDB_DIR`, `WANDB_API_KEY`); TensorBoard writes to
`output.dir/tensorboard`. Nothing here logs an environment variable.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

logger = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
FLUSH_TIMEOUT_S = 120.0  # the longest `finish` waits for the queue (a tracker server that hangs)


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


# --- the trackers -------------------------------------------------------------------------------


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, log_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run's redone steps replace those logged after its checkpoint
        self.writer = SummaryWriter(str(log_dir), purge_step=first_step if first_step > 1 else None)

    def ids(self) -> dict:
        return {}

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


class _Mlflow:
    name = "mlflow"

    def __init__(self, project: str, run_name: str, previous: dict):
        from mlflow import MlflowClient

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, as mlflow reads it
        if previous.get("run_id"):
            self.run_id = previous["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def ids(self) -> dict:
        return {"run_id": self.run_id}

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params  # a resumed run's: MLflow refuses to change one
        items = [Param(k, v) for k, v in params.items() if k not in have]
        for start in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

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


class _Wandb:
    name = "wandb"

    def __init__(self, project: str, run_name: str, previous: dict, out_dir: Path):
        import wandb

        self.wandb = wandb
        self.run_id = previous.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=project, name=run_name, id=self.run_id, resume="allow",
                              dir=str(out_dir), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))

    def ids(self) -> dict:
        return {"id": self.run_id}

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, float | str]) -> None:
        self.run.summary.update({f"final/{k}": v for k, v in values.items()})

    def artifact(self, path: Path) -> None:
        artifact = self.wandb.Artifact(f"run-{self.run_id}-{path.stem}", type="run-output")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


# --- the queue ----------------------------------------------------------------------------------


class Trackers:
    """The run's trackers behind one background thread; see the module docstring. Empty `report_to`: every
    method is a no-op and no thread starts."""

    def __init__(self, trackers: list, out_dir: Path):
        self.trackers = trackers
        self.out_dir = out_dir
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._finished = False
        self.busy_s: dict[str, float] = {t.name: 0.0 for t in trackers}  # each tracker's time, on the thread
        if trackers:
            self._thread = threading.Thread(target=self._serve, name="vela-trackers", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, names: Iterable[str], out_dir: Path, project: str, run_name: str, first_step: int = 1
             ) -> "Trackers":
        """Start (or, with `trackers.json` in `out_dir` from the run being resumed, continue) each tracker of
        `names`. A tracker that cannot start is named in one warning and left out."""
        names = list(dict.fromkeys(names))
        if not names:
            return cls([], out_dir)
        state_file = out_dir / STATE_FILE
        previous = json.loads(state_file.read_text()) if state_file.is_file() and first_step > 1 else {}
        makers = {
            "tensorboard": lambda: _TensorBoard(out_dir / "tensorboard", first_step),
            "mlflow": lambda: _Mlflow(project, run_name, previous.get("mlflow", {})),
            "wandb": lambda: _Wandb(project, run_name, previous.get("wandb", {}), out_dir),
        }
        trackers = []
        for name in names:
            try:
                trackers.append(makers[name]())
            except Exception as err:  # the run goes on; the user sees which tracker and why
                logger.warning("tracker %s did not start, the run goes on without it: %s: %s", name,
                               type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        state_file.write_text(json.dumps({t.name: t.ids() for t in trackers}, indent=1))
        return cls(trackers, out_dir)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def params(self, params: dict[str, str]) -> None:
        self._each("params", params)

    def step(self, step: int, values: dict[str, float]) -> None:
        """Queue one step's metrics (numbers only; None values are left out)."""
        values = {k: float(v) for k, v in values.items() if v is not None}
        self._each("metrics", step, values)

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
                           type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self.trackers = [t for t in self.trackers if t is not tracker]

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            work()
