"""InProcessPool: the ExpertManagers in the runner's own process.

The one-process form of a vela-ray run: the same JobRunner, ExpertManagers and brokers as on
Ray, with `InProcessTransport` (a direct call) as the data plane. Links are function calls,
so all are reported equal and the placement balances routing mass across workers.

    summary = JobRunner(config, InProcessPool(config)).run()
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from placement import SharedLink

from vela_ray.config import JobConfig
from vela_ray.model.traffic import LOCAL_NODE, link_tiers
from vela_ray.model.transport import InProcessTransport
from vela_ray.model.collective import make_group, make_store
from vela_ray.runtime.masters import MasterMesh, MasterRank, Pending, RankGroups
from vela_ray.runtime.migration import MigrationPlan, move_experts
from vela_ray.runtime.pool import HostedExperts, capacity_from_memory, fill_unmeasured, manager_specs
from vela_ray.training.expert_manager import ExpertManager, MigrationStats
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.replicas import SINGLE, ThreadGroup
from vela_ray.training.summary import LinkRecord
from vela_ray.training.worker_report import hosted_bytes_per_expert

IN_PROCESS_LINK = LinkRecord(latency_s=0.0, bandwidth_bytes_per_s=1e12)
GROUP_TIMEOUT_S = 300.0  # a TP rank that never reaches a collective (it failed) is given up after this
RANK_LOSS_GRACE_S = 5.0  # after master 0's step failed: how long it waits for the ranks' own errors


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

    def rank_hosts(self, mesh: MasterMesh, nodes: list[str]) -> ThreadRanks:
        if self.config.masters.shard_frozen_backbone:
            raise ValueError("masters.shard_frozen_backbone shards with FSDP2 over torch's default process group, "
                             "one per process, and this runtime runs every master in one process: run the job "
                             "through VelaJob or `vela train`, or set masters.shard_frozen_backbone: false")
        if mesh.tp > 1 and self.config.lora.lora_dropout:
            raise ValueError("lora.lora_dropout with cluster.master_tp > 1 in one process: the TP ranks draw one "
                             "mask each from the process's one torch RNG, so they would not draw the same: run the "
                             "job through VelaJob or `vela train` (a process per rank), or set lora.lora_dropout: 0")
        return ThreadRanks(self.config, mesh, nodes, ThreadRows(self.managers, self.lock, self._nodes()))

    def migrate(self, table: np.ndarray) -> list[MigrationStats]:
        plan = MigrationPlan.between(self.table, table)
        stats = move_experts(ExpertWorkers.in_process(self.managers), plan)
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


class ThreadRendezvous:
    """The mesh's groups for ranks that are threads of this process: the data-parallel masters of each TP index a
    `ThreadGroup`, each master's TP ranks a gloo group of their own (`collective.make_group`, not torch's default
    group: a process has one) over a store listening here."""

    def __init__(self, mesh: MasterMesh):
        self.mesh = mesh
        self.dp = [ThreadGroup(mesh.dp) for _ in range(mesh.tp)] if mesh.dp > 1 else []
        self.tp = [make_store("127.0.0.1", 0, mesh.tp, is_master=True, timeout_s=GROUP_TIMEOUT_S)
                   for _ in range(mesh.dp)] if mesh.tp > 1 else []
        self.stages = [ThreadGroup(mesh.pp) for _ in range(mesh.dp * mesh.tp)] if mesh.pp > 1 else []

    def join(self, m: int, t: int, device, stage: int = 0) -> RankGroups:
        tp = None
        if self.tp:
            store = make_store(self.tp[m].host, self.tp[m].port, self.mesh.tp, is_master=False,
                               timeout_s=GROUP_TIMEOUT_S)
            tp = make_group(store, t, self.mesh.tp, GROUP_TIMEOUT_S)
        return RankGroups(replicas=self.dp[t].member(m) if self.dp else SINGLE, tp=tp,
                          stages=self.stages[m * self.mesh.tp + t].member(stage) if self.stages else None)

    def abort(self) -> None:
        """Release every thread waiting in a data-parallel sum or a stages' exchange (one rank failed): they raise
        BrokenBarrierError."""
        for group in (*self.dp, *self.stages):
            group.abort()


@dataclass
class ThreadRows:
    """A thread rank's data plane: a direct call into the in-process ExpertManagers, on the pool's lock."""

    managers: list[ExpertManager]
    lock: threading.Lock
    worker_nodes: list[str]

    def transport(self, rank: int, node: str, device) -> InProcessTransport:
        return InProcessTransport(self.managers, self.lock, link_tiers(node, self.worker_nodes))


class ThreadRanks:
    """`RankHosts` of threads of this process: each rank a `MasterRank` with a thread of its own (its calls run
    there in order), so the ranks reach their collectives together; a rank that fails releases the others (master 0
    too) from the data-parallel sums. A TP rank waiting in a gloo collective for a failed one waits for the group's
    timeout."""

    def __init__(self, config, mesh: MasterMesh, nodes: list[str], rows: ThreadRows):
        self.mesh = mesh
        self._rows = rows
        hosted = mesh.ranks()[1:]
        self.ranks = [MasterRank(config, m, t, nodes[m], s) for m, t, s in hosted]
        self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"vela-master-{m}-{t}-{s}") for m, t, s in hosted]
        self._rendezvous: ThreadRendezvous | None = None

    def rendezvous(self) -> ThreadRendezvous:
        self._rendezvous = ThreadRendezvous(self.mesh)
        return self._rendezvous

    def rows(self) -> ThreadRows:
        return self._rows

    def call(self, method: str, *args, ranks=None) -> Pending:
        which = range(len(self.ranks)) if ranks is None else ranks
        return [self.threads[i].submit(self._run, self.ranks[i], method, args) for i in which]

    def _run(self, rank: MasterRank, method: str, args: tuple):
        try:
            return getattr(rank, method)(*args)
        except BaseException:
            if self._rendezvous is not None:
                self._rendezvous.abort()
            raise

    def wait(self, pending: list[Future]) -> list:
        wait(pending)
        _raise_own_error(pending)
        return [f.result() for f in pending]

    def watch(self, replicas, pending: Pending) -> None:
        pass  # a failing rank releases the group itself (`_run`)

    def abort(self, pending: list[Future], cause: BaseException) -> None:
        if self._rendezvous is not None:
            self._rendezvous.abort()
        wait(pending, timeout=RANK_LOSS_GRACE_S)
        _raise_own_error([f for f in pending if f.done()])

    def pids(self) -> list[int]:
        return [os.getpid()] * len(self.ranks)

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
        for thread in self.threads:
            thread.shutdown(wait=False, cancel_futures=True)
        self.ranks, self.threads = [], []


def _raise_own_error(done: list[Future]) -> None:
    """The first rank's error that is its own, not the broken barrier another's failure left it."""
    errors = [f.exception() for f in done if f.exception() is not None]
    own = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if own or errors:
        raise (own or errors)[0]
