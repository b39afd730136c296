"""Several master processes on Ray: MasterReplica actors, the masters of `vela_ray.runtime.masters` as a 2-D mesh.

`masters.count` = M data-parallel masters, each `cluster.master_tp` = T tensor-parallel ranks: M*T processes,
rank (m, t) a MasterReplica actor on master m's node (the workers' nodes other than master 0's, in the order the
workers fill them; round robin when there are more masters than nodes), except (0, 0), master 0 in the
MasterActor. Every rank holds the backbone (or its shards) and sends rows to the same ExpertManagers over Ray
object refs; the master processes of one node form a node group in which each backbone tensor is read once and
sent to the others (`vela_ray.model.sharded_loading`).
  - data-parallel: the ranks of one TP index t form a gloo group of their own (master 0's at rank 0) for the
    backbone gradient sum (`ProcessGroupReplicas`), each master m taking its share of every micro-batch;
  - tensor-parallel: the T ranks of master m form its TP group (each process's default group, gloo or NCCL;
    `vela_ray.model.tensor_parallel`), hold shards of its backbone and send disjoint shares of its rows; master
    0's other ranks also run the forwards master 0 runs without gradients (eval, the routing profile), sent to
    them as they start, and give it their shards to checkpoint and export;
  - with `masters.shard_frozen_backbone`, every master process joins one (dp, tp) mesh instead (its default
    group; DP gradient sums over its "dp" groups) and FSDP2 shards each decoder layer's frozen weights over "dp"
    (`tensor_parallel.shard_frozen`): every master then runs master 0's no-grad forwards with it.

    peers = RayPeers(config, cluster.handles, cluster.node_ids, master_node, table, master)
    done = peers.start_step(micro_batches, lr, max_grad_norm)   # then master 0's own train_step
    peer_steps = done()
"""

from __future__ import annotations

import logging
import os

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.transports import RayObjectRefTransport, data_plane_env
from vela_ray.config import JobConfig
from vela_ray.model.collective import make_group, make_store
from vela_ray.model.tensor_parallel import join_mesh, shard_frozen
from vela_ray.model.traffic import TrafficSnapshot, link_tiers
from vela_ray.quiet import silence_known_warnings
from vela_ray.runtime.masters import master_loss, peer_nodes, peer_step, sequence_migration
from vela_ray.runtime.migration import master_table
from vela_ray.runtime.pool import Wait, master_spec
from vela_ray.training.replicas import SINGLE, ProcessGroupReplicas, Replicas
from vela_ray.training.sequence_migration import NodeMap
from vela_ray.training.expert_workers import STEPPED_ELSEWHERE
from vela_ray.training.master import MasterModel, build_master_rank, load_master_state, shard_and_read, shard_state
from vela_ray.training.step import train_step

logger = logging.getLogger(__name__)

Rendezvous = tuple[str, int]  # a group's TCPStore (host, port), master 0's process listening
NodeRendezvous = tuple[Rendezvous, int, int]  # a node group's store, this process's place in it, its size


GROUP_TIMEOUT_S = 300.0  # a master that never reaches the gradient sum (it failed) is given up after this
GROUP_BREAK_GRACE_S = 20.0  # after the group broke, how long master 0 waits for Ray to say which master failed
# after master 0's step failed with tensor-parallel ranks: how long it waits for Ray to say whether one of its
# ranks died (a dead rank breaks master 0's own collectives at once; live ones wait in theirs for master 0)
RANK_LOSS_GRACE_S = 5.0


