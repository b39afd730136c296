"""RayWorkerPool: the job runner's `WorkerPool` over ExpertManager actors.

Workers are spawned with one placement-group bundle each (`actors.cluster`), the data
plane is a Ray transport (object refs, or the collective plane formed through Ray), and links and compute are
measured by the PlacementService on the master's node. A dead actor shows up as a
`RayActorError`; `lost_workers` pings every worker to name the dead ones.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import ray

from actors.cluster import ExpertCluster, SpawnConfig, respawn_expert_managers, spawn_expert_managers
from actors.masters import RayPeers
from actors.placement_service import spawn_placement_service
from actors.transports import RayObjectRefTransport, collective_transport, data_plane_env
from actors.workers import actor_workers
from placement import SharedLink, node_shared_links
from vela_ray.model.collective import PeerLostError
from vela_ray.config import JobConfig
from vela_ray.runtime.masters import PeerMasters, SoloMaster
from vela_ray.runtime.migration import MigrationPlan
from vela_ray.runtime.pool import HostedExperts, capacity_from_memory, fill_unmeasured, manager_specs
from vela_ray.training.expert_manager import ExpertManagerSpec, MigrationStats
from vela_ray.training.summary import LinkRecord

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10


class RayWorkerPool:
    """`WorkerPool` of ExpertManager actors laid out by `config.cluster`, seen from `master_node`."""

    def __init__(self, config: JobConfig, master_node: str):
        self.config = config
        self.master_node = master_node
        cluster = config.cluster
        self.env_vars = data_plane_env(cluster.inline_bytes, cluster.zero_copy_tensors)
        self.spawn_config = SpawnConfig(
            num_cpus_per_worker=cluster.num_cpus_per_worker, num_gpus_per_worker=cluster.num_gpus_per_worker,
            workers_per_node=cluster.workers_per_node,
            master_node=master_node if cluster.workers_per_node else None, env_vars=self.env_vars)
        self.cluster: ExpertCluster | None = None
        self.transport: Any = None
        self.table: np.ndarray | None = None

    def start(self, table: np.ndarray) -> HostedExperts:
        self.close()
        self.table = np.array(table)
        self.cluster = spawn_expert_managers(self._specs(), self.spawn_config)
        return self._connect()

    def _specs(self) -> list[ExpertManagerSpec]:
        return manager_specs(self.config, self.table, "cuda" if self.config.cluster.num_gpus_per_worker else "cpu")

    def _connect(self) -> HostedExperts:
        """The control plane and a fresh data plane over the current actors."""
        tiers = self.cluster.worker_tiers(self.master_node)
        if self.config.cluster.transport == "collective":
            self.transport = collective_transport(self.cluster.handles, tiers)
        else:
            self.transport = RayObjectRefTransport(self.cluster.handles, tiers,
                                                   zero_copy=self.config.cluster.zero_copy_tensors)
        return HostedExperts(actor_workers(self.cluster.handles), self.transport, self.cluster.node_ids)

    def start_peers(self, table: np.ndarray) -> PeerMasters:
        if self.config.cluster.num_masters == 1:
            return SoloMaster(self.master_node)
        return RayPeers(self.config, self.cluster.handles, self.cluster.node_ids, self.master_node, table)

    def migrate(self, table: np.ndarray) -> list[MigrationStats]:
        """Worker-to-worker: each receiver gets its senders' object refs, so the state travels from the
        sender's object store to the receiver's without passing through the master."""
        plan = MigrationPlan.between(self.table, table)
        handles = self.cluster.handles
        sent = {pair: handles[pair[0]].expert_states.remote(keys) for pair, keys in plan.by_pair().items()}
        stats = ray.get([handles[n].rehost.remote(plan.keys_of(n), *[sent[p] for p in plan.senders_to(n)])
                         for n in plan.touched()])
        self.table = plan.new
        return stats

    def replace(self, workers: list[int]) -> HostedExperts:
        """New actors for `workers` in their bundles; the data plane is formed again over all workers
        (a collective group cannot take a new member)."""
        if self.transport is not None:
            self._close_transport()
        specs = self._specs()
        respawn_expert_managers(self.cluster, [specs[n] for n in workers], self.spawn_config)
        return self._connect()

    def _close_transport(self) -> None:
        try:
            self.transport.close()
        except Exception as exc:  # a broken group may fail to close; the new one replaces it anyway
            logger.warning("closing the old data plane after a lost worker: %s", exc)
        self.transport = None

    def measure_links(self) -> list[LinkRecord]:
        service = spawn_placement_service(self.master_node, self.env_vars)
        try:
            return ray.get(service.probe.remote(self.cluster.handles))
        finally:
            ray.kill(service)

    def measure_shared_links(self) -> list[SharedLink]:
        """The NICs master traffic crosses (`placement.node_shared_links`), each probed through its workers."""
        links = node_shared_links(self.cluster.node_ids, self.master_node, 1.0)
        if not links:
            return []
        service = spawn_placement_service(self.master_node, self.env_vars)
        try:
            measured = ray.get(service.probe_shared.remote(self.cluster.handles,
                                                           {link.name: link.workers for link in links}))
        finally:
            ray.kill(service)
        return node_shared_links(self.cluster.node_ids, self.master_node,
                                 {link.name.removeprefix("nic:"): measured[link.name] for link in links})

    def measure_compute(self, num_rows: int) -> list[float]:
        return fill_unmeasured(ray.get([h.seconds_per_row.remote(num_rows) for h in self.cluster.handles]))

    def bytes_per_expert(self) -> int:
        handles = self.cluster.handles
        hosting = [h for h, n in zip(handles, ray.get([h.num_experts.remote() for h in handles])) if n]
        return ray.get(hosting[0].bytes_per_expert.remote())

    def capacities(self) -> list[int]:
        handles = self.cluster.handles
        return capacity_from_memory(ray.get([h.free_bytes.remote() for h in handles]), self.bytes_per_expert(),
                                    ray.get([h.memory_pool.remote() for h in handles]))

    def pids(self) -> list[int]:
        return ray.get([h.pid.remote() for h in self.cluster.handles])

    def lost_workers(self, error: BaseException) -> list[int] | None:
        if not isinstance(error, (ray.exceptions.RayActorError, PeerLostError)):
            return None
        dead = []
        for worker, handle in enumerate(self.cluster.handles):
            try:
                ray.get(handle.ping.remote(), timeout=PING_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(worker)
        if not dead and isinstance(error, PeerLostError):  # alive but not answering the data plane: hung
            dead = [error.worker]
        return dead

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
