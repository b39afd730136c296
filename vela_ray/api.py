"""The driver API: `VelaJob(config).run()`.

    from vela_ray.api import VelaJob
    from vela_ray.config import JobConfig
    summary = VelaJob(JobConfig.from_yaml("job.yaml")).run()

The config is validated and pre-flighted (model, MoE layers, capacity) before
Ray starts. Then the driver connects to Ray (the given address, else
RAY_ADDRESS as set by `ray job submit`, else a fresh local Ray), starts the
MasterActor on its own node and waits for it. A worker's exception reaches
the caller as a RayTaskError carrying the worker's traceback.
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.expert_parallel import run_expert_parallel
from actors.master import MasterActor
from actors.transports import data_plane_env
from vela_ray.config import JobConfig

logger = logging.getLogger(__name__)


class VelaJob:
    def __init__(self, config: JobConfig):
        config.preflight()
        self.config = config

    def run(self) -> dict:
        started_ray = self._connect()
        try:
            if self.config.mode == "expert_parallel":
                return run_expert_parallel(self.config)
            node_id = ray.get_runtime_context().get_node_id()
            cluster = self.config.cluster
            master = ray.remote(MasterActor).options(
                num_cpus=0, max_restarts=0,
                runtime_env={"env_vars": data_plane_env(cluster.inline_bytes, cluster.zero_copy_tensors)},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.config)
            summary = ray.get(master.run.remote())
            ray.kill(master)
            return summary
        finally:
            if started_ray:
                ray.shutdown()

    def _connect(self) -> bool:
        """Connect to Ray; returns True when this call started a local instance to shut down later."""
        if ray.is_initialized():
            return False
        address = self.config.cluster.address or os.environ.get("RAY_ADDRESS")
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        else:
            needed = 1 + self.config.cluster.num_workers * self.config.cluster.num_cpus_per_worker
            ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 1)), include_dashboard=False,
                     runtime_env=env, log_to_driver=True)
        return True
