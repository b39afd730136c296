"""Data-parallel masters on Ray: MasterReplica actors, masters 1..M-1 of `vela_ray.runtime.masters`.

Each replica runs on its own node (the workers' nodes other than master 0's, in the order the
workers fill them; round robin when there are more masters than nodes), loads the backbone, and
sends its rows to the same ExpertManagers over Ray object refs. The masters form a gloo group of
their own (master 0 in the MasterActor is rank 0) for the backbone gradient sum.

    peers = RayPeers(config, cluster.handles, cluster.node_ids, master_node, table)
    done = peers.start_step(micro_batches, lr, max_grad_norm)   # then master 0's own train_step
    peer_steps = done()
"""

from __future__ import annotations

import logging
import os

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.transports import RayObjectRefTransport, data_plane_env
from vela_ray.config import JobConfig
from vela_ray.model.collective import make_group, make_store
from vela_ray.model.traffic import TrafficSnapshot, link_tiers
from vela_ray.quiet import silence_known_warnings
from vela_ray.runtime.masters import master_loss, peer_nodes, peer_step, sequence_migration
from vela_ray.runtime.migration import master_table
from vela_ray.runtime.pool import Wait, master_spec
from vela_ray.model.tensor_parallel import join_group
from vela_ray.training.replicas import SINGLE, ProcessGroupReplicas
from vela_ray.training.sequence_migration import NodeMap
from vela_ray.training.step import (
    STEPPED_ELSEWHERE, MasterModel, build_master_replica, load_master_state, model_loss, shard_master, shard_state,
    train_step,
)

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0  # a master that never reaches the gradient sum (it failed) is given up after this
GROUP_BREAK_GRACE_S = 20.0  # after the group broke, how long master 0 waits for Ray to say which master failed


