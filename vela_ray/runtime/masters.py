"""The masters as one group: every master rank of a job on one (data-parallel x pipeline x tensor-parallel) mesh.

`masters.count` = D data-parallel masters, each of `cluster.master_tp` = T tensor-parallel ranks: D*T ranks
(`MasterMesh`), rank (m, t) on master m's node. Rank (0, 0), master 0, is the runner's own (`MasterGroup.leader`,
in this process); the pool hosts the others (`RankHosts`: MasterRank actors in `actors.masters`, threads of this
process in `vela_ray.runtime.local`). Every rank joins its groups through the pool's `Rendezvous` and is built by
one path (`training.master.build_master_rank`: skeleton -> brokers -> peft -> TP shard -> read its shards), master 0
by `MasterGroup.start`, the others by `MasterRank.join`. The group then runs what its ranks do together:

  - a step (`start_step`, then master 0's own `train_step`): master m takes its share of every micro-batch
    (`ReplicaShare`, the expert-parallel baseline's split); the backbone LoRA gradients are summed over the
    data-parallel masters (`Replicas.sync_grads`), and every master takes the same AdamW step; the experts' LoRA
    gradients accumulate on the workers from every master's rows, and master 0 alone reads their norm and steps them
    (the others see the workers as `STEPPED_ELSEWHERE`) after the gradient sum, when every backward has returned;
    so the losses equal one master's on the whole batch. A master's TP ranks shard its backbone and send disjoint
    shares of its rows. With `training.condensation` (LOSSY) every rank condenses the rows it sends with a
    `Condenser` of its own, whose adaptive threshold follows the whole batch's loss as master 0's does. Each rank
    numbers the forwards it saves on the workers in its own residue class
    (`ExpertDispatcher(master=, num_masters=)`); with `masters.sequence_migration` each master's loss moves its
    sequences among the masters during the forward (`master_loss`);
  - master 0's forwards without gradients (`evaluate`, `profile`): its TP ranks, and every rank with
    `masters.shard_frozen_backbone` (each layer all-gathered from all), run the same forwards beside it;
  - the state master 0 changes other than by a step (start, resume, recovery: `load_state`, every rank taking
    its share of the full tensors, and `load_condenser_state`), a new table after a migration (`rebind`), traffic,
    pids, and recovery's new ranks over new workers (`restart_ranks`).

With `masters.pipeline_stages` = S a master's backbone is cut into S stages (`training.pipeline`), one rank
each on its node, GPipe's schedule over the stages' group (`RankGroups.stages`); every stage is built the one way,
then keeps its own layers; master 0 (stage 0) gathers the stages' state, profile and routing pairs. Stages combine
with one data-parallel master of one TP rank (`JobConfig._pipeline_combines`). One master is the 1 x 1 x 1 mesh:
no hosted rank, nothing to sum or to tell.

    masters = MasterGroup.start(config, pool, hosted, table, backbone.model)
    done = masters.start_step(micro_batches, lr, max_grad_norm)   # then master 0's own train_step
    peer_steps = done()
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from vela_ray.config import CondensationSection, JobConfig, MastersSection
from vela_ray.data.datasets import on_device
from vela_ray.data.locality import AccessProfile, RoutingRecorder, profile_forwards, profile_model
from vela_ray.model.adapters import backbone_state_of
from vela_ray.model.condensation import Condenser, CondenserCounts
from vela_ray.model.modeling import MoeBlock
from vela_ray.model.traffic import TrafficSnapshot
from vela_ray.model.transport import Transport
from vela_ray.runtime.migration import master_table
from vela_ray.training.expert_workers import STEPPED_ELSEWHERE
from vela_ray.training.master import (
    MasterModel, MasterSpec, build_master_rank, load_master_state, master_device, shard_and_read, shard_state,
)
from vela_ray.training.popularity import Calls, RoutingPairs, pairs_of, routing_calls, routing_pairs
from vela_ray.training.preference import objective_loss, take_sums
from vela_ray.training.replicas import SINGLE, Exchanger, ReplicaShare, Replicas
from vela_ray.training.sequence_migration import NodeMap, SequenceMigration, SequenceMoveStats
from vela_ray.training.step import Batch, LossFn, eval_loss, master_compute_seconds, model_loss, train_step

logger = logging.getLogger(__name__)

Wait = Callable[[], list[dict]]  # blocks until every hosted rank's step is done; returns their `peer_step` records


@dataclass(frozen=True)
class MasterMesh:
    """The masters' mesh: `dp` data-parallel masters of `pp` pipeline stages (`masters.pipeline_stages`) of `tp`
    tensor-parallel ranks each, rank (m, t, s) flat at (m * pp + s) * tp + t (its place among the workers' masters:
    the residue class of the forwards it saves)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, config: JobConfig) -> MasterMesh:
        return cls(config.masters.count, config.cluster.master_tp, config.masters.pipeline_stages)

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def ranks(self) -> list[tuple[int, int, int]]:
        """Every rank (m, t, s), master 0's first."""
        return [(m, t, s) for m in range(self.dp) for s in range(self.pp) for t in range(self.tp)]

    def flat(self, m: int, t: int, s: int = 0) -> int:
        return (m * self.pp + s) * self.tp + t


