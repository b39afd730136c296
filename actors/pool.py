"""RayWorkerPool: the job runner's `WorkerPool` over ExpertManager actors.

Workers are spawned with one placement-group bundle each (`actors.cluster`), the data
plane is a Ray transport (object refs, or the collective plane formed through Ray), and links are
measured by the PlacementService's probe in this (the master's) process, compute by the workers. A dead actor
shows up as a `RayActorError`; `lost_workers` pings every worker to name the dead ones. The other master
processes' MasterRank actors (`rank_hosts`) are started with the workers (`launch_ranks`), so that their processes
load while the workers' do.

With `cluster.workers_on_master: K` the last K workers are ExpertManagers in this (the master's)
process on its device: `SplitTransport` serves them by direct call while the actors' rows travel,
their link is a function call's, and they die only with the master. Workers 0..A-1 are the actors,
so an actor's position in the cluster is its worker number. The other master processes (data-parallel masters,
tensor-parallel ranks) reach those K through the actor this pool runs in (`home`, the MasterActor:
`actors.workers.HomeWorker`), over either data plane.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import ray

from actors.cluster import ExpertCluster, SpawnConfig, launch_expert_managers, respawn_expert_managers
from actors.masters import RayRanks, spawn_rank_actors
from actors.placement_service import PlacementService, Ping, collective_ping, ray_ping
from actors.transports import data_plane_env, master_transport
from actors.workers import HomeWorker, actor_workers
from placement import SharedLink, node_shared_links
from vela_ray.model.collective import CollectiveTransport, PeerLostError
from vela_ray.model.transport import InProcessTransport, SplitTransport, Transport
from vela_ray.config import JobConfig
from vela_ray.runtime.migration import MigrationPlan, move_experts
from vela_ray.runtime.masters import MasterMesh, peer_nodes
from vela_ray.runtime.pool import HostedExperts, capacity_from_memory, fill_unmeasured, manager_specs
from vela_ray.runtime.local import IN_PROCESS_LINK
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec, MigrationStats
from vela_ray.training.summary import LinkRecord
from vela_ray.training.worker_report import hosted_bytes_per_expert

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10


class RayWorkerPool:
    """`WorkerPool` of ExpertManager actors laid out by `config.cluster`, seen from `master_node`."""

    def __init__(self, config: JobConfig, master_node: str, home: Any = None):
        """`home`: the handle of the actor this pool runs in (the MasterActor), whose `call_local` the other master
        processes call to reach the ExpertManagers in this process (`cluster.workers_on_master`)."""
        self.config = config
        self.home = home
        self.master_node = master_node
        cluster = config.cluster
        self.env_vars = data_plane_env(config.data_plane.inline_bytes, config.data_plane.zero_copy_tensors)
        self.spawn_config = SpawnConfig(
            num_cpus_per_worker=cluster.num_cpus_per_worker, num_gpus_per_worker=cluster.num_gpus_per_worker,
            workers_per_node=cluster.workers_per_node,
            master_node=master_node if cluster.workers_per_node else None, env_vars=self.env_vars)
        self.cluster: ExpertCluster | None = None
        self.transport: Any = None
        self.table: np.ndarray | None = None
        self.num_actors = cluster.num_worker_actors
        self.local_device = "cuda" if cluster.master_gpus else "cpu"
        self.local: list[ExpertManager] = []  # workers num_actors.. in this process (`cluster.workers_on_master`)
        self.early_ranks: tuple[list[str], list] | None = None  # (nodes, actors) `launch` started for `rank_hosts`
        self.launched = False  # by `launch`, not waited for by `start` yet

    def launch(self, table: np.ndarray) -> None:
        """Start the actors for `table`, and the master ranks' beside them (`launch_ranks`), without waiting."""
        self.close()
        self.table = np.array(table)
        # no actors: every worker in this process, with other master processes to serve (`actors.master`)
        self.cluster = (launch_expert_managers(self._specs(), self.spawn_config) if self.num_actors
                        else ExpertCluster([], [], None))
        self.early_ranks = self.launch_ranks()
        self.launched = True

    def launch_ranks(self) -> tuple[list[str], list] | None:
        """The MasterRank actors of the masters' mesh (ranks other than master 0) on the nodes the runner will ask
        `rank_hosts` for (`MasterGroup.start`: master m on `peer_nodes` of the workers' nodes, known from their
        bundles), started now so that their processes load while the workers' do, not after the workers are up.
        None with one master process."""
        mesh = MasterMesh.of(self.config)
        if mesh.size == 1:
            return None
        worker_nodes = [*self.cluster.bundle_nodes(), *[self.master_node] * (self.config.cluster.num_workers
                                                                              - self.num_actors)]
        nodes = [self.master_node, *peer_nodes(worker_nodes, self.master_node, mesh.dp - 1)]
        return nodes, spawn_rank_actors(self.config, mesh, nodes)

    def start(self, table: np.ndarray) -> HostedExperts:
        """Wait for the actors `launch` started for `table` (launching them now if it did not)."""
        if not (self.launched and np.array_equal(self.table, table)):
            self.launch(table)
        self.cluster.wait_ready(self.spawn_config.ready_timeout_s)
        self.launched = False
        self.local = [ExpertManager(spec) for spec in manager_specs(self.config, self.table, self.local_device)
                      [self.num_actors:]]
        return self._connect()

    def _specs(self) -> list[ExpertManagerSpec]:
        """The actors' specs (workers 0..num_actors-1)."""
        device = "cuda" if self.config.cluster.num_gpus_per_worker else "cpu"
        return manager_specs(self.config, self.table, device)[:self.num_actors]

    def _connect(self) -> HostedExperts:
        """The control plane and a fresh data plane over the current actors."""
        self.transport = self._remote_transport()
        if self.local:
            local = InProcessTransport(self.local)
            self.transport = local if self.transport is None else SplitTransport(self.transport, local)
        return HostedExperts(actor_workers(self.cluster.handles, local=self.local), self.transport,
                             [*self.cluster.node_ids, *[self.master_node] * len(self.local)])

    def _remote_transport(self) -> Transport | None:
        """The actors' data plane; None without actors (every worker in this process: nothing to form)."""
        if not self.cluster.handles:
            return None
        # master 0's: the one path every master process takes (the other ranks' in `runtime.masters.MasterRank.join`)
        return master_transport(self.config, self.cluster.handles, self.cluster.worker_tiers(self.master_node),
                                master=0, device=self.local_device)

    def rank_hosts(self, mesh: MasterMesh, nodes: list[str]) -> RayRanks:
        """MasterRank actors for the ranks other than master 0, with rows to every ExpertManager: the actors, and
        those in this process through `home`."""
        if self.local and self.home is None:
            raise RuntimeError("the ExpertManagers in the master's process (cluster.workers_on_master) serve other "
                               "master processes only through the actor the pool runs in: pass RayWorkerPool's home")
        here = [HomeWorker(self.home, n) for n in range(self.num_actors, self.num_actors + len(self.local))]
        early, self.early_ranks = self.early_ranks, None
        actors = None
        if early is not None and early[0] == list(nodes) and len(early[1]) == mesh.size - 1:
            actors = early[1]  # started by `launch` for these nodes
        elif early is not None:
            _kill(early[1])
        return RayRanks(self.config, mesh, nodes, [*self.cluster.handles, *here],
                        [*self.cluster.node_ids, *[self.master_node] * len(here)], actors=actors)

    def call_local(self, worker: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method` of worker `worker`, one of those in this process, for another master process (`HomeWorker`)."""
        return getattr(self.local[worker - self.num_actors], method)(*args, **kwargs)

    def migrate(self, table: np.ndarray) -> list[MigrationStats]:
        """Worker-to-worker (`migration.move_experts`): each receiver gets its senders' object refs, which the
        master never waits for (`actors.workers`)."""
        plan = MigrationPlan.between(self.table, table)
        stats = move_experts(actor_workers(self.cluster.handles, local=self.local), plan)
        self.table = plan.new
        return stats

    def replace(self, workers: list[int]) -> HostedExperts:
        """New actors for `workers` in their bundles (new objects for those in this process: the runner
        restarts every worker after a loss mid-migration); the data plane is formed again over all workers
        (a collective group cannot take a new member)."""
        if self.transport is not None:
            self._close_transport()
        specs = self._specs()
        if actors := [n for n in workers if n < self.num_actors]:
            respawn_expert_managers(self.cluster, [specs[n] for n in actors], self.spawn_config)
        local_specs = manager_specs(self.config, self.table, self.local_device)
        for n in workers:
            if n >= self.num_actors:
                self.local[n - self.num_actors] = ExpertManager(local_specs[n])
        return self._connect()

    def _close_transport(self) -> None:
        try:
            self.transport.close()
        except Exception as exc:  # a broken group may fail to close; the new one replaces it anyway
            logger.warning("closing the old data plane after a lost worker: %s", exc)
        self.transport = None

    def measure_links(self, shared: bool = False) -> tuple[list[LinkRecord], list[SharedLink]]:
        """Probed from this process, the master's, over the data plane its rows take (`PlacementService` over
        `_link_ping`). Shared links: the NICs master traffic crosses (`placement.node_shared_links`),
        each probed through its workers.

        In this process, not in an actor of its own beside it: such a process imported torch, and the
        ExpertManager's module with transformers to take the workers' handles, before its first ping (3 s of a
        job's start on an idle 2-core machine, 5-8 s under load), for a probe of about 0.3 s."""
        service = PlacementService(self._link_ping())
        links = service.probe(range(len(self.cluster.handles))) + [IN_PROCESS_LINK] * len(self.local)
        nics = node_shared_links(self.cluster.node_ids, self.master_node, 1.0) if shared else []
        if not nics:
            return links, []
        measured = service.probe_shared({link.name: link.workers for link in nics})
        return links, node_shared_links(self.cluster.node_ids, self.master_node,
                                        {link.name.removeprefix("nic:"): measured[link.name] for link in nics})

    def _link_ping(self) -> Ping:
        """How the probes reach the actors: over the plane the rows take (the collective plane's own ping, or Ray
        calls carrying the payload as the object-ref plane's rows are)."""
        remote = self.transport.remote if isinstance(self.transport, SplitTransport) else self.transport
        return collective_ping(remote) if isinstance(remote, CollectiveTransport) else ray_ping(self.cluster.handles)

    def measure_compute(self, num_rows: int) -> list[float]:
        return fill_unmeasured([report.seconds_per_row for report in self._ask_all("report", num_rows)])

    def bytes_per_expert(self) -> int:
        return hosted_bytes_per_expert(self._ask_all("report"))

    def capacities(self) -> list[int]:
        reports = self._ask_all("report")
        return capacity_from_memory([r.free_bytes for r in reports], hosted_bytes_per_expert(reports),
                                    [r.memory_pool for r in reports])

    def pids(self) -> list[int]:
        return [report.pid for report in self._ask_all("report")]

    def _ask_all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every worker: the actors in parallel, then those in this process."""
        refs = [getattr(h, method).remote(*args) for h in self.cluster.handles]
        return ray.get(refs) + [getattr(m, method)(*args) for m in self.local]

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
        self.launched = False
        if self.early_ranks is not None:  # started by `launch`, never taken by `rank_hosts`
            _kill(self.early_ranks[1])
            self.early_ranks = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.local = []



def _kill(actors: list) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)
