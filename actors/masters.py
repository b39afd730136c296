"""The master ranks other than master 0 on Ray (`RayRanks`): one `MasterRank` actor each, and their groups.

`vela_ray.runtime.masters.MasterGroup` drives them; this module hosts them. Rank (m, t) of the (dp, tp) mesh runs
on master m's node (`runtime.masters.peer_nodes`), master 0's other ranks beside the MasterActor. The groups, all
listening in master 0's process (`ProcessRendezvous`):
  - data-parallel: the ranks of one TP index t form a gloo group of their own (master 0's at rank 0) for the
    backbone gradient sum (`ProcessGroupReplicas`), watched for a failed master;
  - tensor-parallel: the T ranks of master m form its TP group (each process's default group, gloo or NCCL, a 1-D
    mesh: torch's DTensor shards the vocabulary over it; `vela_ray.model.tensor_parallel`);
  - with `masters.shard_frozen_backbone`, every master process joins one (dp, tp) mesh instead (its default group;
    DP gradient sums over its "dp" groups), and FSDP2 shards each decoder layer's frozen weights over "dp";
  - the master processes of one node form a node group in which each backbone tensor is read once and sent to
    the others (`vela_ray.model.sharded_loading`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.transports import data_plane_env, master_transport
from vela_ray.config import JobConfig
from vela_ray.model.collective import make_group, make_store
from vela_ray.model.tensor_parallel import join_mesh
from vela_ray.model.traffic import link_tiers
from vela_ray.model.transport import Transport
from vela_ray.quiet import silence_known_warnings
from vela_ray.runtime.masters import MasterMesh, MasterRank, Pending, RankGroups
from vela_ray.training.replicas import SINGLE, ProcessGroupReplicas, Replicas

logger = logging.getLogger(__name__)

Rendezvous = tuple[str, int]  # a group's TCPStore (host, port), master 0's process listening
NodeRendezvous = tuple[Rendezvous, int, int]  # a node group's store, this process's place in it, its size


GROUP_TIMEOUT_S = 300.0  # a master that never reaches the gradient sum (it failed) is given up after this
GROUP_BREAK_GRACE_S = 20.0  # after the group broke, how long master 0 waits for Ray to say which master failed
# after master 0's step failed with tensor-parallel ranks: how long it waits for Ray to say whether one of its
# ranks died (a dead rank breaks master 0's own collectives at once; live ones wait in theirs for master 0). A
# broken connection means a rank is gone: Ray is given long to say which (it took over 5 s on a loaded 2-core
# machine); any other failure is master 0's own, and a short wait tells whether a rank's failure caused it.
RANK_LOSS_GRACE_S = 30.0
RANK_FAILURE_GRACE_S = 5.0


class MasterRankActor(MasterRank):
    """`MasterRank` as a Ray actor: warnings silenced in its process, its node as Ray sees it."""

    def __init__(self, config: JobConfig, m: int, t: int, node: str, stage: int = 0):
        silence_known_warnings()
        super().__init__(config, m, t, node, stage)


@dataclass
class RayRows:
    """A Ray rank's data plane to the ExpertManager actors, `data_plane.transport`'s (`master_transport`: its own
    collective planes, or object refs), counted by its node's link tiers."""

    config: JobConfig
    handles: list
    worker_nodes: list[str]

    def transport(self, rank: int, node: str, device: torch.device) -> Transport:
        tiers = link_tiers(ray.get_runtime_context().get_node_id(), self.worker_nodes)
        return master_transport(self.config, self.handles, tiers, master=rank, device=device)


@dataclass
class ProcessRendezvous:
    """Where the mesh's process groups meet: each kind's store (host, port) by index, and the node groups'. Pickled
    to every rank; the stores listen in master 0's process (`RayRanks.rendezvous` keeps them)."""

    mesh: MasterMesh
    world: Rendezvous | None
    dp: list[Rendezvous]  # by TP index
    tp: list[Rendezvous]  # by master
    nodes: dict[tuple[int, int], NodeRendezvous]
    stages: list[Rendezvous] = field(default_factory=list)  # by master (pipeline stages: one TP rank each)

    def join(self, m: int, t: int, device: torch.device, stage: int = 0) -> RankGroups:
        """Rank (m, t, stage)'s groups (`join_groups`), its node group (`join_node`) and its master's stages' gloo
        group (`ProcessGroupReplicas`: the hidden states and their gradients cross it, `training.pipeline`)."""
        def client(address: Rendezvous, kind: str) -> dist.Store:
            return make_store(*address, group_size(self.mesh, kind), is_master=False, timeout_s=GROUP_TIMEOUT_S)
        stores = ({"world": client(self.world, "world")} if self.world else
                  {**({"dp": client(self.dp[t], "dp")} if self.dp else {}),
                   **({"tp": client(self.tp[m], "tp")} if self.tp else {})})
        replicas, tp_mesh, dp_mesh = join_groups(self.mesh, m, t, stores, device)
        stages = None
        if self.stages:
            stages = ProcessGroupReplicas(make_group(client(self.stages[m], "stages"), stage, self.mesh.pp,
                                                     GROUP_TIMEOUT_S, ray.util.get_node_ip_address()))
        return RankGroups(replicas, tp_mesh, dp_mesh, join_node(self.nodes.get((m, t))), stages)


