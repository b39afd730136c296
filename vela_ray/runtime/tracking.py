"""RunTracking: `training.report_to`'s trackers (TensorBoard, MLflow, W&B) over one run, as the runner drives them.

    tracking = RunTracking(config, state, accounting, out_dir)
    tracking.open()                      # once `state.start_step` is known: a resumed run's trackers go on
    tracking.step(live, record, lr)      # each step, after its eval
    tracking.flush()                     # before the summary: their background time is in its timings
    tracking.finish(summary, "FINISHED") # on every way out (FAILED and KILLED too; idempotent)

The trackers themselves (`observability.trackers.Trackers`) know nothing of the run's state; this stage
keeps what they sent and how long it took there (`state.tracked`, `state.timings_s`), so that a resumed
run sends each tracker only the steps it lacks.
"""

from __future__ import annotations

import time
from pathlib import Path

from vela_ray.config import JobConfig
from vela_ray.observability.trackers import Trackers, flat_params
from vela_ray.runtime.accounting import StepAccounting
from vela_ray.runtime.state import Live, RunState
from vela_ray.training.summary import RunSummary, StepRecord

ARTIFACTS = ("report.html", "placement.json", "summary.json")  # the run's files each tracker keeps


class RunTracking:
    """The run's trackers and what the run state records of them; none with an empty `report_to`."""

    def __init__(self, config: JobConfig, state: RunState, accounting: StepAccounting, out_dir: Path):
        self.config = config
        self.state = state
        self.accounting = accounting  # what a step's record becomes for the trackers (`StepAccounting.tracked`)
        self.out_dir = out_dir
        self.trackers = Trackers([], out_dir)  # none until `open`

    def open(self) -> None:
        """Start the trackers, continuing a resumed run's (each is sent the checkpointed steps it lacks); the
        resolved config as parameters."""
        cfg = self.config.training
        run_name = f"{self.out_dir.name}-{self.state.identity.run_id}"
        self.trackers = Trackers.open(cfg.report_to, self.out_dir, cfg.tracker_project, run_name,
                                      first_step=self.state.start_step + 1, logged=self.state.tracked)
        self.trackers.params(flat_params(self.config.model_dump(mode="json")))

    def step(self, live: Live, record: StepRecord, lr: float) -> None:
        """Queue `record`'s values. The training thread's share (a queued dict: the workers' counters came with
        their step) is timed as `trackers_step_s`; what was sent is kept for a resume."""
        if not self.trackers.trackers:
            return
        start = time.perf_counter()
        self.state.tracked[record.step] = self.trackers.step(record.step, self.accounting.tracked(live, record, lr))
        self.state.timings_s.setdefault("trackers_step_s", []).append(time.perf_counter() - start)

    def flush(self) -> None:
        """Wait until every step's values are sent, then record each tracker's background time."""
        self.trackers.flush()
        for name, seconds in self.trackers.busy_s.items():
            self.state.timings_s[f"tracker_{name}_busy_s"] = seconds

    def described(self) -> dict[str, str]:
        """Each tracker and where it logged the run, or why it stopped (`RunSummary.trackers`)."""
        return self.trackers.described()

    def finish(self, summary: RunSummary | None, status: str) -> None:
        """The trackers' end as `status`, with the summary and the run's files when it finished (`summary`)."""
        if summary is None:
            self.trackers.finish(None, [], status)
        else:
            self.trackers.finish(summary.tracked(), [self.out_dir / name for name in ARTIFACTS], status)
