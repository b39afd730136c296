"""Data-parallel masters (`masters.count`): backbone replicas that split every batch and share the workers.

Master 0 runs the job (`JobRunner`); masters 1..M-1, its *peers*, each hold a copy of the
backbone with its LoRA and AdamW state and brokers of their own to the same ExpertManagers.
In every step each master runs `train_step` on its rows of each micro-batch
(`ReplicaShare`, the expert-parallel baseline's split), so:
  - the backbone LoRA gradients are summed among the masters (`Replicas.sync_grads`) and
    every master takes the same AdamW step;
  - the experts' LoRA gradients accumulate on the workers from every master's rows; master 0
    alone reads their norm and steps them (peers see the workers as `STEPPED_ELSEWHERE`),
    after the gradient sum, by which time every master's backward has returned;
so the losses equal one master's on the whole batch. Each master numbers the forwards it
saves on the workers in its own residue class (`ExpertDispatcher(master=, num_masters=)`).

Master 0 keeps the run's state (checkpoints, evaluation, profile, placement); the peers get
it with `load_state` whenever master 0's changes other than by a step (start, resume,
recovery), and a new table with `rebind` after every migration.

With `masters.sequence_migration` every master's loss function moves its sequences among the
masters during the forward (`master_loss`, `vela_ray.training.sequence_migration`).

Two kinds of peers, one protocol (`runtime.pool.PeerMasters`): `ThreadPeers` (threads of
this process, over the in-process ExpertManagers) and `actors.masters.RayPeers`
(MasterReplica actors, one per node). `runtime.pool.SoloMaster` is the single master.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import numpy as np
import torch

from vela_ray.config import JobConfig
from vela_ray.model.traffic import TrafficSnapshot, link_tiers
from vela_ray.model.transport import InProcessTransport
from vela_ray.runtime.migration import master_table
from vela_ray.runtime.pool import PeerMasters, Wait, WorkerPool, master_spec
from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.replicas import Exchanger, ReplicaShare, ThreadGroup
from vela_ray.training.sequence_migration import NodeMap, SequenceMigration, SequenceMoveStats
from vela_ray.training.expert_workers import STEPPED_ELSEWHERE
from vela_ray.training.master import MasterModel, build_master_replica, load_master_state
from vela_ray.training.step import LossFn, train_step

def peer_nodes(worker_nodes: Sequence[str], master_node: str, num_peers: int) -> list[str]:
    """Nodes of masters 1..M-1: the workers' nodes other than master 0's, in order; round robin over
    all of them (master 0's last) when there are more masters than nodes."""
    others = [n for n in dict.fromkeys(worker_nodes) if n != master_node]
    cycle = others + [master_node]
    return [cycle[i % len(cycle)] for i in range(num_peers)]


class ThreadPeers:
    """Peers as threads of this process over the in-process ExpertManagers (`InProcessPool`).

    Master 0's own transport must be an `InProcessTransport` on the same lock (`InProcessPool` makes it).
    `worker_nodes`: the workers' nodes; the peers take nodes as Ray's would (`peer_nodes`), and each
    counts its traffic by its own link tiers (all same_process on `LOCAL_NODE`, the plain in-process case).
    """

    def __init__(self, config: JobConfig, managers: list[ExpertManager], table: np.ndarray, node: str,
                 lock: threading.Lock, worker_nodes: list[str]):
        self.config = config
        self.num_masters = config.masters.count
        self.nodes = [node, *peer_nodes(worker_nodes, node, self.num_masters - 1)]
        self.lock = lock
        self.group = ThreadGroup(self.num_masters)
        self.replicas = self.group.member(0)
        self.masters = [self._build(rank, managers, table, worker_nodes) for rank in range(1, self.num_masters)]
        self.migrations = [sequence_migration(config, rank, m, NodeMap.of(self.nodes, worker_nodes))
                           for rank, m in enumerate(self.masters, start=1)]
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def _build(self, rank: int, managers: list[ExpertManager], table: np.ndarray,
               worker_nodes: list[str]) -> MasterModel:
        transport = InProcessTransport(managers, self.lock, link_tiers(self.nodes[rank], worker_nodes))
        return build_master_replica(master_spec(self.config), master_table(table, rank), transport, rank=rank)

    def start_step(self, micro_batches, lr, max_grad_norm) -> Wait:
        self._errors = []
        befores = [m.dispatcher.traffic() for m in self.masters]
        self._threads = [threading.Thread(target=self._step, args=(rank, m, micro_batches, lr, max_grad_norm),
                                          name=f"vela-master-{rank}", daemon=True)
                         for rank, m in enumerate(self.masters, start=1)]
        for thread in self._threads:
            thread.start()

        def wait() -> list[dict]:
            self._join()
            if self._errors:
                raise self._errors[0]
            return [peer_step(m.dispatcher.traffic() - before, migration)
                    for m, before, migration in zip(self.masters, befores, self.migrations)]
        return wait

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads = []

    def abort(self) -> None:
        """Raises the first peer's own error, if a peer failed (master 0 then saw only the broken group)."""
        self.group.abort()
        self._join()
        self.group = ThreadGroup(self.num_masters)
        self.replicas = self.group.member(0)
        failed = [e for e in self._errors if not isinstance(e, threading.BrokenBarrierError)]
        if failed:
            raise failed[0]

    def _step(self, rank: int, master: MasterModel, micro_batches, lr: float, max_grad_norm) -> None:
        try:
            replicas = self.group.member(rank)
            loss_fn = master_loss(self.config, rank, master, self.migrations[rank - 1], replicas)
            train_step(master, STEPPED_ELSEWHERE, micro_batches, lr, max_grad_norm, loss_fn=loss_fn, replicas=replicas)
        except BaseException as exc:  # noqa: BLE001 - handed to master 0's thread by wait()
            self._errors.append(exc)
            self.group.abort()

    def load_state(self, tensors) -> None:
        for master in self.masters:
            load_master_state(master, tensors)

    def rebind(self, table) -> None:
        for rank, master in enumerate(self.masters, start=1):
            master.dispatcher.rebind(master_table(table, rank))

    def traffic(self) -> list:
        return [m.dispatcher.traffic() for m in self.masters]

    def reset_traffic(self) -> None:
        for master in self.masters:
            master.dispatcher.reset_traffic()

    def pids(self) -> list[int]:
        return [os.getpid()] * len(self.masters)

    def close(self) -> None:
        for migration in self.migrations:
            if migration is not None:
                migration.detach()
        self.masters, self.migrations = [], []


def start_peers(config: JobConfig, pool: WorkerPool, table: np.ndarray, master: MasterModel,
                worker_nodes: list[str]) -> tuple[PeerMasters, SequenceMigration | None]:
    """Masters 1..M-1 over `table` (none for one master), and master 0's sequence migration among them."""
    peers = pool.start_peers(table, master)
    migration = None if peers.num_masters == 1 else sequence_migration(
        config, 0, master, NodeMap.of(peers.nodes, worker_nodes))
    return peers, migration


def sequence_migration(config: JobConfig, rank: int, master: MasterModel, nodes: NodeMap) -> SequenceMigration | None:
    """Master `rank`'s `SequenceMigration` (hooks on its model) with `masters.sequence_migration`, else None."""
    if not config.masters.sequence_migration:
        return None
    return SequenceMigration(master.peft_model, master.dispatcher, rank, config.masters.count, nodes,
                             config.masters.sequence_migration_candidates, config.masters.sequence_migration_combine)


def master_loss(config: JobConfig, rank: int, master: MasterModel, migration: SequenceMigration | None,
                exchanger: Exchanger, device: torch.device | str = "cpu") -> LossFn:
    """Master `rank`'s loss function of a step: its share of each micro-batch, its sequences moving among
    the masters (over `exchanger`, its member of the masters' group) when it has a `migration`."""
    share = master_share(rank, config.masters.count, master.peft_model, device)
    return share.loss if migration is None else migration.loss_fn(share, exchanger)


def master_share(rank: int, num_masters: int, model: torch.nn.Module, device: torch.device | str = "cpu"
                 ) -> ReplicaShare:
    """Master `rank`'s rows and loss share of every micro-batch (a router aux loss weighted as the
    expert-parallel ranks weight theirs)."""
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    return ReplicaShare(rank, num_masters, coef, device)


def peer_step(traffic: TrafficSnapshot, migration: SequenceMigration | None = None) -> dict:
    """What master 0's step record takes from a peer's step: its traffic (with the tokens it routed to each
    expert), its bytes by its own link tiers, and what its sequence migration moved."""
    moves = (migration.take_stats() if migration is not None else SequenceMoveStats()).as_dict()
    return {"traffic": traffic, "bytes_by_tier": traffic.bytes_by_tier(), "sequence_moves": moves}