def group_size(mesh: MasterMesh, kind: str) -> int:
    """Ranks of a group `kind`: "world" (every master process, the (dp, tp) mesh), "dp" (the data-parallel masters'
    ranks of one TP index), "tp" (one master's ranks) or "stages" (one master's pipeline stages)."""
    return {"world": mesh.size, "dp": mesh.dp, "tp": mesh.tp, "stages": mesh.pp}[kind]


def join_groups(mesh: MasterMesh, rank: int, tp_rank: int, stores: dict[str, dist.Store], device: torch.device
                ) -> tuple[Replicas, object | None, object | None]:
    """Rank (`rank`, `tp_rank`)'s groups: (its data-parallel `Replicas`, its master's TP mesh or None, the
    data-parallel mesh FSDP2 shards the frozen backbone over or None), from `stores` by kind (`group_size`).
    With "world" (`masters.shard_frozen_backbone`) one (dp, tp) mesh of every master process gives all three;
    otherwise a "dp" store makes a gloo group of its own (the data-parallel masters' gradient sum, watched for a
    failed master) and a "tp" store this master's TP mesh."""
    address = ray.util.get_node_ip_address()
    masters, ranks = mesh.dp, mesh.tp
    if "world" in stores:
        mesh = join_mesh(stores["world"], rank * ranks + tp_rank, masters, ranks, device, GROUP_TIMEOUT_S, address)
        return ProcessGroupReplicas(mesh["dp"].get_group()), mesh["tp"] if ranks > 1 else None, mesh["dp"]
    replicas: Replicas = SINGLE
    if "dp" in stores:
        replicas = ProcessGroupReplicas(make_group(stores["dp"], rank, masters, GROUP_TIMEOUT_S, address))
    tp_mesh = join_mesh(stores["tp"], tp_rank, 1, ranks, device, GROUP_TIMEOUT_S)["tp"] if "tp" in stores else None
    return replicas, tp_mesh, None


def join_node(rendezvous: NodeRendezvous | None) -> dist.ProcessGroup | None:
    """The gloo group of the master processes on this node (issue 51), None for a process alone on its node: its
    first member reads each backbone tensor once and sends the others their shards (`master.shard_and_read`)."""
    if rendezvous is None:
        return None
    (host, port), member, members = rendezvous
    store = make_store(host, port, members, is_master=False, timeout_s=GROUP_TIMEOUT_S)
    return make_group(store, member, members, GROUP_TIMEOUT_S, ray.util.get_node_ip_address())