@dataclass
class RankGroups:
    """What one rank joined: its member of the data-parallel masters' group, its master's TP group (a 1-D mesh or
    a process group; None without TP), the data-parallel mesh FSDP2 shards the frozen backbone over (None without
    `masters.shard_frozen_backbone`), its node group, whose first member reads each backbone tensor once for the
    node (None: alone on its node), and its member of its master's pipeline stages' group (an `Exchanger`; None
    without `masters.pipeline_stages`)."""

    replicas: Any = SINGLE
    tp: Any = None
    dp_mesh: Any = None
    node: Any = None
    stages: Any = None


class Rendezvous(Protocol):
    """Where the ranks of one mesh meet (made by the pool's `RankHosts.rendezvous`): every rank, master 0 too,
    joins its groups through it, all at once (each join blocks until its groups are complete)."""

    def join(self, m: int, t: int, device: torch.device, stage: int = 0) -> RankGroups: ...


class RowsTo(Protocol):
    """How a hosted rank reaches the workers: the data plane of master process `rank` (its flat place in the mesh)
    on `device`, counted by the link tiers of its `node`."""

    def transport(self, rank: int, node: str, device: torch.device) -> Transport: ...


Pending = list  # calls started on hosted ranks (Ray object refs, futures): `RankHosts.wait` waits for them


class RankHosts(Protocol):
    """Where a pool runs the ranks other than master 0 (one `MasterRank` each), and how master 0 reaches them.
    `ranks` of a call are indices into the hosted ranks (`MasterMesh.ranks()[1:]`); None: all of them."""

    def rendezvous(self) -> Rendezvous:
        """The mesh's groups, listening here (kept until `close`)."""
        ...

    def rows(self) -> RowsTo:
        ...

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None) -> Pending:
        """Start `MasterRank.method(*args)` on the ranks; returns at once."""
        ...

    def wait(self, pending: Pending) -> list:
        """Their results, in order; raises the first failure (a dead rank's first)."""
        ...

    def watch(self, replicas: Replicas, pending: Pending) -> None:
        """While master 0 waits in a sum with the ranks running `pending`, raise a failed one's own error."""
        ...

    def abort(self, pending: Pending, cause: BaseException) -> None:
        """Master 0's part failed with `cause` while the ranks ran `pending`: free the ranks waiting in a collective
        master 0 left, and raise a rank's own error if one failed (its death is what broke master 0's part)."""
        ...

    def pids(self) -> list[int]:
        ...

    def close(self) -> None:
        ...


