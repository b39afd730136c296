"""The driver API: `VelaJob(config).run()`.

    from vela_ray.api import VelaJob
    from vela_ray.config import JobConfig
    summary = VelaJob(JobConfig.from_yaml("job.yaml")).run()     # a RunSummary

The config is validated and pre-flighted (model files, data, output dir, resume
point, capacity) before Ray starts. `run` holds the output dir from start to end
(`runs.hold_output_dir`: another run into it meanwhile is refused in one line) and
checks it again under that hold. Then the driver connects to Ray (the given
address, else RAY_ADDRESS as set by `ray job submit`, else a fresh local Ray),
checks the cluster's resources against the request, starts the MasterActor on its
own node and waits for it.

Errors reach the caller as the exception the actor raised (a ValueError for bad input,
`WorkerLostError`, `RunInterrupted`, ...), not as Ray's wrapper: `ray.get`'s
RayTaskError is unwrapped to its cause, and its full traceback goes to the log at DEBUG.
Ctrl-C and SIGTERM ask the master to stop after the step in flight and its checkpoint
(a second Ctrl-C kills it at once); the run then raises `RunInterrupted` naming the
checkpoint to resume from.

After the run, the driver adds the report's Samples (`vela_ray.generate.add_samples`). What was trained
exports for serving, and generates, from here too (`vela export`, `vela generate`):

    from vela_ray.api import export_run, generate
    export_run("runs/job", "merged", "serve/job")                # or "peft", "per-expert"
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.expert_parallel import run_expert_parallel
from actors.master import MasterActor
from actors.transports import data_plane_env
from vela_ray.config import JobConfig
from vela_ray.errors import ClusterError, RunInterrupted, StartupInterrupts, VelaActorError, first_line
from vela_ray.export import export_run  # the Python API of `vela export`
from vela_ray.generate import add_samples, generate  # `generate`: the Python API of `vela generate`
from vela_ray.local_ray import LocalRay, local_resources, start_local_ray, stop_local_ray
from vela_ray.preflight import (Preflight, check_cluster_resources, check_output_free, master_gpus,
                                master_unschedulable)
from vela_ray.quiet import silence_known_warnings
from vela_ray.runs import hold_output_dir
from vela_ray.training import checkpoint
from vela_ray.training.summary import RunSummary

__all__ = ["VelaJob", "export_run", "generate"]
logger = logging.getLogger(__name__)

STOP_GRACE_S = 600  # how long a stopping run may take to finish its step and checkpoint
# How long the MasterActor may stay pending on the driver's node (its GPU busy, say) before the run gives up:
# it is pinned there (soft=False), so Ray would otherwise wait forever. Module-level so tests can shorten it.
MASTER_SCHEDULE_TIMEOUT_S = 120.0


class VelaJob:
    def __init__(self, config: JobConfig | Preflight, dataset: object | None = None):
        """Checks `config` against its files now, unless it is already a `Preflight` result. `dataset`: a
        `ray.data.Dataset` of records to train on instead of `data.path` (`JobConfig.with_dataset`)."""
        silence_known_warnings()  # before preflight's checks (the family check, the TP check build peft models)
        if dataset is not None:
            config = (config.config if isinstance(config, Preflight) else config).with_dataset(dataset)
        checked = config if isinstance(config, Preflight) else config.preflight()
        self.config = checked.config  # resume pinned to the checkpoint preflight verified
        self.resume = checked.resume  # that checkpoint, local: its run may go on in output.dir

    def run(self) -> RunSummary:
        """The whole job, with output.dir held by this process throughout (`runs.hold_output_dir`). The driver
        holds it, not the master, as the driver outlives the master and writes there too: the expert-parallel
        mode's outputs, the report's samples after the master's run."""
        silence_known_warnings()
        with hold_output_dir(self.config.output_local_dir, self.config.output.dir):
            check_output_free(self.config.output, self.resume)  # a run that ended there since preflight, found now
            return self._run()

    def _run(self) -> RunSummary:
        StartupInterrupts.check()  # a Ctrl-C during preflight, lost where it was raised
        local_ray = self._connect()
        try:
            check_cluster_resources(self.config.cluster, ray.cluster_resources())
            node_name, node = _driver_node()
            gpus = master_gpus(self.config.cluster, ray.cluster_resources(), node, node_name,
                               self.config.masters.pipeline_stages)
            self.config = self.config.model_copy(update={"cluster": self.config.cluster.model_copy(
                update={"master_gpus": gpus})})
            StartupInterrupts.check()  # ... or during Ray's start
            if self.config.mode == "expert_parallel":
                return _unwrapped(lambda: run_expert_parallel(self.config))
            summary = self._run_master()
            add_samples(self.config)  # base vs fine-tuned generations into the report, on the driver
            return summary
        finally:
            if local_ray is not None:
                stop_local_ray(local_ray)

    def _run_master(self) -> RunSummary:
        cluster, data_plane = self.config.cluster, self.config.data_plane
        master = ray.remote(MasterActor).options(
            num_cpus=0, num_gpus=cluster.master_gpus or 0, max_restarts=0,
            max_concurrency=_master_calls(self.config),
            runtime_env={"env_vars": data_plane_env(data_plane.inline_bytes, data_plane.zero_copy_tensors)},
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(self.config, os.getpid())
        try:
            self._await_scheduled(master)
            run = master.run.remote()
            with _stop_requests() as stop:
                return self._wait(master, run, stop)
        finally:
            ray.kill(master)

    def _await_scheduled(self, master: Any) -> None:
        """Return once the master has started; ClusterError past `MASTER_SCHEDULE_TIMEOUT_S`.

        The master is pinned to the driver's node, so if that node never has the GPU it asks for (busy
        with another job, or gone since preflight) Ray leaves it pending with no error at all.
        """
        ready = master.ready.remote()
        deadline = time.monotonic() + MASTER_SCHEDULE_TIMEOUT_S
        while not ray.wait([ready], timeout=min(0.5, MASTER_SCHEDULE_TIMEOUT_S))[0]:  # short: Ctrl-C gets in
            if time.monotonic() > deadline:
                node_name, node = _driver_node()
                raise ClusterError(f"the MasterActor was not scheduled within {MASTER_SCHEDULE_TIMEOUT_S:g} s: it "
                                   + master_unschedulable(node_name, node, self.config.cluster.master_gpus or 0))
        try:
            ray.get(ready)
        except ray.exceptions.RayActorError as err:  # its process failed to start
            raise self._master_lost(err) from None

    def _wait(self, master: Any, run: ray.ObjectRef, stop: _StopRequest) -> RunSummary:
        """Wait for the run; the first Ctrl-C/SIGTERM asks it to stop after its step, a second kills it."""
        deadline = None
        while True:
            ready, _ = ray.wait([run], timeout=0.5)
            if ready:
                try:
                    return _unwrapped(lambda: ray.get(run))
                except ray.exceptions.RayActorError as err:  # the master process itself died
                    raise self._master_lost(err) from None
            if stop.count and deadline is None:
                logger.warning("%s: stopping after the current step and its checkpoint (again to kill now)",
                               stop.reason)
                master.stop.remote(stop.reason)
                deadline = time.monotonic() + STOP_GRACE_S
            if stop.count > 1 or (deadline is not None and time.monotonic() > deadline):
                last = checkpoint.latest(self.config.checkpoint_root)
                raise RunInterrupted(None, str(last) if last else None, f"{stop.reason}; killed mid-step")

    def _master_lost(self, err: Exception) -> VelaActorError:
        last = checkpoint.latest(self.config.checkpoint_root)
        resume = (f"resume from checkpoint {last} with `vela train --config ... --resume {last}`" if last
                  else "no checkpoint was written; set checkpoint.every to keep progress")
        return VelaActorError(f"the MasterActor died ({first_line(err)}); {resume}")

    def _connect(self) -> LocalRay | None:
        """Connect to Ray; returns the local instance this call started, to stop later (`stop_local_ray`).

        `cluster.address` (else RAY_ADDRESS, as `ray job submit` sets it) names a cluster to join; without
        either the run starts its own local instance (`local_ray`), whatever else runs on the machine: a
        plain `ray.init()` would join the cluster a `ray start` left on it instead, and refuse our CPUs."""
        if ray.is_initialized():
            return None
        address = self.config.cluster.address or os.environ.get("RAY_ADDRESS")
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
        if not address:
            check_cluster_resources(self.config.cluster, local_resources())  # before Ray's start, not after it
            return start_local_ray(env)
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        except ConnectionError as err:
            source = "cluster.address" if self.config.cluster.address else "RAY_ADDRESS"
            raise ClusterError(f"{source} {address}: no Ray cluster answers there ({first_line(err)}); start one "
                               f"there (ray start --head) or leave {source} unset for a local Ray of this "
                               f"machine's own") from None
        return None


def _driver_node() -> tuple[str, dict[str, float]]:
    """The driver's node, where the master is pinned: its id and address for messages, and its total
    resources (a GPU elsewhere in the cluster is no use to the master)."""
    node_id = ray.get_runtime_context().get_node_id()
    info = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    return f"{node_id[:12]} ({info.get('NodeManagerAddress', '?')})", dict(info.get("Resources", {}))


def _unwrapped(call):
    """`call()`, with Ray's RayTaskError replaced by the exception the actor raised."""
    try:
        return call()
    except ray.exceptions.RayTaskError as err:
        logger.debug("the run failed inside an actor:\n%s", err)
        cause = err.cause if isinstance(err.cause, BaseException) else None
        if cause is None:
            raise
        raise cause from None


class _StopRequest:
    reason: str | None = None
    count: int = 0  # signals received


@contextmanager
def _stop_requests() -> Iterator[_StopRequest]:
    """Ctrl-C and SIGTERM set `reason` instead of raising, so the driver can stop the run cleanly."""
    request = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signals are delivered to the main thread only
        return

    def handler(signum, frame):
        request.reason = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        request.count += 1

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _master_calls(config: JobConfig) -> int:
    """Calls the MasterActor takes at once: `run`, `stop` (it must get through while `run` works), and each other
    master process's calls of the ExpertManagers in its process (one per such worker at a time)."""
    return 2 + (config.master_processes - 1) * config.cluster.workers_on_master
