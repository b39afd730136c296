"""JobRunner: one vela-ray run, from a JobConfig to `output.dir`, over any WorkerPool.

Stages of `JobRunner.run()`:
  1. resume point verified; nothing is written before (a refused resume leaves no trace);
  2. `pool.launch(table)`: the workers start loading the resumed placement's experts, or the
     sequential one's, while this process loads tokenizer, data split and backbone (`Backbone`);
     `config.json` written;
  3. `pool.start(table)`: waits until the workers are up;
  4. settle the placement: the profile (measured through the brokers, the checkpoint's own on
     an elastic resume, read from a file, or uniform), links, compute and capacities from the
     pool, `placement_problem` (pure), solve; move the experts that changed worker between the
     live workers (`vela_ray.runtime.migration`) and swap the brokers' table;
  5. start state (checkpoint or init adapter), then train: `train_step` per step (a ZO-SGD step,
     `vela_ray.training.zo`, with `training.method: zo`), a
     checkpoint every `checkpoint.every` steps and at the end (written and published by
     `vela_ray.runtime.checkpointing`, while training goes on with `checkpoint.asynchronous`),
     eval loss, metrics; every
     `placement.replan.every` steps a re-solve on the recent routing when it drifted, adopted
     only when its saving pays for the migration; a lost worker replaced in place and the run
     rolled back to the last checkpoint with `cluster.on_worker_loss: recover`;
  6. export the peft adapter, write `summary.json` (a `RunSummary`) and `report.html`.

The MasterActor (`actors.master`) is a thin shell that runs this over `RayWorkerPool`;
tests run it in one process over `InProcessPool`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from placement import (
    Placement, PlacementProblem, SharedLink, node_shared_links, replicate, sequential_table, solve, step_time,
)
from placement.io import load_profile
from vela_ray.config import JobConfig
from vela_ray.data.datasets import TokenizedDataset, batch_rows, micro_batches, sequential_batches
from vela_ray.data.locality import DriftTracker, RoutingRecorder, profile_model, total_variation
from vela_ray.errors import RunInterrupted, WorkerLostError
from vela_ray.model.condensation import Condenser
from vela_ray.model.loading import load_backbone, moe_layout
from vela_ray.model.modeling import MoeBlock, find_moe_blocks, top_k_of
from vela_ray.model.traffic import TrafficSnapshot
from vela_ray.observability.metrics import MetricsSink
from vela_ray.observability.report import write_report
from vela_ray.runtime.checkpointing import CheckpointWriter
from vela_ray.runtime.migration import (
    MigrationPlan, copies_of, estimated_seconds_per_expert, master_table, migration_record, replan,
    seconds_per_moved_expert,
)
from vela_ray.runtime.masters import PeerMasters, SoloMaster, master_loss, sequence_migration
from vela_ray.runtime.pool import HostedExperts, WorkerPool
from vela_ray.training import checkpoint
from vela_ray.training.optim import lr_at
from vela_ray.training.popularity import PopularityPredictor, routing_pairs
from vela_ray.training.sequence_migration import NodeMap, SequenceMigration
from vela_ray.training.step import (
    LossFn, MasterModel, build_master, eval_loss, export, import_adapter, load_master_state, master_state,
    model_loss, train_step,
)
from vela_ray.training.summary import (
    CondensationRecord, DataRecord, LinkRecord, MigrationRecord, PlacementRecord, RecoveryRecord, ReplanRecord,
    RunSummary, StepRecord, step_breakdown,
)
from vela_ray.training.zo import ZoTrainer

logger = logging.getLogger(__name__)

StopCheck = Callable[[], "str | None"]  # why the run should stop now, or None to go on


@dataclass
class Backbone:
    """What the master holds before any worker starts: tokenizer, data, the model and its MoE blocks."""

    tokenizer: PreTrainedTokenizerBase
    train_set: TokenizedDataset
    eval_set: TokenizedDataset
    model: nn.Module
    blocks: list[MoeBlock]

    @classmethod
    def load(cls, config: JobConfig) -> Backbone:
        torch.manual_seed(config.training.seed)  # the order of seeding and building matches peft's reference
        tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
        train_set, eval_set = config.data.build(tokenizer).split(config.training.eval_fraction, config.training.seed)
        model = load_backbone(config.model.path, config.torch_dtype, config.model.trust_remote_code)
        return cls(tokenizer, train_set, eval_set, model, find_moe_blocks(model))

    @property
    def shape(self) -> tuple[int, int]:
        """(MoE layers, experts per layer)."""
        return len(self.blocks), self.blocks[0].layout.num_experts


@dataclass
class RunState:
    """What the run has decided and measured so far; each stage fills its part."""

    plan: Placement | None = None
    problem: PlacementProblem | None = None
    version: int = 1  # of the placement; each adopted re-placement adds one
    placed_probs: np.ndarray | None = None  # [L, E] the profile the current placement was solved for
    links: list[LinkRecord] = field(default_factory=list)
    shared_links: list[SharedLink] = field(default_factory=list)  # NICs the links share, measured with them
    start_step: int = 0
    history: list[StepRecord] = field(default_factory=list)
    last_checkpoint: Path | None = None  # the newest published checkpoint of this run (or before it)
    tokens_routed_LE: np.ndarray | None = None
    routed_at_checkpoint: np.ndarray | None = None  # tokens_routed_LE when last_checkpoint was written
    timings_s: dict[str, float | list[float]] = field(default_factory=dict)
    migrations: list[MigrationRecord] = field(default_factory=list)
    replans: list[ReplanRecord] = field(default_factory=list)
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    migrating: bool = False  # between pool.migrate's start and its end
    tables: np.ndarray | None = None  # what the workers host: a table [L, E], or routes [M, L, E] with replicas
    predictor: tuple[dict, int] | None = None  # the tiers' fitted popularity predictor (state, top-k), re-sent
    # to workers that replace lost ones


def placement_problem(config: JobConfig, backbone: Backbone, probs_LE: np.ndarray | None, links: list[LinkRecord],
                      capacities: list[int], worker_nodes: list[str], master_node: str,
                      compute_seconds_per_row: list[float] | None = None,
                      shared_links: list[SharedLink] | None = None,
                      master_nodes: list[str] | None = None) -> PlacementProblem:
    """The placement problem of this job: its profile (uniform if None), tokens, row size, links (and what
    they share) and capacities.

    With data-parallel `master_nodes`, `links` and `shared_links` are master 0's (`master_node`'s)
    measurements: the NICs keep their measured bandwidths and carry every master's crossing rows,
    and every master's links are inferred from master 0's (`master_links`)."""
    num_layers, num_experts = backbone.shape
    top_k = top_k_of(backbone.model)
    if probs_LE is None:
        probs_LE = np.full((num_layers, num_experts), top_k / num_experts)
    bandwidths, per_master = [link.bandwidth_bytes_per_s for link in links], None
    if master_nodes:
        per_master = master_links(bandwidths, worker_nodes, master_node, master_nodes)
        bandwidths = np.min(per_master, axis=0).tolist()
        nics = {link.name.removeprefix("nic:"): link.bandwidth_bytes_per_s for link in shared_links or []}
        shared_links = node_shared_links(worker_nodes, master_nodes, nics) if nics else []
    return PlacementProblem(
        probs=probs_LE, top_k=top_k,
        tokens_per_step=config.training.batch_size * config.data.seq_len,
        hidden_size=backbone.blocks[0].layout.hidden_size,
        bits_per_element=torch.finfo(config.torch_dtype).bits,
        bandwidths=bandwidths, capacities=capacities, worker_nodes=worker_nodes, master_node=master_node,
        master_nodes=master_nodes, master_bandwidths=per_master, compute_seconds_per_row=compute_seconds_per_row,
        shared_links=shared_links or [],
    )


def master_links(bandwidths: list[float], worker_nodes: list[str], master_node: str,
                 master_nodes: list[str]) -> list[list[float]]:
    """[M][N] each master's link to each worker, from master 0's measured `bandwidths`: master 0's own; a
    master beside a worker gets the fastest link master 0 measured to a worker on its own node; one on
    another node the slowest cross-node link master 0 measured (each falls back to the worker's own)."""
    local = [b for b, node in zip(bandwidths, worker_nodes) if node == master_node]
    cross = [b for b, node in zip(bandwidths, worker_nodes) if node != master_node]

    def link(at: str, worker: int) -> float:
        if at == master_node:
            return bandwidths[worker]
        if at == worker_nodes[worker]:
            return max(local, default=bandwidths[worker])
        return min(cross, default=bandwidths[worker])

    return [[link(at, n) for n in range(len(worker_nodes))] for at in master_nodes]


def master_device(config: JobConfig) -> torch.device:
    """Where the master keeps the backbone, its LoRA and optimizer state: its GPU with
    `cluster.master_gpus: 1` (Ray gives the actor one), else the CPU."""
    if not config.cluster.master_gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("cluster.master_gpus is 1 but the master's process sees no CUDA device; set "
                         "cluster.master_gpus: 0 or run it where Ray gives it a GPU")
    return torch.device("cuda", torch.cuda.current_device())


def on_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


class JobRunner:
    """Runs one job over `pool`; see the module docstring for the stages."""

    def __init__(self, config: JobConfig, pool: WorkerPool, metrics: MetricsSink | None = None,
                 should_stop: StopCheck = lambda: None):
        self.config = config
        self.pool = pool
        self.metrics = metrics or MetricsSink()
        self.device = master_device(config)
        self.should_stop = should_stop
        self.out_dir = Path(config.output.dir)
        self.state = RunState()
        self.checkpoints = CheckpointWriter(config, self.state, pool)  # writes and publishes what the runner saves
        self.peers: PeerMasters = SoloMaster(pool.master_node)
        self.migration: SequenceMigration | None = None  # master 0's, with cluster.sequence_migration
        training = config.training  # `training.method: zo`: ZO-SGD steps instead of `train_step`
        self.zo = ZoTrainer(training.zo.eps, training.seed) if training.method == "zo" else None
        self.metrics.set_method(training.method)

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> RunSummary:
        started = time.perf_counter()
        resume = self._resume_point()
        table = self.state.tables = self._initial_table(resume)
        self.pool.launch(table)  # the workers load their experts while this process loads the backbone
        try:
            backbone = self.backbone = Backbone.load(self.config)
            if resume:
                checkpoint.check_compatible(resume["manifest"], self._checkpoint_meta(), resume["path"])
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(self.config.model_dump_json(indent=1))
            hosted = self.pool.start(table)
            hosted.workers.copies = copies_of(table)
            master = build_master(backbone.model, master_table(table), hosted.transport, self.config.lora_spec,
                                  self.config.training.optimizer, num_masters=self.config.cluster.num_masters,
                                  row_format=self.config.cluster.row_format)
            master.peft_model.to(self.device)  # after the brokers replaced the (unallocated) experts
            master.dispatcher.latency = self.metrics.latency
            master.dispatcher.condenser = self._condenser()
            self._start_peers(table, master, hosted)
            self._settle_placement(backbone, master, hosted, table, resume)
            self._fit_popularity_predictor(backbone, master, hosted)
            self._publish_placement(backbone)
            self.state.start_step = self._load_start_state(master, hosted, resume)
            self.state.timings_s["startup_s"] = time.perf_counter() - started  # until the first step
            hosted = self._train(backbone, master, hosted)
            export(master, hosted.workers, self.out_dir / "adapter")
            summary = self._summary(master, hosted)
            summary.report = str((self.out_dir / "report.html").resolve())
            summary.write(self.out_dir)  # the report reads it back
            write_report(self.out_dir)
            return summary
        finally:
            self.peers.close()
            self.pool.close()

    # --- resume ----------------------------------------------------------------------------

    def _resume_point(self) -> dict | None:
        """The checkpoint to continue from (path, manifest, trainer state); refused if it does not match."""
        spec = self.config.checkpoint.resume
        if spec is None:
            return None
        path = checkpoint.resolve(spec, self.config.checkpoint_root)
        manifest = checkpoint.verify(path)  # full checksums
        trainer = json.loads((path / "trainer.json").read_text())
        checkpoint.check_compatible(manifest, {"lora_r": self.config.lora.r, "lora_alpha": self.config.lora.alpha},
                                    path)
        if manifest["step"] >= self.config.training.steps:
            raise ValueError(f"{path}: the run is complete at step {manifest['step']} (training.steps = "
                             f"{self.config.training.steps}); raise training.steps to train further")
        logger.info("resuming from %s (step %d of %d)", path, manifest["step"], self.config.training.steps)
        return {"path": path, "manifest": manifest, "trainer": trainer}

    def _checkpoint_meta(self) -> dict:
        backbone = self.backbone
        layout = backbone.blocks[0].layout
        return {"model_type": backbone.model.config.model_type, "moe_layers": len(backbone.blocks),
                "experts": layout.num_experts, "hidden_size": layout.hidden_size,
                "lora_r": self.config.lora.r, "lora_alpha": self.config.lora.alpha}

    def _saved_placement(self, resume: dict | None) -> Placement | None:
        """A resumed run keeps its placement when the worker count is unchanged."""
        saved = resume["trainer"]["placement"] if resume else None
        if saved and saved["num_workers"] == self.config.cluster.num_workers:
            return Placement.model_validate(saved)
        return None

    def _initial_table(self, resume: dict | None) -> np.ndarray:
        saved = self._saved_placement(resume)
        if saved:
            return saved.tables()
        model = self.config.model
        return sequential_table(*moe_layout(model.path, model.trust_remote_code), self.config.cluster.num_workers)

    def _load_start_state(self, master: MasterModel, hosted: HostedExperts, resume: dict | None) -> int:
        """Adapters and optimizer state to start from; returns the first step to run."""
        if resume:
            return self._restore(master, hosted, resume["path"])
        if self.config.lora.init_adapter:
            import_adapter(master, hosted.workers, self.config.lora.init_adapter)
        self.peers.load_state(master_state(master))
        return 0

    def _restore(self, master: MasterModel, hosted: HostedExperts, path: Path) -> int:
        """Every adapter, AdamW state and the RNG as checkpoint `path` saved them; returns its step."""
        hosted.workers.load_checkpoint(str(path))
        tensors = checkpoint.read_tensors(path / "backbone.safetensors")
        load_master_state(master, tensors)
        self.peers.load_state(master_state(master))
        if master.dispatcher.condenser is not None:
            trainer = json.loads((path / "trainer.json").read_text())
            master.dispatcher.condenser.load_state(trainer.get("condenser"))
        checkpoint.restore_rng_state(tensors)
        return int(checkpoint.verify(path, checksums=False)["step"])

    # --- placement -------------------------------------------------------------------------

    def _settle_placement(self, backbone: Backbone, master: MasterModel, hosted: HostedExperts, table: np.ndarray,
                          resume: dict | None) -> None:
        """Profile, measure and solve (or keep a resumed run's placement); move the experts that changed worker."""
        start = time.perf_counter()
        saved = self._saved_placement(resume)
        self.state.placed_probs = self._saved_profile(resume)
        if saved:
            self.state.plan = saved
        else:
            self.state.plan = self._place(backbone, master, hosted, resume)
            self.state.placed_probs = self.state.problem.probs
        if not np.array_equal(self.state.plan.tables(), table):
            self._migrate(master, hosted, self.state.plan.tables(),
                          step=int(resume["manifest"]["step"]) if resume else 0, reason="start")
        self.state.timings_s["placement_s"] = time.perf_counter() - start
        self._write_workers(hosted)
        self.state.plan.to_json(self.out_dir / "placement.json")
        logger.info("placement %s: %s experts per worker", self.state.plan.solver,
                    np.bincount(self.state.plan.as_array().ravel(), minlength=self.config.cluster.num_workers).tolist())

    def _write_workers(self, hosted: HostedExperts) -> None:
        """`workers.json`: where each worker's process runs (operators and tests signal them by pid)."""
        (self.out_dir / "workers.json").write_text(json.dumps(
            {"pids": self.pool.pids(), "nodes": hosted.node_ids, "master_pid": os.getpid(),
             "master_pids": [os.getpid(), *self.peers.pids()]}))

    def _place(self, backbone: Backbone, master: MasterModel, hosted: HostedExperts, resume: dict | None) -> Placement:
        cfg = self.config
        problem = self.state.problem = self._problem(backbone, hosted, self._profile(backbone, master, resume))
        if cfg.placement.solver == "file":
            return Placement.from_json(cfg.placement.file, problem)
        return self._solve(problem, cfg.placement.solver)

    def _solve(self, problem: PlacementProblem, solver: str) -> Placement:
        """`solver`'s placement of `problem`; with `placement.replicas` and several masters, copies of experts
        added into spare capacity where the cost model says they pay (`placement.replicate`)."""
        plan = solve(problem, solver, seed=self.config.placement.seed)
        logger.info("placement solved (%s): expected %.3g s/step, LP bound %s", plan.solver,
                    plan.expected_step_time, plan.lower_bound)
        if not (self.config.placement.replicas and problem.num_masters > 1):
            return plan
        routes = replicate(problem, plan.as_array(), seed=self.config.placement.seed)
        copies = sum(len(workers) - 1 for workers in copies_of(routes).values())
        logger.info("replicas: %d copies of experts added, expected %.3g s/step", copies, step_time(problem, routes))
        return plan.model_copy(update={"routes": routes.tolist(), "expected_step_time": step_time(problem, routes),
                                       "solver": f"{plan.solver}+replicas"})

    def _problem(self, backbone: Backbone, hosted: HostedExperts, probs: np.ndarray | None) -> PlacementProblem:
        """This job's placement problem for profile `probs`; links, compute and capacities measured once."""
        cfg = self.config
        if not self.state.links:
            self.state.links, self.state.shared_links = self.pool.measure_links(
                shared=cfg.placement.shared_links == "measure")
        compute = self.state.problem.compute_seconds_per_row if self.state.problem else None
        if compute is None and cfg.placement.cost_model == "communication+compute":
            rows = max(1, cfg.training.batch_size * cfg.data.seq_len * top_k_of(backbone.model)
                       // cfg.cluster.num_workers)  # rows a worker gets per layer, on average
            compute = self.pool.measure_compute(rows)
        capacities = self.state.problem.capacities if self.state.problem else self._capacities(backbone)
        return placement_problem(cfg, backbone, probs, self.state.links, capacities, hosted.node_ids,
                                 self.pool.master_node, compute, self.state.shared_links,
                                 master_nodes=self.peers.nodes if self.peers.num_masters > 1 else None)

    @staticmethod
    def _saved_profile(resume: dict | None) -> np.ndarray | None:
        saved = resume["trainer"].get("profile") if resume else None
        return None if saved is None else np.asarray(saved, dtype=np.float64)

    def _profile(self, backbone: Backbone, master: MasterModel, resume: dict | None) -> np.ndarray | None:
        """P [L, E] to place by: measured through the brokers, read from a file, or None (uniform).
        A resume with another worker count re-places by the profile its checkpoint was placed for."""
        spec = self.config.placement.profile
        saved = self._saved_profile(resume)
        if saved is not None:
            logger.info("re-placing for %d workers by the checkpoint's own profile", self.config.cluster.num_workers)
            return saved
        if spec == "uniform":
            return None
        if spec != "measure":
            return load_profile(Path(spec))[0]
        batches = sequential_batches(backbone.train_set, self.config.training.batch_size,
                                     max_batches=self.config.placement.profile_batches, token_mask=True)
        profile = profile_model(master.peft_model, batches, blocks=backbone.blocks, source=str(self.config.data.path))
        profile.save(self.out_dir / "profile.json", npy_path=self.out_dir / "profile.npy")
        return profile.probs_array()

    def _fit_popularity_predictor(self, backbone: Backbone, master: MasterModel, hosted: HostedExperts) -> None:
        """With `cluster.expert_tiers`: fit APTMoE's popularity predictor on the routing of the profile batches
        (inference through the brokers) and send it to every worker (`vela_ray.training.popularity`)."""
        if not self.config.cluster.expert_tiers.enabled or len(backbone.blocks) < 2:
            return
        batches = sequential_batches(backbone.train_set, self.config.training.batch_size,
                                     max_batches=self.config.placement.profile_batches, token_mask=True)
        pairs = routing_pairs(master.peft_model, batches, backbone.blocks)
        predictor = PopularityPredictor.from_model(backbone.model, backbone.blocks)
        predictor.fit(pairs)
        logger.info("popularity predictor: top-k overlap per layer on its fitting batches %s",
                    {layer: round(overlap, 3) for layer, overlap in predictor.top_k_overlap(pairs).items()})
        self.state.predictor = (predictor.state_dict(), predictor.top_k)
        hosted.workers.set_predictor(*self.state.predictor)

    def _capacities(self, backbone: Backbone) -> list[int]:
        total = int(np.prod(backbone.shape))
        cap = self.config.placement.capacity
        capacities = [min(m, cap or total) for m in self.pool.capacities()]
        if sum(capacities) < total:
            raise ValueError(
                f"workers hold {sum(capacities)} experts ({capacities}) but the model has {total}: "
                f"need {total - sum(capacities)} more expert slots (add workers or raise placement.capacity)")
        return capacities

    def _publish_placement(self, backbone: Backbone) -> None:
        """Placement metrics, and the drift tracker against the profile it was solved for."""
        problem, plan, probs = self.state.problem, self.state.plan, self.state.placed_probs
        record = PlacementRecord.of(plan, problem, self.config.placement.cost_model)
        self.metrics.set_placement(self.state.version, plan.expert_to_worker, self.config.cluster.num_workers,
                                   probs_LE=probs, expected_comm_time_s=record.expected_comm_time_s)
        self.drift = None if probs is None else DriftTracker(probs, top_k_of(backbone.model))

    def _migrate(self, master: MasterModel, hosted: HostedExperts, table: np.ndarray, *, step: int, reason: str,
                 expected_saving_s: float | None = None, expected_cost_s: float | None = None) -> None:
        """Move the experts whose worker changes to `table` (or routes) between the live workers; swap
        every master's brokers' table."""
        plan = MigrationPlan.between(self.state.tables, table)
        start = time.perf_counter()
        self.state.migrating = True  # a worker lost now leaves the others between two tables
        stats = self.pool.migrate(table)
        self.state.migrating = False
        self.state.tables = np.asarray(table)
        hosted.workers.copies = copies_of(table)
        master.dispatcher.rebind(master_table(table))
        self.peers.rebind(table)
        if reason != "start":
            self.state.version += 1
        record = migration_record(plan, stats, time.perf_counter() - start, step=step, reason=reason,
                                  version=self.state.version, expected_saving_s=expected_saving_s,
                                  expected_cost_s=expected_cost_s)
        self.state.migrations.append(record)
        logger.info("placement v%d (%s): moved %d experts between live workers in %.2f s (%.3g MB of LoRA/AdamW "
                    "state, %.3g MB of weights read)", record.version, reason, record.moved, record.seconds,
                    record.state_bytes / 1e6, record.frozen_bytes / 1e6)

    def _maybe_replan(self, backbone: Backbone, master: MasterModel, hosted: HostedExperts, done: int) -> None:
        """Every `replan.every` steps: when the recent routing drifted from the placed profile, re-solve on
        it and move the experts if the expected saving over the horizon beats the migration's cost."""
        cfg, steps = self.config.placement.replan, self.config.training.steps
        if not cfg.every or done % cfg.every or done >= steps or self.drift is None \
                or self.drift.num_steps < cfg.every:
            return
        top_k = top_k_of(backbone.model)
        recent = self.drift.probs(window=cfg.every)[-1]
        drift = float(total_variation(recent, self.drift.initial_LE, top_k).mean())
        if drift < cfg.drift_threshold:
            return
        problem = self._problem(backbone, hosted, recent)
        solver = "improved" if self.config.placement.solver == "file" else self.config.placement.solver
        candidate = self._solve(problem, solver)
        decision = replan(problem, self.state.tables, candidate.tables(),
                          cfg.horizon_steps or steps - done, self._seconds_per_expert())
        self.state.replans.append(ReplanRecord(
            step=done, drift=drift, moved=decision.moved, current_step_s=decision.current_step_s,
            candidate_step_s=decision.candidate_step_s, horizon_steps=decision.horizon_steps,
            expected_saving_s=decision.expected_saving_s, expected_cost_s=decision.expected_cost_s,
            adopted=decision.adopt))
        logger.info("step %d: routing drifted %.3f from the placed profile; a re-placement would move %d experts "
                    "and save %.3g s over %d steps for %.3g s of migration: %s", done, drift, decision.moved,
                    decision.expected_saving_s, decision.horizon_steps, decision.expected_cost_s,
                    "adopted" if decision.adopt else "kept the placement")
        if not decision.adopt:
            return
        self._migrate(master, hosted, candidate.tables(), step=done, reason="drift",
                      expected_saving_s=decision.expected_saving_s, expected_cost_s=decision.expected_cost_s)
        self.state.plan, self.state.problem, self.state.placed_probs = candidate, problem, recent
        self._publish_placement(backbone)
        candidate.to_json(self.out_dir / "placement.json")

    def _seconds_per_expert(self) -> float:
        """A migration's expected seconds per moved expert: as measured in this run, but never less than
        the link model's (all of an expert's bytes over the slowest link: emulated links are not timed)."""
        slowest = min(link.bandwidth_bytes_per_s for link in self.state.links)
        modelled = estimated_seconds_per_expert(self.pool.bytes_per_expert(), slowest)
        return max(modelled, seconds_per_moved_expert(self.state.migrations) or 0.0)

    # --- training --------------------------------------------------------------------------

    def _train(self, backbone: Backbone, master: MasterModel, hosted: HostedExperts) -> HostedExperts:
        """The training loop; returns the workers it ended with (replacements included)."""
        cfg = self.config.training
        master.dispatcher.counter.reset()
        self.state.last_checkpoint = checkpoint.latest(self.config.checkpoint_root)
        start = self.state.start_step
        if self.config.cluster.on_worker_loss == "recover" and (start == 0 or not self._checkpointed(start)):
            self._save_checkpoint(master, hosted, start)  # to roll back to
            self.checkpoints.settle()  # published before any step: there always is one
        received_before, compute_before = hosted.workers.received(), hosted.workers.compute_seconds()
        routing = RoutingRecorder(backbone.blocks, top_k_of(backbone.model), record_confidence=False).attach()
        train_start = time.perf_counter()
        step = self.state.start_step
        try:
            while step < cfg.steps:
                try:
                    self._guarded(hosted, step, lambda: self._step(backbone, master, hosted, routing, step))
                    self._stop_if_asked(master, hosted, step + 1)
                    self._guarded(hosted, step, lambda: self._maybe_replan(backbone, master, hosted, step + 1))
                except WorkerLostError as lost:
                    hosted, step = self._recover(lost, master, step)
                    received_before, compute_before = hosted.workers.received(), hosted.workers.compute_seconds()
                    routing.take_counts()  # the failed step's partial routing
                    continue
                step += 1
        finally:
            routing.detach()
            self.checkpoints.settle(failing=True)  # a failing run leaves none in flight (the last step's is settled)
        self.state.timings_s["train_s"] = time.perf_counter() - train_start
        self._settle_zo(master, hosted)  # eval and export read the adapters
        history = self.state.history
        if history and history[-1].eval_loss is None:
            history[-1].eval_loss = self._eval(backbone, master)
        self.received = [a - b for a, b in zip(hosted.workers.received(), received_before)]
        self.state.timings_s["worker_compute_s"] = [
            a - b for a, b in zip(hosted.workers.compute_seconds(), compute_before)]
        return hosted

    def _checkpointed(self, step: int) -> bool:
        last = self.state.last_checkpoint
        return last is not None and last.name == f"step-{step:06d}"

    def _recover(self, lost: WorkerLostError, master: MasterModel, step: int) -> tuple[HostedExperts, int]:
        """`on_worker_loss: recover`: new workers in place of the lost ones, everyone back to the last
        checkpoint; returns the new workers and the step to go on from (the steps since are replayed).
        Re-raises `lost` when recovery is off, used up, or has no checkpoint of this run to go back to."""
        self.checkpoints.settle(failing=True)  # the one in flight, once published, is the one to go back to
        cluster, last = self.config.cluster, self.state.last_checkpoint
        if cluster.on_worker_loss != "recover" or len(self.state.recoveries) >= cluster.max_recoveries \
                or last is None:
            raise lost
        start = time.perf_counter()
        logger.warning("expert worker(s) %s lost during step %d: replacing them and rolling back to %s",
                       lost.workers, step + 1, last)
        # Lost mid-migration, the survivors host parts of two tables: start all of them afresh on the old one.
        replaced = list(range(self.config.cluster.num_workers)) if self.state.migrating else lost.workers
        self.state.migrating = False
        try:
            hosted = self.pool.replace(replaced)
        except Exception as exc:  # e.g. the lost node's resources never came back
            raise WorkerLostError(lost.workers, f"{lost.message}. Replacing them failed: {exc}") from None
        hosted.workers.copies = copies_of(self.state.tables)
        if self.state.predictor is not None:  # the new workers' tiers forecast as the old ones did
            hosted.workers.set_predictor(*self.state.predictor)
        master.dispatcher.rebind(master.dispatcher.expert_to_worker, hosted.transport)
        self.peers.close()  # they may be stuck in the failed step's gradient sum: start them afresh
        self._start_peers(self.state.tables, master, hosted)
        self._write_workers(hosted)
        master.optimizer.zero_grad(set_to_none=False)  # the failed step's partial gradients
        hosted.workers.zero_grad()  # ... and the survivors' (their saved graphs go with them)
        done = self._restore(master, hosted, last)
        self.state.history = [h for h in self.state.history if h.step <= done]
        self.state.tokens_routed_LE = self.state.routed_at_checkpoint
        self.state.recoveries.append(RecoveryRecord(step=step + 1, workers=lost.workers, checkpoint_step=done,
                                                    seconds=time.perf_counter() - start,
                                                    restored_at=time.time()))
        logger.warning("recovered in %.2f s; replaying steps %d..%d", self.state.recoveries[-1].seconds,
                       done + 1, step + 1)
        return hosted, done

    def _guarded(self, hosted: HostedExperts, step: int, work: Callable[[], None]) -> None:
        """Run `work`; a lost worker becomes a WorkerLostError naming it and the checkpoint to resume from."""
        try:
            work()
        except Exception as err:
            dead = self.pool.lost_workers(err)
            if dead is None:
                raise
            self.checkpoints.settle(failing=True)  # the hint names the newest checkpoint that got published
            # every worker answers: the actor that died was one of the other data-parallel masters
            who = f"ExpertManager worker(s) {dead}" if dead else "a data-parallel master (MasterReplica)"
            raise WorkerLostError(dead, f"{who} died during step {step + 1}; training "
                                        f"stopped and its in-memory state since the last checkpoint is discarded; "
                                        f"{self.checkpoints.resume_hint()}. Cause: {err}") from None

    def _step(self, backbone: Backbone, master: MasterModel, hosted: HostedExperts, routing: RoutingRecorder,
              step: int) -> None:
        cfg = self.config.training
        counter = master.dispatcher.counter
        rows = batch_rows(backbone.train_set, step, cfg.batch_size, cfg.seed)
        micro = micro_batches(backbone.train_set.rows(rows), cfg.micro_batch_size or cfg.batch_size)
        tokens = int(backbone.train_set.attention_mask[rows].sum())  # padding excluded
        before, waited_before = counter.snapshot(), sum(master.dispatcher.round_trip_s.values())
        reduced_before = getattr(self.peers.replicas, "grad_bytes", 0)  # masters' backbone all-reduce
        lr = lr_at(cfg.optimizer, step, cfg.steps)
        start = time.perf_counter()
        peers_done = self.peers.start_step(micro, lr, cfg.optimizer.max_grad_norm)
        try:
            if self.zo is not None:
                loss = self.zo.step(master, hosted.workers, [on_device(m, self.device) for m in micro], lr, step).loss
            else:
                loss = train_step(master, hosted.workers, [on_device(m, self.device) for m in micro], lr,
                                  cfg.optimizer.max_grad_norm, loss_fn=self._loss_fn(master),
                                  replicas=self.peers.replicas)
        except BaseException:
            self.peers.abort()
            raise
        peer_traffic = peers_done()
        step_time = time.perf_counter() - start
        if master.dispatcher.condenser is not None:
            master.dispatcher.condenser.observe_loss(loss)  # the adaptive threshold follows the loss
        own: TrafficSnapshot = counter.snapshot() - before
        traffic = [own, *(p["traffic"] for p in peer_traffic)]  # each master's rows, by its own link tiers
        delta = sum(traffic[1:], own)  # every master's rows (tiers: master 0's)
        counts_LE = np.sum([routing.take_counts().numpy(), *[p["routed_LE"] for p in peer_traffic]], axis=0)
        routed = self.state.tokens_routed_LE
        self.state.tokens_routed_LE = counts_LE if routed is None else routed + counts_LE  # training steps only
        record = StepRecord(step=step + 1, loss=loss, step_time_s=step_time, tokens=tokens,
                            expert_round_trip_s=sum(master.dispatcher.round_trip_s.values()) - waited_before,
                            bytes_by_tier=_added([own.bytes_by_tier(), *[p["bytes_by_tier"] for p in peer_traffic]]),
                            bytes_by_worker=delta.bytes_by_worker(),
                            allreduce_bytes=getattr(self.peers.replicas, "grad_bytes", 0) - reduced_before,
                            sequence_moves=self._sequence_moves(peer_traffic))
        self.metrics.record_step(step + 1, loss, step_time, tokens=tokens,
                                 traffic_delta=traffic, expert_counts_LE=counts_LE,
                                 drift_L=self.drift.record_step(counts_LE) if self.drift else None)
        if self.config.cluster.expert_tiers.enabled:
            self.metrics.record_tiers(hosted.workers.tier_stats())
        if record.sequence_moves is not None:
            self.metrics.record_sequence_moves(record.sequence_moves)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            self._settle_zo(master, hosted)
            record.eval_loss = self._eval(backbone, master)
            routing.take_counts()  # the eval pass's routing is not training traffic
        self.state.history.append(record)
        every = self.config.checkpoint.every
        if step + 1 == cfg.steps or (every and (step + 1) % every == 0):
            self._save_checkpoint(master, hosted, step + 1)
        if step + 1 == cfg.steps:
            self.checkpoints.settle()  # the run's last checkpoint is published before it ends
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            logger.info("step %d/%d loss %.4f%s (%.2f s)", step + 1, cfg.steps, loss,
                        "" if record.eval_loss is None else f" eval {record.eval_loss:.4f}", step_time)

    def _settle_zo(self, master: MasterModel, hosted: HostedExperts) -> None:
        """`training.method: zo`: apply the last step's update, fused into the next step's first pass until
        now, so that whatever reads the adapters next sees them unperturbed (`ZoTrainer.settle`)."""
        if self.zo is not None:
            self.zo.settle(master, hosted.workers)

    def _condenser(self) -> Condenser | None:
        """Token condensation (LOSSY) with `training.condensation.enabled`; it lives in master 0's brokers only."""
        cfg = self.config.training.condensation
        return Condenser(cfg) if cfg.enabled else None

    def _start_peers(self, table: np.ndarray, master: MasterModel, hosted: HostedExperts) -> None:
        """Masters 1..M-1 (none for one master), and master 0's sequence migration among them all."""
        self.peers = self.pool.start_peers(table)
        if self.migration is not None:
            self.migration.detach()
        self.migration = None if self.peers.num_masters == 1 else sequence_migration(
            self.config, 0, master, NodeMap.of(self.peers.nodes, hosted.node_ids))

    def _loss_fn(self, master: MasterModel) -> LossFn:
        """Master 0's loss of a micro-batch: all of it, or its share among data-parallel masters."""
        if self.peers.num_masters == 1:
            return model_loss
        return master_loss(self.config, 0, master, self.migration, self.peers.replicas, self.device)

    def _sequence_moves(self, peer_steps: list[dict]) -> dict[str, int] | None:
        """This step's sequence migration, summed over the masters; None when it is off."""
        if self.migration is None:
            return None
        return _added([self.migration.take_stats().as_dict(), *(p["sequence_moves"] for p in peer_steps)])

    def _stop_if_asked(self, master: MasterModel, hosted: HostedExperts, done: int) -> None:
        """Between steps: stop cleanly when asked (Ctrl-C, SIGTERM, the driver gone), with a checkpoint."""
        reason = self.should_stop()
        if reason is None or done == self.config.training.steps:
            return
        self.checkpoints.settle()  # the one in flight may be of step `done`
        if not self._checkpointed(done):
            self._save_checkpoint(master, hosted, done)
            self.checkpoints.settle()
        raise RunInterrupted(done, str(self.state.last_checkpoint), reason)

    def _eval(self, backbone: Backbone, master: MasterModel) -> float:
        cfg = self.config.training
        batches = sequential_batches(backbone.eval_set, cfg.batch_size, cfg.eval_batches)
        return eval_loss(master, [on_device(batch, self.device) for batch in batches])

    def _save_checkpoint(self, master: MasterModel, hosted: HostedExperts, step: int) -> None:
        """Checkpoint of `step` (`CheckpointWriter.save`), of unperturbed adapters; with
        `checkpoint.asynchronous` it becomes `state.last_checkpoint` at the next `checkpoints.settle()`."""
        self.checkpoints.settle()  # at most one in flight
        self._settle_zo(master, hosted)  # a checkpoint holds unperturbed adapters
        self.checkpoints.save(step, hosted.workers, self._checkpoint_meta(),
                              lambda copy: self._checkpoint_contents(master, step, copy))

    def _checkpoint_contents(self, master: MasterModel, step: int,
                             copy: bool) -> tuple[dict[str, torch.Tensor], dict]:
        """What the master writes into the checkpoint of `step`: its LoRA, AdamW state and the torch RNGs
        (copied with `copy`: an asynchronous checkpoint writes them while training changes the originals),
        and `trainer.json` (where the run stands, its placement, config, profile and condenser)."""
        cfg = self.config
        tensors = master_state(master, copy=copy)
        tensors.update(checkpoint.rng_state())  # CPU, and CUDA's when this process used it
        trainer = {
            "step": step, "data_position": step, "total_steps": cfg.training.steps,
            "lr_next": lr_at(cfg.training.optimizer, step, cfg.training.steps),
            "placement": self.state.plan.model_dump(), "config": json.loads(cfg.model_dump_json()),
            "profile": None if self.state.placed_probs is None else np.asarray(self.state.placed_probs).tolist(),
            "condenser": master.dispatcher.condenser.state() if master.dispatcher.condenser is not None else None,
        }
        return tensors, trainer

    # --- summary ---------------------------------------------------------------------------

    def _summary(self, master: MasterModel, hosted: HostedExperts) -> RunSummary:
        state = self.state
        traffics = [master.dispatcher.counter.snapshot(), *self.peers.traffic()]
        history = state.history
        routed = state.tokens_routed_LE
        return RunSummary(
            mode="vela", method=self.config.training.method, row_format=self.config.cluster.row_format,
            data_plane=hosted.transport.describe(), family_check=self.config.family_check,
            steps=len(history), losses=[h.loss for h in history],
            eval_loss=history[-1].eval_loss if history else None,
            median_step_time_s=float(np.median([h.step_time_s for h in history])) if history else 0.0,
            history=history, step_breakdown_s=step_breakdown(history, state.timings_s.get("worker_compute_s", [])),
            traffic_bytes_by_tier=_added([t.bytes_by_tier() for t in traffics]),
            traffic_bytes_by_worker=np.sum([t.bytes_by_worker() for t in traffics], axis=0).tolist(),
            sent_bytes_by_worker=np.sum([t.bytes_by_worker(("dispatch", "grad_dispatch")) for t in traffics],
                                        axis=0).tolist(),
            worker_received_bytes=self.received, tokens_routed=[] if routed is None else routed.astype(int).tolist(),
            worker_tiers=list(traffics[0].worker_tiers), worker_nodes=hosted.node_ids, master_node=self.pool.master_node,
            master_nodes=self.peers.nodes,
            allreduce_bytes_per_step=history[-1].allreduce_bytes if self.peers.num_masters > 1 and history else None,
            sequence_moves=None if self.migration is None else _added([h.sequence_moves or {} for h in history]),
            placement=PlacementRecord.of(state.plan, state.problem, self.config.placement.cost_model),
            links=state.links, timings_s=state.timings_s,
            adapter_dir=str((self.out_dir / "adapter").resolve()),
            checkpoint=None if state.last_checkpoint is None else str(state.last_checkpoint),
            data=DataRecord.of(self.config.data, self.backbone.train_set),
            migrations=state.migrations, replans=state.replans, recoveries=state.recoveries,
            condensation=CondensationRecord.of(master.dispatcher.condenser),
            expert_tiers=[stats for stats in hosted.workers.tier_stats() if stats is not None],
        )


def _added(dicts: list[dict[str, int]]) -> dict[str, int]:
    """Key-wise sum (masters' traffic by link tier: each master bins by its own tiers)."""
    total: dict[str, int] = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total
