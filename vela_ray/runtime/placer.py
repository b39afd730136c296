"""Where the experts live during a run: the placement problem of a job, its solve, the moves between
live workers, and re-placement when the routing drifts (`Placer`).

At the start the placer measures what the placement needs (the profile through the brokers, links,
compute, capacities) and what the step prediction adds (each link's latency, the master's compute: see
`placement.cost.predict_step`), builds the problem (`placement_problem`, pure) and solves it, or keeps a
resumed run's placement; the experts that change worker move between the live workers
(`vela_ray.runtime.migration`). Every `placement.replan.every` steps it re-solves on the recent
routing when it drifted, and adopts the candidate only when its saving pays for the migration.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from placement import (
    Placement, PlacementProblem, SharedLink, TrainingStep, node_shared_links, replicate, sequential_table, solve,
    step_time,
)
from placement.io import load_profile
from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_rows, micro_batches, sequential_batches
from vela_ray.data.locality import AccessProfile, DriftTracker, total_variation
from vela_ray.model.loading import moe_layout
from vela_ray.observability.metrics import MetricsSink
from vela_ray.runtime.migration import (
    MigrationPlan, copies_of, estimated_seconds_per_expert, master_table, migration_record, replan,
    seconds_per_moved_expert,
)
from vela_ray.runtime.pool import WorkerPool
from vela_ray.runtime.state import Backbone, Live, ResumePoint, RunState
from vela_ray.training.summary import LinkRecord, PlacementRecord, ReplanRecord

logger = logging.getLogger(__name__)


def placement_problem(tokens_per_step: int, dtype: torch.dtype, backbone: Backbone, probs_LE: np.ndarray | None,
                      links: list[LinkRecord], capacities: list[int], worker_nodes: list[str], master_node: str,
                      compute_seconds_per_row: list[float] | None = None,
                      shared_links: list[SharedLink] | None = None,
                      master_nodes: list[str] | None = None, *, compute_in_objective: bool = True,
                      training_step: TrainingStep | None = None) -> PlacementProblem:
    """The placement problem of this job: its profile (uniform if None), tokens (`training.batch_size` x
    `data.seq_len` a step), row size (elements of `dtype`, `model.dtype`'s), links (and what they share, and
    their latencies) and capacities; the workers' compute (in the objective or for the step prediction alone)
    and the step (`TrainingStep`) as measured.

    With data-parallel `master_nodes`, `links` and `shared_links` are master 0's (`master_node`'s)
    measurements: the NICs keep their measured bandwidths and carry every master's crossing rows,
    and every master's links are inferred from master 0's (`master_links`)."""
    num_layers, num_experts = backbone.shape
    top_k = backbone.top_k
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
        tokens_per_step=tokens_per_step,
        hidden_size=backbone.blocks[0].layout.hidden_size,
        bits_per_element=torch.finfo(dtype).bits,
        bandwidths=bandwidths, capacities=capacities, worker_nodes=worker_nodes, master_node=master_node,
        master_nodes=master_nodes, master_bandwidths=per_master, compute_seconds_per_row=compute_seconds_per_row,
        compute_in_objective=compute_in_objective, latencies_s=[link.latency_s for link in links],
        shared_links=shared_links or [], training_step=training_step,
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


class Placer:
    """Settles, records and changes this run's placement; `drift` tracks the routing against the profile
    the current placement was solved for (None when it was solved for a uniform one)."""

    def __init__(self, config: JobConfig, pool: WorkerPool, state: RunState, metrics: MetricsSink, out_dir: Path,
                 in_flight: int = 1):
        self.config = config
        self.pool = pool
        self.state = state
        self.metrics = metrics
        self.out_dir = out_dir
        self.in_flight = in_flight  # micro-batches the step runs at once (`OverlapSection.in_flight`)
        self.drift: DriftTracker | None = None

    # --- the start --------------------------------------------------------------------------

    def initial_table(self, resume: ResumePoint | None) -> np.ndarray:
        """What the workers start loading: a resumed run's placement (same worker count), else sequential."""
        saved = self._saved_placement(resume)
        if saved:
            return saved.tables()
        model = self.config.model
        return sequential_table(*moe_layout(model.path, model.trust_remote_code), self.config.cluster.num_workers)

    def settle(self, live: Live, table: np.ndarray, resume: ResumePoint | None) -> None:
        """Profile, measure and solve (or keep a resumed run's placement); move the experts that changed
        worker; record and publish the placement."""
        start = time.perf_counter()
        state = self.state
        saved = self._saved_placement(resume)
        state.placed_probs = resume.profile if resume else None
        if resume:
            self._restore_profile(resume)
        if saved:
            state.plan = saved
        else:
            state.plan = self._place(live, resume)
            state.placed_probs = state.problem.probs
        if not np.array_equal(state.plan.tables(), table):
            self.migrate(live, state.plan.tables(), step=resume.step if resume else 0, reason="start")
        state.timings_s["placement_s"] = time.perf_counter() - start
        self.write_workers(live)
        state.plan.to_json(self.out_dir / "placement.json")
        logger.info("placement %s: %s experts per worker", state.plan.solver,
                    np.bincount(state.plan.as_array().ravel(), minlength=self.config.cluster.num_workers).tolist())

    def publish(self, live: Live) -> None:
        """Placement metrics, and the drift tracker against the profile it was solved for."""
        state = self.state
        record = PlacementRecord.of(state.plan, state.problem, self.config.placement.cost_model)
        self.metrics.set_placement(state.version, state.plan.expert_to_worker, self.config.cluster.num_workers,
                                   probs_LE=state.placed_probs, expected_comm_time_s=record.expected_comm_time_s)
        self.drift = None if state.placed_probs is None else DriftTracker(state.placed_probs, live.backbone.top_k)

    def write_workers(self, live: Live) -> None:
        """`workers.json`: where each worker's process runs (operators and tests signal them by pid)."""
        (self.out_dir / "workers.json").write_text(json.dumps(
            {"pids": self.pool.pids(), "nodes": live.hosted.node_ids, "master_pid": os.getpid(),
             "master_pids": [os.getpid(), *live.masters.pids()]}))

    def _restore_profile(self, resume: ResumePoint) -> None:
        """A resumed run's measured profile, from its checkpoint, into `profile.json`/`.npy` where the output dir
        lacks them (a first segment killed before it uploaded its outputs to object storage)."""
        saved = resume.trainer.get("access_profile")
        if saved is None:
            return
        self.state.access_profile = AccessProfile.model_validate(saved)
        if not (self.out_dir / "profile.json").exists():
            self.state.access_profile.save(self.out_dir / "profile.json", npy_path=self.out_dir / "profile.npy")

    def _saved_placement(self, resume: ResumePoint | None) -> Placement | None:
        """A resumed run keeps its placement when the worker count is unchanged."""
        saved = resume.placement if resume else None
        if saved and saved["num_workers"] == self.config.cluster.num_workers:
            return Placement.model_validate(saved)
        return None

    def _place(self, live: Live, resume: ResumePoint | None) -> Placement:
        problem = self.state.problem = self._problem(live, self._profile(live, resume))
        if self.config.placement.solver == "file":
            return Placement.from_json(self.config.placement.file, problem)
        return self._solve(problem, self.config.placement.solver)

    def _solve(self, problem: PlacementProblem, solver: str) -> Placement:
        """`solver`'s placement of `problem`; with `placement.replicas` and several masters, copies of experts
        added into spare capacity where the cost model says they pay (`placement.replicate`)."""
        seed = self.config.placement.seed
        plan = solve(problem, solver, seed=seed)
        logger.info("placement solved (%s): expected %.3g s/step, LP bound %s", plan.solver,
                    plan.expected_step_time, "none" if plan.lower_bound is None else f"{plan.lower_bound:.3g} s")
        if not (self.config.placement.replicas and problem.num_masters > 1):
            return plan
        routes = replicate(problem, plan.as_array(), seed=seed)
        copies = sum(len(workers) - 1 for workers in copies_of(routes).values())
        logger.info("replicas: %d copies of experts added, expected %.3g s/step", copies, step_time(problem, routes))
        return plan.model_copy(update={"routes": routes.tolist(), "expected_step_time": step_time(problem, routes),
                                       "solver": f"{plan.solver}+replicas"})

    def _problem(self, live: Live, probs: np.ndarray | None) -> PlacementProblem:
        """This job's placement problem for profile `probs`; links, compute, capacities and the step measured once.
        The workers' compute is measured whatever `placement.cost_model` says: the step prediction counts it."""
        cfg, state, backbone = self.config, self.state, live.backbone
        if not state.links:
            state.links, state.shared_links = self.pool.measure_links(shared=cfg.placement.shared_links == "measure")
        tokens = cfg.training.batch_size * backbone.train_set.group * cfg.data.seq_len  # a step's (pairs: 2 rows)
        if state.problem:
            compute, step = state.problem.compute_seconds_per_row, state.problem.training_step
        else:
            rows = max(1, tokens * backbone.top_k // cfg.cluster.num_workers)  # a worker's per layer, on average
            compute, step = self.pool.measure_compute(rows), self._training_step(live)
        capacities = state.problem.capacities if state.problem else self._capacities(backbone)
        return placement_problem(tokens, cfg.torch_dtype, backbone, probs, state.links, capacities,
                                 live.hosted.node_ids, self.pool.master_node, compute, state.shared_links,
                                 master_nodes=live.masters.nodes if live.masters.num_masters > 1 else None,
                                 compute_in_objective=cfg.placement.cost_model == "communication+compute",
                                 training_step=step)

    def _training_step(self, live: Live) -> TrainingStep:
        """How this job's step runs, the master's compute timed on the first step's first micro-batch, the experts
        stood in for (`MasterGroup.master_compute_s`): a real forward and backward before training, cheaper than
        a step and not mixed with waits on the experts, as every step's time is."""
        cfg = self.config.training
        train_set = live.backbone.train_set
        first = micro_batches(train_set.rows(batch_rows(train_set, 0, cfg.batch_size, cfg.seed)),
                              (cfg.micro_batch_size or cfg.batch_size) * train_set.group)[0]
        seconds = live.masters.master_compute_s(first)
        logger.info("the master computes %.3g s per micro-batch (%d a step, %d in flight)", seconds,
                    cfg.grad_accumulation, self.in_flight)
        # a pipeline's micro-batch passes its S stages in `seconds`; GPipe's step runs M of them in M + S - 1 stage
        # times (stages as even as the layers divide); the round trips are still predicted as one master's
        stages, micro = self.config.masters.pipeline_stages, cfg.grad_accumulation
        return TrainingStep(master_compute_s=seconds * (micro + stages - 1) / stages, micro_batches=micro,
                            in_flight=self.in_flight)

    def _profile(self, live: Live, resume: ResumePoint | None) -> np.ndarray | None:
        """P [L, E] to place by: measured through the brokers, read from a file, or None (uniform).
        A resume with another worker count re-places by the profile its checkpoint was placed for."""
        spec = self.config.placement.profile
        saved = resume.profile if resume else None
        if saved is not None:
            logger.info("re-placing for %d workers by the checkpoint's own profile", self.config.cluster.num_workers)
            return saved
        if spec == "uniform":
            return None
        if spec != "measure":
            return load_profile(Path(spec))[0]
        backbone = live.backbone
        batches = sequential_batches(backbone.train_set, self.config.training.batch_size,
                                     max_batches=self.config.placement.profile_batches, token_mask=True)
        profile = live.masters.profile(batches, backbone.blocks, source=str(self.config.data.path))
        profile.save(self.out_dir / "profile.json", npy_path=self.out_dir / "profile.npy")
        self.state.access_profile = profile
        return profile.probs_array()

    def _capacities(self, backbone: Backbone) -> list[int]:
        total = int(np.prod(backbone.shape))
        cap = self.config.placement.capacity
        capacities = [min(m, cap or total) for m in self.pool.capacities()]
        if sum(capacities) < total:
            raise ValueError(
                f"workers hold {sum(capacities)} experts ({capacities}) but the model has {total}: "
                f"need {total - sum(capacities)} more expert slots (add workers or raise placement.capacity)")
        return capacities

    # --- during training --------------------------------------------------------------------

    def migrate(self, live: Live, table: np.ndarray, *, step: int, reason: str,
                expected_saving_s: float | None = None, expected_cost_s: float | None = None) -> None:
        """Move the experts whose worker changes to `table` (or routes) between the live workers; swap
        every master's brokers' table."""
        state = self.state
        plan = MigrationPlan.between(state.tables, table)
        start = time.perf_counter()
        state.migrating = True  # a worker lost now leaves the others between two tables
        stats = self.pool.migrate(table)
        state.migrating = False
        state.tables = np.asarray(table)
        live.workers.set_copies(copies_of(table))
        live.master.dispatcher.rebind(master_table(table))
        live.masters.rebind(table)
        if reason != "start":
            state.version += 1
        record = migration_record(plan, stats, time.perf_counter() - start, step=step, reason=reason,
                                  version=state.version, expected_saving_s=expected_saving_s,
                                  expected_cost_s=expected_cost_s)
        state.migrations.append(record)
        logger.info("placement v%d (%s): moved %d experts between live workers in %.2f s (%.3g MB of LoRA/AdamW "
                    "state, %.3g MB of weights read)", record.version, reason, record.moved, record.seconds,
                    record.state_bytes / 1e6, record.frozen_bytes / 1e6)

    def replan_due(self, done: int) -> bool:
        cfg = self.config.placement.replan
        return bool(cfg.every) and done % cfg.every == 0 and done < self.config.training.steps \
            and self.drift is not None and self.drift.num_steps >= cfg.every

    def replan(self, live: Live, done: int) -> None:
        """Every `replan.every` steps: when the recent routing drifted from the placed profile, re-solve on
        it and move the experts if the expected saving over the horizon beats the migration's cost."""
        if not self.replan_due(done):
            return
        cfg, steps, state = self.config.placement.replan, self.config.training.steps, self.state
        recent = self.drift.probs(window=cfg.every)[-1]
        drift = float(total_variation(recent, self.drift.initial_LE, live.backbone.top_k).mean())
        if drift < cfg.drift_threshold:
            return
        problem = self._problem(live, recent)
        solver = "improved" if self.config.placement.solver == "file" else self.config.placement.solver
        candidate = self._solve(problem, solver)
        decision = replan(problem, state.tables, candidate.tables(), cfg.horizon_steps or steps - done,
                          self._seconds_per_expert())
        state.replans.append(ReplanRecord(
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
        self.migrate(live, candidate.tables(), step=done, reason="drift",
                     expected_saving_s=decision.expected_saving_s, expected_cost_s=decision.expected_cost_s)
        state.plan, state.problem, state.placed_probs = candidate, problem, recent
        self.publish(live)
        candidate.to_json(self.out_dir / "placement.json")

    def _seconds_per_expert(self) -> float:
        """A migration's expected seconds per moved expert: as measured in this run, but never less than
        the link model's (all of an expert's bytes over the slowest link: emulated links are not timed)."""
        slowest = min(link.bandwidth_bytes_per_s for link in self.state.links)
        modelled = estimated_seconds_per_expert(self.pool.bytes_per_expert(), slowest)
        return max(modelled, seconds_per_moved_expert(self.state.migrations) or 0.0)