class MasterReplica:
    """Rank (`rank`, `tp_rank`) of the masters' mesh: data-parallel master `rank` of `masters.count`, tensor-parallel
    rank `tp_rank` of its `cluster.master_tp`; a backbone replica (or shard) with brokers to the shared workers."""

    def __init__(self, config: JobConfig, rank: int, tp_rank: int = 0):
        silence_known_warnings()
        self.config, self.rank, self.tp_rank = config, rank, tp_rank
        self.num_masters = config.masters.count
        self.spec = master_spec(config)  # its device: the GPU Ray gave it with cluster.master_gpus: 1
        self.master = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def join(self, rendezvous: dict[str, Rendezvous], handles: list, worker_nodes: list[str],
             master_nodes: list[str], table: list, node: NodeRendezvous | None = None) -> None:
        """Join its groups (`join_groups`; `rendezvous`: each one's store) and its node's (`join_node`), load the
        backbone (only its shards under tensor parallelism, each read once per node), build brokers over `table`
        to `handles`, and shard the frozen backbone over the data-parallel masters with
        `masters.shard_frozen_backbone`."""
        cfg = self.config
        stores = {kind: make_store(host, port, group_size(cfg, kind), is_master=False, timeout_s=GROUP_TIMEOUT_S)
                  for kind, (host, port) in rendezvous.items()}
        self.replicas, tp_mesh, dp_mesh = join_groups(cfg, self.rank, self.tp_rank, stores, self.spec.device)
        node_group = join_node(node)  # issue 51: the backbone is read once per node
        table, transport = master_table(table, self.rank), self._transport(handles, worker_nodes)
        rank = self.rank * cfg.cluster.master_tp + self.tp_rank  # its place among the workers' masters
        self.master, _ = build_master_rank(self.spec, table, transport, tp_mesh, rank=rank, node=node_group)
        if dp_mesh is not None:
            shard_frozen(self.master.peft_model, dp_mesh)
        self.migration = sequence_migration(cfg, self.rank, self.master, NodeMap.of(master_nodes, worker_nodes))
        self.loss_fn = master_loss(cfg, self.rank, self.master, self.migration, self.replicas, self.spec.device)

    def shard_state(self, copy: bool) -> dict[str, torch.Tensor]:
        """This rank's shards of the backbone LoRA and AdamW state (rank 0 merges the group's)."""
        return shard_state(self.master, copy)

    @torch.no_grad()
    def mirror(self, args: tuple, kwargs: dict, training: bool) -> None:
        """The forward rank 0 runs without gradients (eval, profile), on the same inputs: the group computes it
        together (`RayPeers`)."""
        device = self.spec.device
        model = self.master.peft_model
        was_training = model.training
        model.train(training)
        try:
            model(*[_to(a, device) for a in args], **{k: _to(v, device) for k, v in kwargs.items()})
        finally:
            model.train(was_training)

    def _transport(self, handles: list, worker_nodes: list[str]) -> RayObjectRefTransport:
        return RayObjectRefTransport(handles, link_tiers(self.node_id(), worker_nodes),
                                     zero_copy=self.config.data_plane.zero_copy_tensors)

    def train_step(self, micro_batches: list[dict], lr: float, max_grad_norm: float | None) -> dict:
        """This master's share of one step (see `vela_ray.runtime.masters`); its `peer_step` record."""
        before = self.master.dispatcher.traffic()
        train_step(self.master, STEPPED_ELSEWHERE, micro_batches, lr, max_grad_norm, loss_fn=self.loss_fn,
                   replicas=self.replicas)
        return peer_step(self.master.dispatcher.traffic() - before, self.migration)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_master_state(self.master, tensors)

    def rebind(self, table: list) -> None:
        self.master.dispatcher.rebind(master_table(table, self.rank))

    def traffic(self) -> TrafficSnapshot:
        return self.master.dispatcher.traffic()

    def reset_traffic(self) -> None:
        self.master.dispatcher.reset_traffic()


def group_size(config: JobConfig, kind: str) -> int:
    """Ranks of a group `kind`: "world" (every master process, the (dp, tp) mesh), "dp" (the data-parallel masters'
    ranks of one TP index) or "tp" (one master's ranks)."""
    return {"world": config.masters.count * config.cluster.master_tp, "dp": config.masters.count,
            "tp": config.cluster.master_tp}[kind]


