"""A run's checkpoints: when one is due, what goes in, how it is written, settled, published and
restored (`CheckpointWriter`).

The writer decides its own cadence (`due`: every `checkpoint.every` steps and the last), gathers
what master 0 writes (its LoRA, AdamW state, the RNGs and `trainer.json`), stages the checkpoint,
has the workers write their experts' parts into it and publishes it through
`vela_ray.training.checkpoint` (the file format, atomic publication and the keep-`checkpoint.keep`
pruning live there), then records it in the run's `RunState`: `last_checkpoint`,
`routed_at_checkpoint` and the `checkpoint_stall_s` timings. `restore` loads one back into the
master, its peers and the workers.

With `checkpoint.asynchronous` the master and the workers only copy their state at the checkpoint
step; a background thread writes and publishes it while training goes on, and it becomes
`last_checkpoint` when the runner next calls `settle`. At most one is in flight.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vela_ray.config import JobConfig
from vela_ray.errors import CheckpointWriteError, ExpertWorkerError, first_line
from vela_ray.runtime.accounting import segment_totals
from vela_ray.runtime.pool import WorkerPool
from vela_ray.runtime.state import Live, ResumePoint, RunState
from vela_ray.training import checkpoint
from vela_ray.training.schedule import lr_at
from vela_ray.training.adapter_io import import_adapter
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import load_master_state, master_state
from vela_ray.training.summary import ResumeRecord

logger = logging.getLogger(__name__)

CHECKPOINT_POLL_S = 0.05  # how often an asynchronous checkpoint asks the workers whether their parts are written


@dataclass
class PendingCheckpoint:
    """A checkpoint between its snapshot and its publication (`checkpoint.asynchronous`)."""

    step: int
    routed_LE: np.ndarray | None  # tokens_routed_LE at its step
    stall_s: float  # how long training has stood still for it so far
    write: checkpoint.Background[Path] | None = None  # writes the files and publishes; returns the checkpoint


class CheckpointWriter:
    """Writes this run's checkpoints, synchronously or in the background, and publishes them into `state`."""

    def __init__(self, config: JobConfig, state: RunState, pool: WorkerPool):
        self.config = config
        self.state = state  # where a published checkpoint is recorded, and the routing it is saved with
        self.pool = pool  # says whether a failed write is a lost worker's (the runner recovers from those)
        self.writing: PendingCheckpoint | None = None  # an asynchronous checkpoint in flight: at most one

    def due(self, step: int) -> bool:
        """Whether the run checkpoints after `step`: every `checkpoint.every` steps, and at the end."""
        every = self.config.checkpoint.every
        return step == self.config.training.steps or bool(every and step % every == 0)

    def save_run(self, live: Live, step: int, stepper: dict | None = None) -> None:
        """Checkpoint of `step` (`save`) of what `live` holds; the adapters must be settled (ZO); `stepper`: the
        steps' own state (`Stepper.state`, ZO's trajectory). With `checkpoint.asynchronous` it becomes
        `state.last_checkpoint` at the next `settle()`."""
        self.settle()  # at most one in flight
        meta = {**live.backbone.checkpoint_meta(self.config.lora), "run_id": self.state.identity.run_id}
        self.save(step, live.workers, meta, lambda copy: self._contents(live, step, copy, stepper))

    def _contents(self, live: Live, step: int, copy: bool, stepper: dict | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict]:
        """What master 0 writes into the checkpoint of `step`: its LoRA, AdamW state and the torch RNGs
        (copied with `copy`: an asynchronous checkpoint writes them while training changes the originals),
        and `trainer.json` (where the run stands, its placement, config, profile, condenser and `stepper`)."""
        cfg, state, condenser = self.config, self.state, live.master.dispatcher.condenser
        tensors = master_state(live.master, copy=copy)
        tensors.update(checkpoint.rng_state())  # CPU, and CUDA's when this process used it
        trainer = {
            "step": step, "data_position": step, "total_steps": cfg.training.steps,
            "lr_next": lr_at(cfg.training.optimizer, step, cfg.training.steps),
            "placement": state.plan.model_dump(), "config": json.loads(cfg.model_dump_json()),
            "profile": None if state.placed_probs is None else np.asarray(state.placed_probs).tolist(),
            "access_profile": None if state.access_profile is None else state.access_profile.model_dump(mode="json"),
            "condenser": condenser.state() if condenser is not None else None, "stepper": stepper,
            "run": state.identity.model_dump(), "records": state.records(segment_totals(live, state)),
        }
        return tensors, trainer

    def start_state(self, live: Live, resume: ResumePoint | None) -> int:
        """Adapters and optimizer state to start from (the checkpoint's, `lora.init_adapter`'s or the
        initial ones) in every master and worker; returns the first step to run."""
        if resume:
            self.state.restore_records(resume.trainer.get("records", {}))
            self.state.resumes.append(ResumeRecord(step=resume.step, checkpoint=checkpoint.source_of(resume.path),
                                                   resumed_at=time.time()))
            return self.restore(live, resume.path)
        if self.config.lora.init_adapter:
            state = import_adapter(live.master, live.workers, self.config.lora.init_adapter)
        else:
            state = master_state(live.master)
        live.masters.load_state(state)
        return 0

    def restore(self, live: Live, ref: Path | str) -> int:
        """Every adapter, AdamW state and the RNG as checkpoint `ref` (a directory, or a URI on object storage)
        saved them; returns its step. The workers read their parts where the checkpoint is, on their nodes."""
        path = checkpoint.local_copy(ref)
        live.workers.load_checkpoint(checkpoint.source_of(path))
        tensors = checkpoint.read_tensors(path / "backbone.safetensors")
        load_master_state(live.master, tensors)
        live.masters.load_state(tensors)  # the checkpoint's full tensors: every master, or rank, takes its own
        condenser = live.master.dispatcher.condenser
        if condenser is not None:  # master 0's losses, into every rank's condenser: one threshold
            saved = json.loads((path / "trainer.json").read_text()).get("condenser")
            condenser.load_state(saved)
            live.masters.load_condenser_state(saved)
        checkpoint.restore_rng_state(tensors)
        return int(checkpoint.verify(path, checksums=False)["step"])

    def save(self, step: int, workers: ExpertWorkers, meta: dict,
             contents: Callable[[bool], tuple[dict[str, torch.Tensor], dict]]) -> None:
        """Atomic checkpoint of `step`: workers write their experts' parts in parallel, the master the rest,
        `contents(copy)`: its tensors and `trainer.json` (copied with `copy`, as an asynchronous checkpoint is
        written from them while training goes on); `meta` goes into the manifest. `state.last_checkpoint`
        names it once published. With `checkpoint.asynchronous` the master and the workers only copy their
        state here and write it on threads while training goes on; it is published in the background and
        becomes `last_checkpoint` at the next `settle`, which must come before the next `save`."""
        assert self.writing is None, "settle() the checkpoint in flight first: at most one is"
        cfg, asynchronous = self.config, self.config.checkpoint.asynchronous
        start = time.perf_counter()
        staging = checkpoint.begin(cfg.checkpoint_root, step)
        tensors, trainer = contents(asynchronous)
        routed = self.state.tokens_routed_LE
        workers.snapshot_checkpoint_parts(checkpoint.parts_dir(cfg.checkpoint_root, staging, step))

        def write() -> Path:
            checkpoint.write_tensors(staging / "backbone.safetensors", tensors)
            checkpoint.write_json(staging / "trainer.json", trainer)
            workers.finish_checkpoint_parts(poll_s=CHECKPOINT_POLL_S if asynchronous else None)
            return checkpoint.finalize(staging, step, meta, keep=cfg.checkpoint.keep, root=cfg.checkpoint_root)

        pending = PendingCheckpoint(step, None if routed is None else routed.copy(), 0.0)
        if asynchronous:
            pending.write = checkpoint.Background(write, name=f"vela-checkpoint-{step}")
            pending.stall_s = time.perf_counter() - start
            self.writing = pending
            logger.info("checkpoint of step %d: state copied in %.3f s, writing it in the background", step,
                        pending.stall_s)
        else:
            final = write()
            pending.stall_s = time.perf_counter() - start
            self._publish(pending, final)

    def settle(self, *, failing: bool = False) -> None:
        """Wait for the asynchronous checkpoint in flight, if any; once published it is `last_checkpoint`.

        If its writing failed, nothing of it was published (its staging directory goes with the next
        prune) and this raises `CheckpointWriteError` with the cause; a lost worker's own error instead,
        so that the runner recovers. With `failing` (the run is failing or recovering already) it logs.
        """
        pending, self.writing = self.writing, None
        if pending is None:
            return
        start = time.perf_counter()
        try:
            final = pending.write.result()
        except Exception as err:
            cause = _one_line(err)
            if failing:
                logger.warning("asynchronous checkpoint of step %d dropped, nothing of it published: %s",
                               pending.step, cause)
                return
            if self.pool.lost_workers(err) is not None:
                raise
            raise CheckpointWriteError(pending.step, f"{cause}; nothing of it was published; "
                                                     f"{self.resume_hint()}") from err
        pending.stall_s += time.perf_counter() - start
        self._publish(pending, final)

    def resume_hint(self) -> str:
        """What an error that stops the run tells the user to go on from: the newest published checkpoint."""
        last = self.state.last_checkpoint
        if last is None:
            return "no checkpoint was written yet; set checkpoint.every to bound lost work"
        return f"resume from checkpoint {last} with `vela train --config ... --resume {last}`"

    def _publish(self, pending: PendingCheckpoint, final: Path | str) -> None:
        self.state.last_checkpoint, self.state.routed_at_checkpoint = final, pending.routed_LE
        self.state.timings_s.setdefault("checkpoint_stall_s", []).append(pending.stall_s)
        logger.info("checkpoint %s published (training stood still %.3f s for it)", final, pending.stall_s)


def _one_line(err: BaseException) -> str:
    """An error as one line: a worker's own message (not Ray's traceback around it), else the first line."""
    if isinstance(err, ExpertWorkerError):
        return f"expert worker {err.worker}: {err.message}"
    return f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else type(err).__name__
