"""MasterActor: the Ray shell around one run of `vela_ray.runtime.runner.JobRunner`.

It runs on the driver's node and holds the backbone; the ExpertManagers are a
`RayWorkerPool` (with `cluster.workers_on_master`, some of them in this process on the master's
device), or with every worker there and one master process an `InProcessPool` (one GPU runs a whole job, rows
passed by direct call); metrics go to Ray's
exporter. All of the run's logic is the runner's, which tests drive in one process over
`InProcessPool`.

The actor takes several calls at once (`max_concurrency` in `vela_ray.api`): `run`; `stop(reason)` from the
driver on Ctrl-C or SIGTERM; and with several master processes and `cluster.workers_on_master`, the other
processes' calls of the ExpertManagers in this one (`call_local`). The runner checks between steps and
stops after a checkpoint. It also stops when its driver process is gone (a SIGKILLed
`vela train`), instead of training on until Ray notices the owner died.
"""

from __future__ import annotations

import logging
import threading

import psutil
import ray

from actors.metrics import RayMetricsBackend
from actors.pool import RayWorkerPool
from vela_ray.config import JobConfig
from vela_ray.observability.metrics import MetricsSink
from vela_ray.quiet import silence_known_warnings
from vela_ray.runtime.local import InProcessPool
from vela_ray.runtime.runner import JobRunner
from vela_ray.training.summary import RunSummary

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class MasterActor:
    def __init__(self, config: JobConfig, driver_pid: int | None = None):
        self.config = config
        self.driver_pid = driver_pid  # on this node: the actor is pinned to the driver's node
        self._stop_reason: str | None = None
        self._stop = threading.Event()
        self._pool: RayWorkerPool | None = None

    def ready(self) -> bool:
        """Returns at once: the driver waits on it, with a deadline, to know the actor was scheduled."""
        return True

    def run(self) -> RunSummary:
        """The whole job; returns the summary also written to `output.dir/summary.json`."""
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # INFO lines reach the driver's terminal
        silence_known_warnings()
        node = ray.get_runtime_context().get_node_id()
        # the one-GPU configuration: experts beside the backbone, and no other master process to reach them
        if self.config.cluster.num_worker_actors == 0 and self.config.master_processes == 1:
            pool = InProcessPool(self.config, device="cuda" if self.config.cluster.master_gpus else "cpu",
                                 master_node=node)
        else:
            pool = self._pool = RayWorkerPool(self.config, node, home=ray.get_runtime_context().current_actor)
        runner = JobRunner(self.config, pool, MetricsSink(RayMetricsBackend()), should_stop=self.stop_reason,
                           hold_output=False)  # the driver holds output.dir (`VelaJob.run`)
        return runner.run()

    def call_local(self, worker: int, method: str, *args, **kwargs):
        """Another master process's call of an ExpertManager in this process (`actors.workers.HomeWorker`)."""
        return self._pool.call_local(worker, method, *args, **kwargs)

    def stop(self, reason: str) -> None:
        """Ask the run to stop after the step in flight (and its checkpoint)."""
        self._stop_reason = reason
        self._stop.set()

    def stop_reason(self) -> str | None:
        if self._stop.is_set():
            return self._stop_reason
        if self.driver_pid is not None and not psutil.pid_exists(self.driver_pid):
            return f"the driver (pid {self.driver_pid}) is gone"
        return None
