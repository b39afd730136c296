"""A lost worker during a run (`Recovery`): named with the checkpoint to resume from, or, with
`fault_tolerance.on_worker_loss: recover`, replaced in place and the run rolled back to its last checkpoint
and replayed from there (at most `fault_tolerance.max_recoveries` times).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from vela_ray.config import FaultToleranceSection
from vela_ray.errors import WorkerLostError
from vela_ray.runtime.checkpointing import CheckpointWriter
from vela_ray.runtime.features import RunFeature
from vela_ray.runtime.migration import copies_of
from vela_ray.runtime.placer import Placer
from vela_ray.runtime.pool import WorkerPool
from vela_ray.runtime.state import Live, RunState
from vela_ray.training.summary import RecoveryRecord

logger = logging.getLogger(__name__)


class Recovery:
    def __init__(self, fault_tolerance: FaultToleranceSection, num_workers: int, pool: WorkerPool, state: RunState,
                 checkpoints: CheckpointWriter, placer: Placer, features: list[RunFeature]):
        """`num_workers` (`cluster.num_workers`): every worker is started afresh after a loss mid-migration."""
        self.fault_tolerance = fault_tolerance
        self.num_workers = num_workers
        self.pool = pool
        self.state = state
        self.checkpoints = checkpoints
        self.placer = placer
        self.features = features

    @property
    def enabled(self) -> bool:
        return self.fault_tolerance.on_worker_loss == "recover"

    def guarded(self, step: int, work: Callable[[], None]) -> None:
        """Run `work`; a lost worker becomes a WorkerLostError naming it and the checkpoint to resume from."""
        try:
            work()
        except Exception as err:
            dead = self.pool.lost_workers(err)
            if dead is None:
                raise
            self.checkpoints.settle(failing=True)  # the hint names the newest checkpoint that got published
            # every worker answers: the actor that died was another master process
            who = f"ExpertManager worker(s) {dead}" if dead else ("another master process (a MasterRank: a "
                                                                  "data-parallel master or a tensor-parallel rank)")
            raise WorkerLostError(dead, f"{who} died during step {step + 1}; training "
                                        f"stopped and its in-memory state since the last checkpoint is discarded; "
                                        f"{self.checkpoints.resume_hint()}. Cause: {err}") from None

    def recover(self, lost: WorkerLostError, live: Live, step: int) -> int:
        """New workers in place of the lost ones (into `live`), everyone back to the last checkpoint;
        returns the step to go on from (the steps since are replayed). Re-raises `lost` when recovery is
        off, used up, or has no checkpoint of this run to go back to."""
        self.checkpoints.settle(failing=True)  # the one in flight, once published, is the one to go back to
        state, last = self.state, self.state.last_checkpoint
        if not self.enabled or len(state.recoveries) >= self.fault_tolerance.max_recoveries or last is None:
            raise lost
        start = time.perf_counter()
        logger.warning("expert worker(s) %s lost during step %d: replacing them and rolling back to %s",
                       lost.workers, step + 1, last)
        # Lost mid-migration, the survivors host parts of two tables: start all of them afresh on the old one.
        replaced = list(range(self.num_workers)) if state.migrating else lost.workers
        state.migrating = False
        try:
            live.hosted = self.pool.replace(replaced)
        except Exception as exc:  # e.g. the lost node's resources never came back
            raise WorkerLostError(lost.workers, f"{lost.message}. Replacing them failed: {exc}") from None
        live.workers.set_copies(copies_of(state.tables))
        for feature in self.features:
            feature.workers_replaced(live)
        live.master.dispatcher.rebind(live.master.dispatcher.expert_to_worker, live.hosted.transport)
        live.masters.restart_ranks(self.pool, live.hosted.transport, live.hosted.node_ids, state.tables)
        self.placer.write_workers(live)
        # the failed step's partial gradients (the workers drop theirs, and their saved graphs, as they load)
        live.master.optimizer.zero_grad(set_to_none=False)
        done = self.checkpoints.restore(live, last)
        state.roll_back_to(done)
        state.recoveries.append(RecoveryRecord(step=step + 1, workers=lost.workers, checkpoint_step=done,
                                               seconds=time.perf_counter() - start, restored_at=time.time()))
        logger.warning("recovered in %.2f s; replaying steps %d..%d", state.recoveries[-1].seconds,
                       done + 1, step + 1)
        return done