def join_groups(config: JobConfig, rank: int, tp_rank: int, stores: dict[str, dist.Store], device: torch.device
                ) -> tuple[Replicas, object | None, object | None]:
    """Rank (`rank`, `tp_rank`)'s groups: (its data-parallel `Replicas`, its master's TP mesh or None, the
    data-parallel mesh FSDP2 shards the frozen backbone over or None), from `stores` by kind (`group_size`).
    With "world" (`masters.shard_frozen_backbone`) one (dp, tp) mesh of every master process gives all three;
    otherwise a "dp" store makes a gloo group of its own (the data-parallel masters' gradient sum, watched for a
    failed master) and a "tp" store this master's TP mesh."""
    address = ray.util.get_node_ip_address()
    masters, ranks = config.masters.count, config.cluster.master_tp
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


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _raise_if_failed(refs: list, timeout_s: float = 0.0) -> None:
    """Raise the error of a failed one of `refs`, waiting up to `timeout_s` for them to end: a dead
    master's (RayActorError) first, else the first error; those that finished well return."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    errors = []
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            raise
        except Exception as err:  # noqa: BLE001 - a surviving master whose group broke; reported if none died
            errors.append(err)
    if errors:
        raise errors[0]


class RayPeers:
    """`vela_ray.runtime.masters.PeerMasters` over MasterReplica actors: every rank of the masters' mesh but
    (0, 0), master 0 (`leader`), which is this process (see the module docstring)."""

    def __init__(self, config: JobConfig, handles: list, worker_nodes: list[str], master_node: str, table: np.ndarray,
                 leader: MasterModel):
        self.config = config
        self.num_masters, self.tp = config.masters.count, config.cluster.master_tp
        self.nodes = [master_node, *peer_nodes(worker_nodes, master_node, self.num_masters - 1)]
        env = data_plane_env(config.data_plane.inline_bytes, config.data_plane.zero_copy_tensors)
        self.ranks = [(m, t) for m in range(self.num_masters) for t in range(self.tp) if (m, t) != (0, 0)]
        self.actors = [
            ray.remote(MasterReplica).options(
                num_cpus=0, num_gpus=config.cluster.master_gpus or 0, max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.nodes[m], soft=False),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(config, m, t)
            for m, t in self.ranks
        ]
        self.followers = [a for a, (m, _) in zip(self.actors, self.ranks) if m == 0]  # master 0's other TP ranks
        # who runs master 0's forwards without gradients with it: its TP ranks, or every master when the frozen
        # backbone is sharded among them (each layer is all-gathered from all)
        self.mirrors = self.actors if config.masters.shard_frozen_backbone else self.followers
        self._pending: list = []  # the mirrored forwards, checked at the next call
        self._steps: list = []  # the ranks' train_step calls of the step in flight
        self._hook = None
        try:
            self.replicas = self._form_groups(handles, worker_nodes, table, leader)
        except BaseException:
            self.close()
            raise
        if self.followers:
            leader.tp_states = self._states
        if self.mirrors:
            self._hook = leader.peft_model.register_forward_pre_hook(self._mirror, with_kwargs=True)
        logger.info("%d data-parallel masters of %d tensor-parallel ranks on nodes %s", self.num_masters, self.tp,
                    self.nodes)

    def _form_groups(self, handles: list, worker_nodes: list[str], table: np.ndarray, leader: MasterModel) -> Replicas:
        """Every group's rendezvous listens here; the ranks join theirs while master 0 joins its own."""
        cfg, address = self.config, ray.util.get_node_ip_address()
        listen = lambda kind: make_store(address, 0, group_size(cfg, kind), is_master=True,  # noqa: E731
                                         timeout_s=GROUP_TIMEOUT_S)
        world = listen("world") if cfg.masters.shard_frozen_backbone else None  # one (dp, tp) mesh of all
        dp = [listen("dp") for _ in range(self.tp)] if world is None and self.num_masters > 1 else []
        tp = [listen("tp") for _ in range(self.num_masters)] if world is None and self.tp > 1 else []
        self._stores = [world] if world is not None else dp + tp  # the rendezvous must outlive the joins

        def stores_of(m: int, t: int) -> dict[str, dist.Store]:
            if world is not None:
                return {"world": world}
            return {**({"dp": dp[t]} if dp else {}), **({"tp": tp[m]} if tp else {})}

        nodes = self._node_stores(address)  # issue 51: one group per node hosting several master processes
        self._stores += [store for store, member, _ in nodes.values() if member == 0]
        joins = [a.join.remote({k: (s.host, s.port) for k, s in stores_of(m, t).items()}, handles, worker_nodes,
                               self.nodes, np.asarray(table).tolist(),
                               ((nodes[m, t][0].host, nodes[m, t][0].port), *nodes[m, t][1:]) if (m, t) in nodes
                               else None)
                 for a, (m, t) in zip(self.actors, self.ranks)]
        replicas, tp_mesh, dp_mesh = join_groups(cfg, 0, 0, stores_of(0, 0), leader_device(leader))
        # issue 51: master 0 reads its shards once its group exists (`runtime.state.Backbone.load` built it on the
        # unread skeleton), or, holding the whole backbone (no TP), sends it to the other masters on its node
        node = make_group(nodes[0, 0][0], 0, nodes[0, 0][2], GROUP_TIMEOUT_S, address) if (0, 0) in nodes else None
        if tp_mesh is not None or node is not None:
            shard_and_read(leader, master_spec(cfg), tp_mesh, node, holds_backbone=tp_mesh is None)
        if dp_mesh is not None:
            shard_frozen(leader.peft_model, dp_mesh)
        ray.get(joins)
        return replicas

    def _node_stores(self, address: str) -> dict[tuple[int, int], tuple[dist.Store, int, int]]:
        """Issue 51: for each master process on a node that hosts several, (its node group's rendezvous, listening
        at `address`, its place in it, the group's size), master 0 first on its node."""
        by_node: dict[str, list[tuple[int, int]]] = {}
        for m, t in [(0, 0), *self.ranks]:
            by_node.setdefault(self.nodes[m], []).append((m, t))
        out = {}
        for ranks in by_node.values():
            if len(ranks) > 1:
                store = make_store(address, 0, len(ranks), is_master=True, timeout_s=GROUP_TIMEOUT_S)
                out.update({rank: (store, member, len(ranks)) for member, rank in enumerate(ranks)})
        return out

    def _mirror(self, module, args, kwargs) -> None:
        """Master 0's forward pre-hook: a forward without gradients (eval, the routing profile) runs on its
        `mirrors` too, with the same inputs; a training forward is every rank's own `train_step`."""
        if torch.is_grad_enabled():
            return
        host_args, host_kwargs = tuple(_host(a) for a in args), {k: _host(v) for k, v in kwargs.items()}
        self._pending += [a.mirror.remote(host_args, host_kwargs, module.training) for a in self.mirrors]

    def _settle(self) -> None:
        pending, self._pending = self._pending, []
        ray.get(pending)

    def _states(self, copy: bool) -> list[dict[str, torch.Tensor]]:
        self._settle()
        return ray.get([a.shard_state.remote(copy) for a in self.followers])

    def start_step(self, micro_batches, lr, max_grad_norm) -> Wait:
        self._settle()
        host = [{k: v.cpu() for k, v in m.items()} for m in micro_batches]
        refs = self._steps = [a.train_step.remote(host, lr, max_grad_norm) for a in self.actors]
        if self.replicas is not SINGLE:  # master 0 must not wait for a failed master, and must name it when the
            # group breaks
            self.replicas.watch = lambda failed: _raise_if_failed(refs, GROUP_BREAK_GRACE_S if failed else 0)
        return lambda: ray.get(refs)

    def abort(self) -> None:
        """The peers may wait in the gradient sum (or a TP collective) master 0 left: end them (a recovery starts
        new ones). When master 0 has TP ranks, a rank that died is named first (its RayActorError raised): its
        death is what broke master 0's step, as a gloo or NCCL error that does not say which process it was."""
        try:
            if self.mirrors and self._steps:
                _raise_if_failed(self._steps, RANK_LOSS_GRACE_S)
        finally:
            self.close()

    def load_state(self, tensors) -> None:
        self._settle()
        state = ray.put(tensors)
        ray.get([a.load_state.remote(state) for a in self.actors])

    def rebind(self, table) -> None:
        self._settle()
        ray.get([a.rebind.remote(np.asarray(table).tolist()) for a in self.actors])

    def traffic(self) -> list[TrafficSnapshot]:
        return ray.get([a.traffic.remote() for a in self.actors])

    def reset_traffic(self) -> None:
        ray.get([a.reset_traffic.remote() for a in self.actors])

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.followers, self.mirrors, self._pending, self._steps = [], [], [], [], []


def leader_device(master: MasterModel) -> torch.device:
    return next(master.peft_model.parameters()).device
