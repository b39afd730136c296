"""InProcessPool: the ExpertManagers in the runner's own process.

The one-process form of a vela-ray run: the same JobRunner, ExpertManagers and brokers as on
Ray, with `InProcessTransport` (a direct call) as the data plane. Links are function calls,
so all are reported equal and the placement balances routing mass across workers.

    summary = JobRunner(config, InProcessPool(config)).run()
"""

from __future__ import annotations

import os
import threading

import numpy as np

from placement import SharedLink

from vela_ray.config import JobConfig
from vela_ray.model.traffic import LOCAL_NODE, link_tiers
from vela_ray.model.transport import InProcessTransport
from vela_ray.runtime.masters import ThreadPeers
from vela_ray.runtime.migration import MigrationPlan
from vela_ray.runtime.pool import (
    HostedExperts, PeerMasters, SoloMaster, capacity_from_memory, fill_unmeasured, manager_specs,
)
from vela_ray.training.expert_manager import ExpertManager, MigrationStats
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel
from vela_ray.training.summary import LinkRecord
from vela_ray.training.worker_report import hosted_bytes_per_expert

IN_PROCESS_LINK = LinkRecord(latency_s=0.0, bandwidth_bytes_per_s=1e12)


class InProcessPool:
    """`WorkerPool` whose workers are plain ExpertManager objects in this process."""

    def __init__(self, config: JobConfig, links: list[LinkRecord] | None = None, device: str = "cpu",
                 master_node: str = LOCAL_NODE, worker_nodes: list[str] | None = None):
        """`links`: report these instead of function calls' (an emulated cluster's, for placement tests);
        `device`: where the ExpertManagers keep their experts (the master's, `cluster.workers_on_master`);
        `master_node`: the Ray node the master runs on, for the summary (the workers share it);
        `worker_nodes`: emulated nodes of the workers (tests, benchmarks: `master_node` must be one of them).
        Traffic is then counted by the tiers a cluster of those nodes would have, and data-parallel masters
        sit one per node as on Ray; the workers are still plain objects of this process."""
        self.config = config
        self.links = links
        self.device = device
        self.master_node = master_node
        self.worker_nodes = worker_nodes
        self.managers: list[ExpertManager] = []
        self.table: np.ndarray | None = None
        self.lock = threading.Lock()  # the masters' threads take turns on the workers

    def launch(self, table: np.ndarray) -> None:
        pass  # the workers are built by `start`, in this process

    def start(self, table: np.ndarray) -> HostedExperts:
        self.managers = [ExpertManager(spec) for spec in manager_specs(self.config, table, self.device)]
        self.table = np.array(table)
        return self._hosted()

    def _nodes(self) -> list[str]:
        """Each worker's node: the emulated ones, or `LOCAL_NODE` (in this process, same_process links)."""
        return self.worker_nodes or [LOCAL_NODE] * len(self.managers)

    def _hosted(self) -> HostedExperts:
        transport = InProcessTransport(self.managers, self.lock, link_tiers(self.master_node, self._nodes()))
        return HostedExperts(ExpertWorkers.in_process(self.managers), transport, self._nodes())

    def start_peers(self, table: np.ndarray, leader: MasterModel) -> PeerMasters:
        if self.config.cluster.master_tp > 1 or self.config.masters.shard_frozen_backbone:
            raise ValueError("cluster.master_tp > 1 and masters.shard_frozen_backbone run every master rank as a "
                             "process (Ray actors beside ExpertManager actors); this runtime has neither: run the "
                             "job through VelaJob or `vela train`")
        if self.config.masters.count == 1:
            return SoloMaster(self.master_node)
        return ThreadPeers(self.config, self.managers, table, self.master_node, self.lock, self._nodes())

    def migrate(self, table: np.ndarray) -> list[MigrationStats]:
        plan = MigrationPlan.between(self.table, table)
        sent = {pair: self.managers[pair[0]].expert_states(keys) for pair, keys in plan.by_pair().items()}
        stats = [self.managers[n].rehost(plan.keys_of(n), *[sent[pair] for pair in plan.senders_to(n)])
                 for n in plan.touched()]
        self.table = plan.new
        return stats

    def replace(self, workers: list[int]) -> HostedExperts:
        specs = manager_specs(self.config, self.table, self.device)
        for n in workers:
            self.managers[n] = ExpertManager(specs[n])
        return self._hosted()

    def measure_links(self, shared: bool = False) -> tuple[list[LinkRecord], list[SharedLink]]:
        links = list(self.links) if self.links else [IN_PROCESS_LINK] * len(self.managers)
        return links, []  # one process: no NIC between the master and its workers

    def measure_compute(self, num_rows: int) -> list[float]:
        return fill_unmeasured([m.report(num_rows).seconds_per_row for m in self.managers])

    def bytes_per_expert(self) -> int:
        return hosted_bytes_per_expert([m.report() for m in self.managers])

    def capacities(self) -> list[int]:
        reports = [m.report() for m in self.managers]
        return capacity_from_memory([r.free_bytes for r in reports], hosted_bytes_per_expert(reports),
                                    [r.memory_pool for r in reports])

    def pids(self) -> list[int]:
        return [os.getpid()] * len(self.managers)

    def lost_workers(self, error: BaseException) -> list[int] | None:
        return None  # an in-process worker cannot die apart from the runner

    def close(self) -> None:
        self.managers = []