class MasterRank:
    """Rank (`m`, `t`, `stage`) of the masters' mesh other than master 0, on `node`: a backbone replica (or shard,
    or pipeline stage) with brokers to the shared workers. Its methods are what `MasterGroup` starts on it; the pool
    hosts it (a Ray actor, or a thread of this process)."""

    def __init__(self, config: JobConfig, m: int, t: int, node: str, stage: int = 0):
        self.config, self.m, self.t, self.node, self.stage = config, m, t, node, stage
        self.mesh = MasterMesh.of(config)
        self.spec = master_spec(config)  # its device: the GPU Ray gave it with cluster.master_gpus: 1
        self.master: MasterModel | None = None
        self.replicas: Replicas = SINGLE  # its member of its TP index's data-parallel group
        self.migration: SequenceMigration | None = None
        self.loss_fn: LossFn = model_loss
        self.eval_loss_fn: LossFn = model_loss  # the objective's, over whole micro-batches (set in join)
        self.in_flight = config.training.overlap.in_flight(config)

    def pid(self) -> int:
        return os.getpid()

    def join(self, rendezvous: Rendezvous, rows: RowsTo, table: list, nodes: list[str], worker_nodes: list[str]
             ) -> None:
        """Join its groups, then build its master over `table` (`build_master_rank`), sharded over its TP group,
        reading its shards once per node group, and over the data-parallel mesh with FSDP2 if it has one."""
        groups = rendezvous.join(self.m, self.t, self.spec.device, self.stage)
        self.replicas = groups.replicas
        flat = self.mesh.flat(self.m, self.t, self.stage)
        self.master, _ = build_master_rank(
            self.spec, master_table(np.asarray(table), self.m), rows.transport(flat, self.node, self.spec.device),
            groups.tp, rank=flat, node=groups.node, dp_mesh=groups.dp_mesh,
            condenser=condenser_for(self.config.training.condensation),
            stage=(self.stage, groups.stages) if self.mesh.pp > 1 else None)
        self.migration = sequence_migration(self.config.masters, self.m, self.master, NodeMap.of(nodes, worker_nodes))
        self.loss_fn = master_loss(self.config, self.m, self.master, self.migration, self.replicas,
                                   self.spec.device)
        self.eval_loss_fn = whole_batch_loss(self.config, self.master, self.spec.device)

    def train_step(self, micro_batches: list[Batch], lr: float, max_grad_norm: float | None) -> dict:
        """This rank's share of one step; its `peer_step` record. The loss it returns is the whole batch's (summed
        over the data-parallel masters), the one master 0's `features.Condensation` gives its condenser after the
        step: this rank's condenser observes it too, so every rank condenses the next step at one threshold."""
        dispatcher = self.master.dispatcher
        before = dispatcher.traffic()
        condensed = dispatcher.condenser.counts() if dispatcher.condenser is not None else None
        loss = train_step(self.master, STEPPED_ELSEWHERE, [on_device(m, self.spec.device) for m in micro_batches],
                          lr, max_grad_norm, loss_fn=self.loss_fn, replicas=self.replicas, in_flight=self.in_flight)
        if dispatcher.condenser is not None:
            dispatcher.condenser.observe_loss(loss)
            condensed = dispatcher.condenser.counts() - condensed
        sums = take_sums(self.loss_fn) if self.t == 0 else None  # a TP group's ranks score the same pairs
        return peer_step(dispatcher.traffic() - before, self.migration, condensed, sums)

    def evaluate(self, batches: list[Batch]) -> float:
        """Master 0's evaluation, computed with it (`MasterGroup.evaluate`)."""
        return eval_loss(self.master, [on_device(b, self.spec.device) for b in batches], loss_fn=self.eval_loss_fn)

    def profile(self, batches: list[Batch]) -> dict[str, torch.Tensor] | None:
        """Master 0's routing profile's forwards, computed with it (`MasterGroup.profile`); a pipeline stage's
        counts of its own layers (`stage_profile`), which master 0 adds to its own."""
        if self.master.stage is not None:
            return stage_profile(self.master, batches).counts()
        profile_forwards(self.master.peft_model, batches)
        return None

    def routing_calls(self, batches: list[Batch]) -> Calls | None:
        """Master 0's routing pairs' forwards, computed with it (`MasterGroup.routing_pairs`); a pipeline stage's
        experts calls of its own layers, which master 0 adds to its own."""
        if self.master.stage is None:
            profile_forwards(self.master.peft_model, batches)
            return None
        return routing_calls(self.master.peft_model, batches, self.master.stage.blocks, self.master.stage.forwards)

    def master_compute(self, batches: list[Batch]) -> float:
        """Master 0's timed micro-batch, computed with it (`MasterGroup.master_compute_s`)."""
        return master_compute_seconds(self.master, on_device(batches[0], self.spec.device),
                                      own_share(self.config, self.m, self.master, self.spec.device))

    def shard_state(self, copy: bool, adapter: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards of the backbone LoRA and AdamW state (master 0 merges its TP group's, and its
        pipeline stages'); `adapter`: its LoRA as peft's adapter state (a pipeline stage's layers, for export)."""
        if adapter:
            return {k: v.detach().cpu() for k, v in backbone_state_of(self.master.peft_model).items()}
        return shard_state(self.master, copy)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_master_state(self.master, tensors)

    def frozen_bytes(self) -> int:
        return frozen_bytes(self.master)

    def load_condenser_state(self, state: dict | None) -> None:
        if self.master.dispatcher.condenser is not None:
            self.master.dispatcher.condenser.load_state(state)

    def rebind(self, table: list) -> None:
        self.master.dispatcher.rebind(master_table(np.asarray(table), self.m))

    def traffic(self) -> TrafficSnapshot:
        return self.master.dispatcher.traffic()

    def reset_traffic(self) -> None:
        self.master.dispatcher.reset_traffic()

    def close(self) -> None:
        if self.migration is not None:
            self.migration.detach()


class RankPool(Protocol):
    """What `MasterGroup` needs from a `WorkerPool`: master 0's node and where the other ranks run."""

    master_node: str

    def rank_hosts(self, mesh: MasterMesh, nodes: list[str]) -> RankHosts: ...


@dataclass
class MasterGroup:
    """Every master rank of a job (module docstring): master 0 (`leader`, this process's) and the hosted ranks."""

    config: JobConfig
    mesh: MasterMesh
    leader: MasterModel
    nodes: list[str]  # node of each data-parallel master, master 0's first
    worker_nodes: list[str]
    hosts: RankHosts | None = None
    replicas: Replicas = SINGLE  # master 0's member of the data-parallel masters' group
    migration: SequenceMigration | None = None  # master 0's, with masters.sequence_migration
    _steps: Pending = field(default_factory=list)  # the hosted ranks' train_step calls of the step in flight
    _leader_extras: dict = field(default_factory=dict)  # what master 0 was built with beyond its spec (a rebuild's)
    _loss: LossFn | None = None  # master 0's step loss (`loss_fn`), built once per (re)join
    _eval_loss: LossFn = model_loss  # master 0's evaluation loss: the objective's, over whole micro-batches

    @classmethod
    def start(cls, config: JobConfig, pool: RankPool, transport: Transport, worker_nodes: list[str], table,
              model: torch.nn.Module, *, latency=None, condenser=None) -> MasterGroup:
        """Master 0 built on `model` (read already unless it is a TP rank: it reads its shards once its group
        exists) with brokers over `transport`, and every other rank of the mesh started and built over `table`."""
        mesh, spec = MasterMesh.of(config), master_spec(config)
        nodes = [pool.master_node, *peer_nodes(worker_nodes, pool.master_node, mesh.dp - 1)]
        hosts = pool.rank_hosts(mesh, nodes) if mesh.size > 1 else None
        try:
            rendezvous = hosts.rendezvous() if hosts else None
            joins = hosts.call("join", rendezvous, hosts.rows(), np.asarray(table).tolist(), nodes,
                               worker_nodes) if hosts else []
            groups = rendezvous.join(0, 0, spec.device) if rendezvous else RankGroups()
            leader, _ = build_master_rank(spec, master_table(table), transport, groups.tp, node=groups.node,
                                          dp_mesh=groups.dp_mesh, model=model, read=config.cluster.master_tp == 1,
                                          latency=latency, condenser=condenser,
                                          stage=(0, groups.stages) if mesh.pp > 1 else None)
            if hosts:
                hosts.wait(joins)
        except BaseException:
            if hosts:
                hosts.close()
            raise
        group = cls(config, mesh, leader, nodes, worker_nodes, hosts, groups.replicas,
                    _leader_extras={"latency": latency, "condenser": condenser})
        group.migration = group._leader_migration()
        group._eval_loss = whole_batch_loss(config, leader, _device(leader))
        if mesh.tp > 1:
            leader.tp_states = group._follower_states
        if mesh.pp > 1:
            leader.stage_states = group._stage_states
        logger.info("%d data-parallel master(s) of %d pipeline stage(s) of %d tensor-parallel rank(s) on nodes %s",
                    mesh.dp, mesh.pp, mesh.tp, nodes)
        return group

    @property
    def num_masters(self) -> int:
        return self.mesh.dp

    def _leader_migration(self) -> SequenceMigration | None:
        if self.mesh.dp == 1:
            return None
        return sequence_migration(self.config.masters, 0, self.leader, NodeMap.of(self.nodes, self.worker_nodes))

    def restart_ranks(self, pool: RankPool, transport: Transport, worker_nodes: list[str], table) -> None:
        """New hosted ranks over new workers (recovery: the old ones may be stuck in the failed step's gradient
        sum, so they go first, and the caller restores a checkpoint after). Master 0 joins the new groups: it keeps
        its model, or, holding TP shards, whose group went with the ranks, it is built again the one way every rank
        is (`build_master_rank`) over `transport`: its state comes back with the checkpoint."""
        if self.hosts is None:
            return
        self.close()
        self.worker_nodes = worker_nodes
        self.hosts = pool.rank_hosts(self.mesh, self.nodes)
        rendezvous = self.hosts.rendezvous()
        joins = self.hosts.call("join", rendezvous, self.hosts.rows(), np.asarray(table).tolist(), self.nodes,
                                worker_nodes)
        device = _device(self.leader)
        if self.mesh.tp > 1 or self.config.masters.shard_frozen_backbone:
            if dist.is_initialized():  # the old mesh was this process's default group: one per process
                dist.destroy_process_group()
            groups = rendezvous.join(0, 0, device)
            leader, _ = build_master_rank(master_spec(self.config), master_table(np.asarray(table)), transport,
                                          groups.tp, node=groups.node, dp_mesh=groups.dp_mesh, **self._leader_extras)
            if self.mesh.tp > 1:
                leader.tp_states = self._follower_states
            self.leader = leader
        else:
            groups = rendezvous.join(0, 0, device)
            if groups.node is not None:  # the new ranks on its node read the backbone from it, as at the start
                shard_and_read(self.leader, master_spec(self.config), None, groups.node, holds_backbone=True)
            if self.leader.stage is not None:  # its stages are the new ranks
                self.leader.stage.rejoin(groups.stages)
        self.replicas = groups.replicas
        self.hosts.wait(joins)
        self.migration = self._leader_migration()
        self._loss, self._eval_loss = None, whole_batch_loss(self.config, self.leader, _device(self.leader))

    def loss_fn(self) -> LossFn:
        """Master 0's loss of a micro-batch: all of it, or its share among the data-parallel masters. Built once
        per (re)join: a preference objective's keeps its metrics' sums between steps (`take_sums`)."""
        if self._loss is None:
            self._loss = model_loss if self.mesh.dp == 1 and not self.config.training.preference.on else \
                master_loss(self.config, 0, self.leader, self.migration, self.replicas, _device(self.leader))
        return self._loss

    def step_sums(self, peer_steps: list[dict]) -> list[dict[str, float]] | None:
        """A preference objective's metric sums of the step just run (`preference.take_sums`): master 0's and each
        data-parallel master's (their `peer_step` records); None for SFT."""
        own = take_sums(self.loss_fn())
        return None if own is None else [own, *(p["preference"] for p in peer_steps if p["preference"] is not None)]

    def eval_sums(self) -> dict[str, float] | None:
        """A preference objective's metric sums over the evaluations since the last call; None for SFT."""
        return take_sums(self._eval_loss)

    # --- what the ranks do together ---------------------------------------------------------------

    def start_step(self, micro_batches: Sequence[Batch], lr: float, max_grad_norm: float | None) -> Wait:
        """Start every hosted rank's `train_step` on `micro_batches` (each takes its share); master 0 then runs
        its own, and calls the returned wait for their records (`peer_step`)."""
        if self.hosts is None:
            return lambda: []
        host = [{k: v.cpu() for k, v in m.items()} for m in micro_batches]
        pending = self._steps = self.hosts.call("train_step", host, lr, max_grad_norm)
        self.hosts.watch(self.leader.stage.group if self.leader.stage is not None else self.replicas, pending)
        return lambda: self.hosts.wait(pending)

    def abort(self, cause: BaseException, pending: Pending | None = None) -> None:
        """Master 0's step (or its part of `pending`, another joint call) failed with `cause`: free the hosted
        ranks from it (`RankHosts.abort`, which raises a dead rank's error instead) and close them."""
        if self.hosts is None:
            return
        try:
            self.hosts.abort(self._steps if pending is None else pending, cause)
        finally:
            self.close()

    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Master 0's evaluation loss over `batches`, the ranks that hold parts of its backbone computing it too."""
        batches = list(batches)
        with self._alongside("evaluate", batches):
            return eval_loss(self.leader, [on_device(b, _device(self.leader)) for b in batches],
                             loss_fn=self._eval_loss)

    def master_compute_s(self, micro_batch: Batch) -> float:
        """Seconds master 0 computes its share of `micro_batch`'s forward and backward, the experts stood in for
        (`step.master_compute_seconds`); the ranks that compute its forwards with it run the same."""
        with self._alongside("master_compute", [micro_batch]):
            return master_compute_seconds(self.leader, on_device(micro_batch, _device(self.leader)),
                                          own_share(self.config, 0, self.leader, _device(self.leader)))

    def profile(self, batches: Sequence[Batch], blocks: list[MoeBlock], source: str = "") -> AccessProfile:
        """Master 0's routing profile over `batches` (`locality.profile_model`), computed with the same ranks."""
        batches = list(batches)
        with self._alongside("profile", batches) as stages:
            if self.leader.stage is None:
                return profile_model(self.leader.peft_model, batches, blocks=blocks, source=source)
            recorder = stage_profile(self.leader, batches)
        for counts in stages:  # each stage's counts of its own layers
            recorder.add(counts)
        if int(recorder.tokens_L[0]) == 0:
            raise ValueError(f"no tokens profiled for {source!r}: the batches were empty or fully padded")
        return recorder.profile(source)

    def routing_pairs(self, batches: Sequence[Batch], blocks: list[MoeBlock]) -> RoutingPairs:
        """The popularity predictor's fitting data (`popularity.routing_pairs`) over `batches`, computed with the
        ranks that compute master 0's forwards; a pipeline's from every stage's own layers."""
        batches = list(batches)
        with self._alongside("routing_calls", batches) as stages:
            if self.leader.stage is None:
                return routing_pairs(self.leader.peft_model, batches, blocks)
            calls = routing_calls(self.leader.peft_model, batches, self.leader.stage.blocks,
                                  self.leader.stage.forwards)
        for other in stages:
            calls.update({layer: made for layer, made in other.items() if made})
        return pairs_of(calls, blocks)

    @contextlib.contextmanager
    def _alongside(self, method: str, batches: Sequence[Batch]) -> Iterator[list]:
        """The ranks that compute master 0's forwards with it (its TP ranks, its pipeline stages; every rank when
        FSDP2 shards the frozen backbone over the masters) run `method` on the same `batches` while master 0 runs
        its own; the list it yields holds their results once the block has ended."""
        mirrors = self._mirrors()
        pending = self.hosts.call(method, [{k: v.cpu() for k, v in b.items()} for b in batches],
                                  ranks=mirrors) if mirrors else []
        results: list = []
        try:
            yield results
        except BaseException as err:
            if pending:
                self.abort(err, pending)
            raise
        if pending:
            results.extend(self.hosts.wait(pending))

    def _mirrors(self) -> list[int]:
        if self.hosts is None:
            return []
        hosted = self.mesh.ranks()[1:]
        if self.config.masters.shard_frozen_backbone:
            return list(range(len(hosted)))
        return [i for i, (m, _, _) in enumerate(hosted) if m == 0]

    def _follower_states(self, copy: bool) -> list[dict[str, torch.Tensor]]:
        """Master 0's other TP ranks' shards (`master.master_state` merges them), in rank order."""
        return self.hosts.wait(self.hosts.call("shard_state", copy, ranks=list(range(self.mesh.tp - 1))))

    def _stage_states(self, copy: bool, adapter: bool = False) -> list[dict[str, torch.Tensor]]:
        """Master 0's other pipeline stages' tensors (`master.master_state` adds them to its own), or their adapter
        states (`adapter_io.export`)."""
        return self.hosts.wait(self.hosts.call("shard_state", copy, adapter, ranks=list(range(self.mesh.pp - 1))))

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Master 0's state (`master.master_state`: full tensors) into every hosted rank, each taking its share."""
        if self.hosts is not None:
            self.hosts.wait(self.hosts.call("load_state", tensors))

    def load_condenser_state(self, state: dict | None) -> None:
        """Master 0's condenser's losses (`Condenser.state`, a resume's or a recovery's) into every hosted rank's
        condenser, so all go on at master 0's threshold."""
        if self.hosts is not None:
            self.hosts.wait(self.hosts.call("load_condenser_state", state))

    def stage_bytes(self) -> list[int]:
        """Master 0's frozen backbone bytes (`frozen_bytes`) by pipeline stage, stage 0's first (one entry without
        stages)."""
        stages = self.hosts.call("frozen_bytes", ranks=list(range(self.mesh.pp - 1))) if self.mesh.pp > 1 else []
        return [frozen_bytes(self.leader), *(self.hosts.wait(stages) if stages else [])]

    def rebind(self, table) -> None:
        """Every hosted rank's brokers to a new table, or to its master's routes (after a migration)."""
        if self.hosts is not None:
            self.hosts.wait(self.hosts.call("rebind", np.asarray(table).tolist()))

    def traffic(self) -> list[TrafficSnapshot]:
        """Each hosted rank's traffic counts since it started, or since `reset_traffic`."""
        return self.hosts.wait(self.hosts.call("traffic")) if self.hosts is not None else []

    def reset_traffic(self) -> None:
        if self.hosts is not None:
            self.hosts.wait(self.hosts.call("reset_traffic"))

    def pids(self) -> list[int]:
        """Each hosted rank's process id (operators and tests signal them by it)."""
        return self.hosts.pids() if self.hosts is not None else []

    def close(self) -> None:
        """End the hosted ranks (master 0 stays with the runner)."""
        if self.migration is not None:
            self.migration.detach()
            self.migration = None
        if self.hosts is not None:
            self.hosts.close()


def master_spec(config: JobConfig) -> MasterSpec:
    """What every master rank of this job is built from (`master.build_master_rank`)."""
    return MasterSpec(
        model_dir=config.model.path, dtype=config.torch_dtype, lora=config.lora_spec, optim=config.training.optimizer,
        seed=config.training.seed, trust_remote_code=config.model.trust_remote_code,
        num_masters=config.master_processes, row_format=config.data_plane.row_format,
        device=master_device(bool(config.cluster.master_gpus)),
        activation_checkpointing=config.training.activation_checkpointing and config.training.method != "zo",
        overlap_shared_experts=config.training.overlap.overlaps_shared_experts(config),
        quantization=config.quantization_spec, streaming=config.masters.streaming.settings,
        pipeline_stages=config.masters.pipeline_stages,
    )


def _device(master: MasterModel) -> torch.device:
    return next(master.peft_model.parameters()).device


def frozen_bytes(master: MasterModel) -> int:
    """The bytes of a master's frozen backbone tensors (its parameters without gradients and its buffers), where
    they rest: on its device, or in host memory when streamed. A pipeline stage's: its layers', the embedding, norm
    and head."""
    model = master.peft_model
    tensors = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def stage_profile(master: MasterModel, batches: Sequence[Batch]) -> RoutingRecorder:
    """A pipeline stage's part of the routing profile (`locality.profile_model`'s forwards, through the stages):
    a recorder over every MoE block of the model, of which only the stage's own run here."""
    recorder = RoutingRecorder.for_model(master.peft_model, master.stage.blocks)
    with recorder:
        profile_forwards(master.peft_model, batches, on_batch=recorder.set_attention_mask, run=master.stage.forwards)
    return recorder


def peer_nodes(worker_nodes: Sequence[str], master_node: str, num_peers: int) -> list[str]:
    """Nodes of masters 1..M-1: the workers' nodes other than master 0's, in order; round robin over
    all of them (master 0's last) when there are more masters than nodes."""
    others = [n for n in dict.fromkeys(worker_nodes) if n != master_node]
    cycle = others + [master_node]
    return [cycle[i % len(cycle)] for i in range(num_peers)]


def condenser_for(condensation: CondensationSection) -> Condenser | None:
    """A master rank's own `Condenser` (token condensation, LOSSY) with `training.condensation.enabled`: one per
    dispatcher, each rank's condensing the rows it sends."""
    return Condenser(condensation) if condensation.enabled else None


def sequence_migration(masters: MastersSection, rank: int, master: MasterModel, nodes: NodeMap
                       ) -> SequenceMigration | None:
    """Master `rank`'s `SequenceMigration` (hooks on its model) with `masters.sequence_migration`, else None."""
    if not masters.sequence_migration:
        return None
    return SequenceMigration(master.peft_model, master.dispatcher, rank, masters.count, nodes,
                             masters.sequence_migration_candidates, masters.sequence_migration_combine)


def master_loss(config: JobConfig, rank: int, master: MasterModel, migration: SequenceMigration | None,
                exchanger: Exchanger, device: torch.device | str = "cpu") -> LossFn:
    """Master `rank`'s loss function of a step: its share of each micro-batch (of `masters.count`), its sequences
    moving among the masters (over `exchanger`, its member of the masters' group) when it has a `migration`; with a
    preference objective, its whole examples' share of the objective (`preference.objective_loss`)."""
    if config.training.preference.on:
        return objective_loss(config.training.preference, master.peft_model.config, rank, config.masters.count,
                              device, exchanger)
    share = master_share(rank, config.masters.count, master.peft_model, device)
    return share.loss if migration is None else migration.loss_fn(share, exchanger)


def own_share(config: JobConfig, rank: int, master: MasterModel, device: torch.device | str) -> LossFn:
    """Master `rank`'s loss of its own share of a micro-batch, its sequences staying where they are: the whole
    micro-batch for one master; a preference objective's loss of its whole examples (KTO's KL baseline over them
    alone: the other masters take no part in what this times)."""
    count = config.masters.count
    if config.training.preference.on:
        return objective_loss(config.training.preference, master.peft_model.config, rank, count, device)
    return model_loss if count == 1 else master_share(rank, count, master.peft_model, device).loss


def whole_batch_loss(config: JobConfig, master: MasterModel, device: torch.device | str) -> LossFn:
    """Master 0's evaluation loss: the objective's, of whole micro-batches."""
    if config.training.preference.on:
        return objective_loss(config.training.preference, master.peft_model.config, 0, 1, device)
    return model_loss


def master_share(rank: int, num_masters: int, model: torch.nn.Module, device: torch.device | str = "cpu"
                 ) -> ReplicaShare:
    """Master `rank`'s rows and loss share of every micro-batch (a router aux loss weighted as the
    expert-parallel ranks weight theirs)."""
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    return ReplicaShare(rank, num_masters, coef, device)


def peer_step(traffic: TrafficSnapshot, migration: SequenceMigration | None = None,
              condensed: CondenserCounts | None = None, preference: dict[str, float] | None = None) -> dict:
    """What master 0's step record takes from a hosted rank's step: its traffic (with the tokens it routed to each
    expert), its bytes by its own link tiers, what its sequence migration moved, what its condenser counted in
    the step (None: condensation off) and its preference metrics' sums (None: SFT, or a TP rank past the first)."""
    moves = (migration.take_stats() if migration is not None else SequenceMoveStats()).as_dict()
    return {"traffic": traffic, "bytes_by_tier": traffic.bytes_by_tier(), "sequence_moves": moves,
            "condensation": condensed, "preference": preference}