def _raise_if_failed(refs: list, timeout_s: float = 0.0) -> None:
    """Raise the error of a failed one of `refs`, waiting up to `timeout_s` for them all to end: a dead
    master's (RayActorError) as soon as Ray reports it, else the first error; those that finished well return."""
    deadline = time.monotonic() + timeout_s
    errors, left = [], list(refs)
    while left:
        ready, left = ray.wait(left, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError:
            raise
        except Exception as err:  # noqa: BLE001 - a surviving master whose group broke; reported if none died
            errors.append(err)
    if errors:
        raise errors[0]


def _connection_broke(error: BaseException) -> bool:
    """Whether master 0's `error` is a collective whose peer went away (gloo's closed or reset socket, an NCCL
    error): a rank died, and Ray will say which."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        mark in text for mark in ("Connection reset", "Connection closed", "Broken pipe", "gloo", "NCCL"))


def spawn_rank_actors(config: JobConfig, mesh: MasterMesh, nodes: list[str]) -> list:
    """A MasterRank actor for every rank of `mesh` but master 0, master m's on `nodes[m]`, without waiting: its
    constructor only records its place, so the actor is its process starting (`RayRanks` joins and builds it)."""
    env = data_plane_env(config.data_plane.inline_bytes, config.data_plane.zero_copy_tensors)
    return [
        ray.remote(MasterRankActor).options(
            num_cpus=0, num_gpus=config.cluster.master_gpus or 0, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[m], soft=False),
            **({"runtime_env": {"env_vars": env}} if env else {}),
        ).remote(config, m, t, nodes[m], s)
        for m, t, s in mesh.ranks()[1:]
    ]


class RayRanks:
    """`RankHosts` of MasterRank actors (module docstring), one per rank of `mesh` but master 0, master m's on
    `nodes[m]`, with rows to the ExpertManager `handles` on `worker_nodes`. `actors`: those `spawn_rank_actors`
    started for `nodes` already (the pool starts them beside the workers), else they are started here."""

    def __init__(self, config: JobConfig, mesh: MasterMesh, nodes: list[str], handles: list, worker_nodes: list[str],
                 actors: list | None = None):
        self.config, self.mesh, self.nodes = config, mesh, nodes
        self._rows = RayRows(config, list(handles), list(worker_nodes))
        self.ranks = mesh.ranks()[1:]
        self.actors = actors if actors is not None else spawn_rank_actors(config, mesh, nodes)
        self._stores: list[dist.Store] = []  # the rendezvous must outlive the joins

    def rendezvous(self) -> ProcessRendezvous:
        """Every group's store listens here, in master 0's process."""
        cfg, address = self.config, ray.util.get_node_ip_address()

        def listen(kind: str, world_size: int | None = None) -> dist.Store:
            store = make_store(address, 0, world_size or group_size(self.mesh, kind), is_master=True,
                               timeout_s=GROUP_TIMEOUT_S)
            self._stores.append(store)
            return store
        world = listen("world") if cfg.masters.shard_frozen_backbone else None
        dp = [listen("dp") for _ in range(self.mesh.tp)] if world is None and self.mesh.dp > 1 else []
        tp = [listen("tp") for _ in range(self.mesh.dp)] if world is None and self.mesh.tp > 1 else []
        stages = [listen("stages") for _ in range(self.mesh.dp)] if self.mesh.pp > 1 else []
        by_node: dict[str, list[tuple[int, int]]] = {}
        for m, t, _ in self.mesh.ranks():
            by_node.setdefault(self.nodes[m], []).append((m, t))
        node_groups = {}
        for ranks in by_node.values():  # issue 51: one group per node hosting several master processes
            if len(ranks) > 1 and self.mesh.pp == 1:  # a pipeline's stages read their own layers each
                store = listen("node", len(ranks))
                node_groups.update({rank: ((address, store.port), member, len(ranks))
                                    for member, rank in enumerate(ranks)})
        where = lambda store: (address, store.port)  # noqa: E731
        return ProcessRendezvous(self.mesh, where(world) if world else None, [where(s) for s in dp],
                                 [where(s) for s in tp], node_groups, [where(s) for s in stages])

    def rows(self) -> RayRows:
        return self._rows

    def call(self, method: str, *args, ranks=None) -> Pending:
        which = range(len(self.actors)) if ranks is None else ranks
        args = tuple(ray.put(a) if isinstance(a, dict) and len(self.actors) > 1 else a for a in args)
        return [getattr(self.actors[i], method).remote(*args) for i in which]

    def wait(self, pending: Pending) -> list:
        return ray.get(pending)

    def watch(self, replicas: Replicas, pending: Pending) -> None:
        """Master 0 must not wait in the gradient sum for a failed master, and must name it when the group breaks."""
        if replicas is not SINGLE:
            replicas.watch = lambda failed: _raise_if_failed(pending, GROUP_BREAK_GRACE_S if failed else 0)

    def abort(self, pending: Pending, cause: BaseException) -> None:
        """The ranks may wait in the gradient sum (or a TP collective) master 0 left: they are ended (`close`, by
        the group). With TP ranks, a rank that died is named first (its RayActorError raised): its death is what
        broke master 0's step, as a gloo or NCCL error that does not say which process it was."""
        if self.mesh.tp > 1 or self.config.masters.shard_frozen_backbone:
            _raise_if_failed(pending, RANK_LOSS_GRACE_S if _connection_broke(cause) else RANK_FAILURE_GRACE_S)

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._stores = [], []
