"""JobRunner: one vela-ray run, from a JobConfig to `output.dir`, over any WorkerPool.

The runner is a short driver over stage objects, each in its own module, and the run's state in
one place (`runtime.state`: `RunState`, and `Live`, what it trains with):
  1. the resume point (`ResumePoint.of`), verified before anything is written;
  2. `pool.launch(table)`: the workers start loading the resumed placement's experts, or the
     sequential one's, while this process loads tokenizer, data and backbone (`Backbone`);
  3. `pool.start(table)`, then the masters (`runtime.masters.MasterGroup`): master 0 built over the workers, the
     other ranks of the masters' mesh started and built the same way;
  4. the placement settled (`runtime.placer.Placer`: profile, links, compute, capacities, solve,
     move the experts between the live workers) and the features told (`runtime.features`);
  5. the start state (`runtime.checkpointing.CheckpointWriter.start_state`), then the steps: a
     `Stepper` step (first-order or ZO), its record and metrics (`runtime.accounting`), each
     feature's hook, eval, the trackers' values (`runtime.tracking`), a checkpoint when the writer
     says one is due, a stop when asked, a re-placement when the placer's policy says so; a lost
     worker is named or, with `fault_tolerance.on_worker_loss: recover`, replaced in place and the
     run rolled back (`runtime.recovery`);
  6. the peft adapter exported, `summary.json` (`RunSummary`) and `report.html` written, the trackers
     finished and, for an `output.dir` on object storage, the outputs uploaded (`storage.push_outputs`).

The MasterActor (`actors.master`) is a thin shell that runs this over `RayWorkerPool`;
tests run it in one process over `InProcessPool`.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable

from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_rows, micro_batches, on_device, sequential_batches
from vela_ray.errors import RunInterrupted, WorkerLostError
from vela_ray.observability.metrics import MetricsSink
from vela_ray.observability.report import write_report
from vela_ray.preflight import check_output_free
from vela_ray.runs import RunIdentity, hold_output_dir, move_aside
from vela_ray.runtime.accounting import StepAccounting
from vela_ray.runtime.checkpointing import CheckpointWriter
from vela_ray.runtime.features import run_features, stepper_for
from vela_ray.runtime.masters import MasterGroup, condenser_for, master_spec
from vela_ray.runtime.migration import copies_of
from vela_ray.runtime.placer import Placer
from vela_ray.runtime.pool import WorkerPool
from vela_ray.runtime.recovery import Recovery
from vela_ray.runtime.state import Backbone, Live, ResumePoint, RunState
from vela_ray.runtime.tracking import RunTracking
from vela_ray.storage import is_remote, pull_outputs, push_outputs
from vela_ray.training import checkpoint
from vela_ray.training.schedule import lr_at
from vela_ray.training.adapter_io import export
from vela_ray.training.preference import metric_means
from vela_ray.training.summary import RunSummary, StepRecord

logger = logging.getLogger(__name__)

StopCheck = Callable[[], "str | None"]  # why the run should stop now, or None to go on


class JobRunner:
    """Runs one job over `pool`; see the module docstring for the stages."""

    def __init__(self, config: JobConfig, pool: WorkerPool, metrics: MetricsSink | None = None,
                 should_stop: StopCheck = lambda: None, hold_output: bool = True):
        """`hold_output`: hold output.dir for the run (`runs.hold_output_dir`) and check it again under the hold;
        False where the process that started this runner holds it (the driver, `VelaJob.run`, for the master)."""
        self.config = config
        self.pool = pool
        self.hold_output = hold_output
        self.metrics = metrics or MetricsSink()
        self.spec = master_spec(config)  # the device check happens here, before any worker starts
        self.should_stop = should_stop
        self.out_dir = config.output_local_dir  # output.dir, or its local mirror when that is on object storage
        self.state = RunState()
        self.checkpoints = CheckpointWriter(config, self.state, pool)
        in_flight = config.training.overlap.in_flight(config)  # micro-batches at once: the step and its prediction
        self.placer = Placer(config, pool, self.state, self.metrics, self.out_dir, in_flight)
        self.accounting = StepAccounting(config, self.state, self.metrics)
        self.stepper = stepper_for(config.training, in_flight)
        self.condenser = condenser_for(config.training.condensation)
        self.features = run_features(config, self.metrics, self.condenser)
        self.recovery = Recovery(config.fault_tolerance, config.cluster.num_workers, pool, self.state, self.checkpoints,
                                 self.placer, self.features)
        self.live: Live | None = None  # from the master's build to the end of the run
        self.tracking = RunTracking(config, self.state, self.accounting, self.out_dir)  # opened at the first step
        self.metrics.set_method(config.training.method)

    def run(self) -> RunSummary:
        """The run (module docstring), output.dir held throughout unless the driver holds it (`hold_output`)."""
        held = hold_output_dir(self.out_dir, self.config.output.dir) if self.hold_output else nullcontext()
        with held:
            return self._run()

    def _run(self) -> RunSummary:
        started = time.perf_counter()
        resume = ResumePoint.of(self.config)  # `latest` may set a corrupt checkpoint aside: under the hold
        if self.hold_output:
            check_output_free(self.config.output, resume.path if resume else None)  # since the caller's preflight
        self.state.identity = resume.run if resume and resume.run else RunIdentity.new(
            self.config.model_dump(mode="json"))
        table = self.state.tables = self.placer.initial_table(resume)
        self.pool.launch(table)  # the workers load their experts while this process loads the backbone
        status = "FAILED"  # what the trackers' run ends as
        try:
            live = self.live = self._start(Backbone.load(self.config, self.spec), table, resume)
            self.placer.settle(live, table, resume)
            for feature in self.features:
                feature.after_placement(live)
            self.placer.publish(live)
            self.state.start_step = self.checkpoints.start_state(live, resume)
            self.stepper.resume(live, resume.trainer.get("stepper") if resume else None)
            self.state.timings_s["startup_s"] = time.perf_counter() - started  # until the first step
            self.tracking.open()
            self._train(live)
            export(live.master, live.workers, self.out_dir / "adapter")
            if (steps_state := self.stepper.state()) is not None:  # ZO's trajectory, beside the adapter
                checkpoint.write_json(self.out_dir / checkpoint.STEPPER_FILE, steps_state)
            self.tracking.flush()  # the steps' metrics sent: their background time goes into the summary
            summary = self.accounting.summary(live, self.pool.master_node, self.out_dir)
            summary.trackers = self.tracking.described()
            summary.write(self.out_dir)  # the report reads it back
            write_report(self.out_dir)
            status = "FINISHED"
            self.tracking.finish(summary, status)
            return summary
        except RunInterrupted:
            status = "KILLED"
            raise
        finally:
            self.tracking.finish(None, status)  # flushed on every way out (a no-op after the one above)
            if is_remote(self.config.output.dir) and self.out_dir.is_dir():  # what the run got to write
                push_outputs(self.config.output.dir, self.out_dir, failing=status != "FINISHED")
            if self.live is not None:
                self.live.masters.close()
            self.pool.close()

    def _start(self, backbone: Backbone, table, resume: ResumePoint | None) -> Live:
        """The workers up, master 0 built over them, the other masters started; `config.json` written."""
        if resume:
            checkpoint.check_compatible(resume.manifest, backbone.checkpoint_meta(self.config.lora), resume.path)
        if is_remote(self.config.output.dir):
            pull_outputs(self.config.output.dir, self.out_dir, fresh=resume is None)
        elif self.config.output.overwrite and not resume:
            move_aside(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.state.identity.write(self.out_dir)
        (self.out_dir / "config.json").write_text(self.config.model_dump_json(indent=1))
        hosted = self.pool.start(table)
        hosted.workers.set_copies(copies_of(table))
        masters = MasterGroup.start(self.config, self.pool, hosted.transport, hosted.node_ids, table, backbone.model,
                                    latency=self.metrics.latency, condenser=self.condenser)
        return Live(backbone, masters, hosted)

    # --- training --------------------------------------------------------------------------

    def _train(self, live: Live) -> None:
        """The training loop, from `state.start_step` to `training.steps`."""
        steps = self.config.training.steps
        live.master.dispatcher.reset_traffic()
        live.masters.reset_traffic()  # what the training moves: a tensor-parallel master's ranks profiled too
        self.state.last_checkpoint = checkpoint.latest(self.config.checkpoint_root)
        step = self.state.start_step
        if self.recovery.enabled and (step == 0 or not self.state.checkpointed(step)):
            self._checkpoint(live, step)  # to roll back to
            self.checkpoints.settle()  # published before any step: there always is one
        self.accounting.begin_training(live)
        self.state.train_started = time.perf_counter()
        try:
            while step < steps:
                try:
                    self.recovery.guarded(step, lambda: self._step(live, step))
                    self._stop_if_asked(live, step + 1)
                    self.recovery.guarded(step, lambda: self.placer.replan(live, step + 1))
                except WorkerLostError as lost:
                    step = self.recovery.recover(lost, live, step)
                    self.accounting.begin_training(live)
                    continue
                step += 1
        finally:
            self.checkpoints.settle(failing=True)  # a failing run leaves none in flight (the last step's is settled)
        self.state.timings_s["train_s"] = time.perf_counter() - self.state.train_started
        self.stepper.settle(live)  # eval and export read the adapters
        history = self.state.history
        if history and history[-1].eval_loss is None:
            self._eval(live, history[-1])
        self.accounting.end_training(live)

    def _step(self, live: Live, step: int) -> None:
        cfg = self.config.training
        rows = batch_rows(live.backbone.train_set, step, cfg.batch_size, cfg.seed)
        micro = micro_batches(live.backbone.train_set.rows(rows),
                              (cfg.micro_batch_size or cfg.batch_size) * live.backbone.train_set.group)
        tokens = int(live.backbone.train_set.attention_mask[rows].sum())  # padding excluded
        mark = self.accounting.begin_step(live)
        lr = lr_at(cfg.optimizer, step, cfg.steps)
        start = time.perf_counter()
        peers_done = live.masters.start_step(micro, lr, cfg.optimizer.max_grad_norm)
        try:
            loss = self.stepper.step(live, [on_device(m, self.spec.device) for m in micro], lr, step,
                                     live.masters.loss_fn())
        except BaseException as err:
            live.masters.abort(err)
            raise
        peer_steps = peers_done()
        step_time = time.perf_counter() - start
        record = self.accounting.end_step(live, mark, step + 1, loss, step_time, tokens, peer_steps,
                                          self.placer.drift)
        for feature in self.features:
            feature.after_step(live, record)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            self.stepper.settle(live)
            self._eval(live, record)  # after the step's record: its routing is not counted
        self.state.history.append(record)
        self.tracking.step(live, record, lr)
        if self.checkpoints.due(step + 1):
            self._checkpoint(live, step + 1)
        if step + 1 == cfg.steps:
            self.checkpoints.settle()  # the run's last checkpoint is published before it ends
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            logger.info("step %d/%d loss %.4f%s (%.2f s)", step + 1, cfg.steps, loss,
                        "" if record.eval_loss is None else f" eval {record.eval_loss:.4f}", step_time)

    def _eval(self, live: Live, record: StepRecord) -> None:
        """The held-out loss into `record` (and a preference objective's metrics over the held-out pairs)."""
        cfg = self.config.training
        batches = sequential_batches(live.backbone.eval_set, cfg.batch_size, cfg.eval_batches)
        record.eval_loss = live.masters.evaluate(batches)
        sums = live.masters.eval_sums()
        record.eval_preference = None if sums is None else metric_means([sums])

    def _checkpoint(self, live: Live, step: int) -> None:
        """Checkpoint of `step`, of settled adapters (a ZO step's update applied)."""
        self.checkpoints.settle()
        self.stepper.settle(live)
        self.checkpoints.save_run(live, step, self.stepper.state())

    def _stop_if_asked(self, live: Live, done: int) -> None:
        """Between steps: stop cleanly when asked (Ctrl-C, SIGTERM, the driver gone), with a checkpoint."""
        reason = self.should_stop()
        if reason is None or done == self.config.training.steps:
            return
        self.checkpoints.settle()  # the one in flight may be of step `done`
        if not self.state.checkpointed(done):
            self._checkpoint(live, done)
            self.checkpoints.settle()
        raise RunInterrupted(done, str(self.state.last_checkpoint), reason)