class MasterReplica:
    """Master `rank` of `config.masters.count`: a backbone replica with brokers to the shared workers; or, with
    `cluster.master_tp`, rank `tp_rank` of master 0's tensor-parallel group (`join_tensor_parallel`)."""

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

    def join(self, host: str, port: int, handles: list, worker_nodes: list[str], master_nodes: list[str],
             table: list) -> None:
        """Join the masters' group, load the backbone and build brokers over `table` to `handles`."""
        address = ray.util.get_node_ip_address()
        store = make_store(host, port, self.num_masters, is_master=False, timeout_s=GROUP_TIMEOUT_S)
        self.replicas = ProcessGroupReplicas(make_group(store, self.rank, self.num_masters, GROUP_TIMEOUT_S, address))
        cfg = self.config
        self.master = build_master_replica(self.spec, master_table(table, self.rank),
                                           self._transport(handles, worker_nodes), rank=self.rank)
        self.migration = sequence_migration(cfg, self.rank, self.master, NodeMap.of(master_nodes, worker_nodes))
        self.loss_fn = master_loss(cfg, self.rank, self.master, self.migration, self.replicas, self.spec.device)

    def join_tensor_parallel(self, host: str, port: int, handles: list, worker_nodes: list[str], table: list) -> None:
        """Join master 0's TP group, load the backbone, build brokers over `table` to `handles` and keep this
        rank's shards (`step.shard_master`); it trains on the whole batch, as every rank of the group does."""
        cfg = self.config
        store = make_store(host, port, cfg.cluster.master_tp, is_master=False, timeout_s=GROUP_TIMEOUT_S)
        mesh = join_group(store, self.tp_rank, cfg.cluster.master_tp, self.spec.device, GROUP_TIMEOUT_S)
        self.replicas, self.migration, self.loss_fn = SINGLE, None, model_loss
        self.master = build_master_replica(self.spec, master_table(table, self.rank),
                                           self._transport(handles, worker_nodes), rank=self.tp_rank)
        shard_master(self.master, mesh)

    def shard_state(self, copy: bool) -> dict[str, torch.Tensor]:
        """This rank's shards of the backbone LoRA and AdamW state (rank 0 merges the group's)."""
        return shard_state(self.master, copy)

    @torch.no_grad()
    def mirror(self, args: tuple, kwargs: dict, training: bool) -> None:
        """The forward rank 0 runs without gradients (eval, profile), on the same inputs: the group computes it
        together (`RayTensorParallel`)."""
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
        before = self.master.dispatcher.counter.snapshot()
        train_step(self.master, STEPPED_ELSEWHERE, micro_batches, lr, max_grad_norm, loss_fn=self.loss_fn,
                   replicas=self.replicas)
        return peer_step(self.master.dispatcher.counter.snapshot() - before, self.migration)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_master_state(self.master, tensors)

    def rebind(self, table: list) -> None:
        self.master.dispatcher.rebind(master_table(table, self.rank))

    def traffic(self) -> TrafficSnapshot:
        return self.master.dispatcher.counter.snapshot()

    def reset_traffic(self) -> None:
        self.master.dispatcher.counter.reset()


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
    """`vela_ray.runtime.masters.PeerMasters` over MasterReplica actors; master 0 is this process."""

    def __init__(self, config: JobConfig, handles: list, worker_nodes: list[str], master_node: str, table: np.ndarray):
        self.config = config
        self.num_masters = config.masters.count
        self.nodes = [master_node, *peer_nodes(worker_nodes, master_node, self.num_masters - 1)]
        env = data_plane_env(config.data_plane.inline_bytes, config.data_plane.zero_copy_tensors)
        self.actors = [
            ray.remote(MasterReplica).options(
                num_cpus=0, num_gpus=config.cluster.master_gpus or 0, max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(config, rank)
            for rank, node in enumerate(self.nodes[1:], start=1)
        ]
        self.replicas = self._form_group(handles, worker_nodes, table)
        logger.info("%d data-parallel masters on nodes %s", self.num_masters, self.nodes)

    def _form_group(self, handles: list, worker_nodes: list[str], table: np.ndarray) -> ProcessGroupReplicas:
        address = ray.util.get_node_ip_address()
        store = make_store(address, 0, self.num_masters, is_master=True, timeout_s=GROUP_TIMEOUT_S)
        joins = [a.join.remote(store.host, store.port, handles, worker_nodes, self.nodes, np.asarray(table).tolist())
                 for a in self.actors]
        self._store = store  # the rendezvous must outlive the joins
        group = make_group(store, 0, self.num_masters, GROUP_TIMEOUT_S, address)
        ray.get(joins)
        return ProcessGroupReplicas(group)

    def start_step(self, micro_batches, lr, max_grad_norm) -> Wait:
        host = [{k: v.cpu() for k, v in m.items()} for m in micro_batches]
        refs = [a.train_step.remote(host, lr, max_grad_norm) for a in self.actors]
        # master 0 must not wait for a failed master, and must name it when the group breaks
        self.replicas.watch = lambda group_failed: _raise_if_failed(refs, GROUP_BREAK_GRACE_S if group_failed else 0)
        return lambda: ray.get(refs)

    def abort(self) -> None:
        """The peers may wait in the gradient sum master 0 left: end them (a recovery starts new ones)."""
        self.close()

    def load_state(self, tensors) -> None:
        state = ray.put(tensors)
        ray.get([a.load_state.remote(state) for a in self.actors])

    def rebind(self, table) -> None:
        ray.get([a.rebind.remote(np.asarray(table).tolist()) for a in self.actors])

    def traffic(self) -> list[TrafficSnapshot]:
        return ray.get([a.traffic.remote() for a in self.actors])

    def reset_traffic(self) -> None:
        ray.get([a.reset_traffic.remote() for a in self.actors])

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


class RayTensorParallel:
    """`vela_ray.runtime.masters.PeerMasters` over master 0's tensor-parallel ranks 1..T-1 (`cluster.master_tp`),
    MasterReplica actors on master 0's node; master 0 (`leader`, this process) is rank 0.

    Every rank holds a shard of the backbone and runs the same computation on the same batch: the runner's step
    starts theirs (`start_step`); a forward that master 0 runs without gradients (eval, the routing profile) is
    sent to them as it starts (a forward pre-hook on master 0's model), so the group's collectives meet. Master 0
    reads their shards to checkpoint and export (`MasterModel.tp_states`), and every rank takes its share of a
    loaded state, so checkpoints hold full tensors and resume at any TP degree.
    """

    replicas = SINGLE
    num_masters = 1  # data-parallel masters: the group is one master

    def __init__(self, config: JobConfig, handles: list, worker_nodes: list[str], master_node: str, table: np.ndarray,
                 leader: MasterModel):
        self.config = config
        self.nodes = [master_node]
        size = config.cluster.master_tp
        env = data_plane_env(config.data_plane.inline_bytes, config.data_plane.zero_copy_tensors)
        self.actors = [
            ray.remote(MasterReplica).options(
                num_cpus=0, num_gpus=config.cluster.master_gpus or 0, max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(master_node, soft=False),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(config, 0, tp_rank)
            for tp_rank in range(1, size)
        ]
        self._pending: list = []  # the ranks' mirrored forwards, checked at the next call
        try:
            self._form_group(handles, worker_nodes, table, leader)
        except BaseException:
            self.close()
            raise
        leader.tp_states = self._states
        self._hook = leader.peft_model.register_forward_pre_hook(self._mirror, with_kwargs=True)
        logger.info("master 0 tensor-parallel over %d ranks on node %s", size, master_node)

    def _form_group(self, handles: list, worker_nodes: list[str], table: np.ndarray, leader: MasterModel) -> None:
        size, device = self.config.cluster.master_tp, leader_device(leader)
        store = make_store("127.0.0.1", 0, size, is_master=True, timeout_s=GROUP_TIMEOUT_S)  # one node
        joins = [a.join_tensor_parallel.remote(store.host, store.port, handles, worker_nodes, np.asarray(table).tolist())
                 for a in self.actors]
        self._store = store  # the rendezvous must outlive the joins
        mesh = join_group(store, 0, size, device, GROUP_TIMEOUT_S)
        shard_master(leader, mesh)  # with theirs: sharding the vocabulary is collective
        ray.get(joins)

    def _mirror(self, module, args, kwargs) -> None:
        if torch.is_grad_enabled():  # a training forward: every rank runs its own train_step
            return
        host_args, host_kwargs = tuple(_host(a) for a in args), {k: _host(v) for k, v in kwargs.items()}
        self._pending += [a.mirror.remote(host_args, host_kwargs, module.training) for a in self.actors]

    def _settle(self) -> None:
        pending, self._pending = self._pending, []
        ray.get(pending)

    def _states(self, copy: bool) -> list[dict[str, torch.Tensor]]:
        self._settle()
        return ray.get([a.shard_state.remote(copy) for a in self.actors])

    def start_step(self, micro_batches, lr, max_grad_norm) -> Wait:
        self._settle()
        host = [{k: v.cpu() for k, v in m.items()} for m in micro_batches]
        refs = [a.train_step.remote(host, lr, max_grad_norm) for a in self.actors]
        return lambda: ray.get(refs)

    def abort(self) -> None:
        """The ranks may wait in a collective master 0 left: end them."""
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
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._pending = [], []


def leader_device(master: MasterModel) -> torch.device:
    return next(master.peft_model.parameters()).device
