"""MasterActor: the backbone with its brokers, and the training loop.

Stages of `run()`:
  1. spawn ExpertManagers with a provisional (sequential) placement; each loads
     only its experts from the checkpoint;
  2. profile expert access on the training data through the brokers (or take a
     given profile), probe master-to-worker links, ask workers for capacity;
  3. solve the placement (PlacementService); if it differs, respawn the workers
     with it and rebind the brokers (experts are reloaded from the checkpoint,
     never sent by the master);
  4. train: `vela_ray.training.step.train_step` per step, eval loss, traffic per link tier;
  5. write the peft adapter, the placement, the profile and `summary.json`.

A plain class: `vela_ray.api` makes it an actor; tests may run it in-process.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import ray
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from actors.cluster import ExpertCluster, SpawnConfig, spawn_expert_managers
from actors.errors import WorkerLostError
from actors.expert_manager import ExpertManagerSpec
from actors.placement_service import PlacementRequest, spawn_placement_service
from actors.transports import CompiledGraphTransport, RayObjectRefTransport, data_plane_env
from actors.workers import RayWorkers
from placement import Placement, cost
from vela_ray.training import checkpoint
from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_at, micro_batches, sequential_batches
from vela_ray.baselines.expert_parallel import sequential_table
from vela_ray.model.experts import LoraSpec
from vela_ray.model.loading import load_backbone
from vela_ray.data.locality import DriftTracker, RoutingRecorder, load_probs, profile_model
from vela_ray.observability.metrics import MetricsSink
from vela_ray.observability.report import write_report
from vela_ray.model.modeling import find_moe_blocks, top_k_of
from vela_ray.training.optim import lr_at
from vela_ray.model.traffic import TrafficSnapshot
from vela_ray.training.step import (
    MasterModel, build_master, eval_loss, export, import_adapter, load_master_state, master_state, train_step,
)

logger = logging.getLogger(__name__)


class MasterActor:
    def __init__(self, config: JobConfig):
        self.config = config
        torch.manual_seed(config.training.seed)
        if config.cluster.master_threads:  # Ray gives the master (num_cpus=0) one thread
            torch.set_num_threads(config.cluster.master_threads)
        model_dir = config.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        dataset = config.data.build(self.tokenizer)
        self.train_set, self.eval_set = dataset.split(config.training.eval_fraction, config.training.seed)
        self.model = load_backbone(model_dir, getattr(torch, config.model.dtype))
        self.blocks = find_moe_blocks(self.model)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.out_dir = Path(config.output.dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(config.model_dump_json(indent=1))
        self.metrics = MetricsSink.for_ray()
        self.data_plane_env = data_plane_env(config.cluster.inline_bytes, config.cluster.zero_copy_tensors)
        self.drift: DriftTracker | None = None

    # --- stages ------------------------------------------------------------------------

    def run(self) -> dict:
        """The whole job; returns the summary also written to `output.dir/summary.json`."""
        cfg = self.config
        resume = self._resume_point()  # verified before any actor starts
        num_layers, num_experts = len(self.blocks), self.blocks[0].layout.num_experts
        saved = self._saved_placement(resume)
        table = np.asarray(saved.expert_to_worker) if saved else sequential_table(num_layers, num_experts,
                                                                              cfg.cluster.num_workers)
        self.cluster = self._spawn(table)
        self.transport = self._transport(self.cluster)
        timings: dict[str, float] = {}
        try:
            master = build_master(self.model, table, self.transport, LoraSpec(cfg.lora.r, cfg.lora.alpha),
                                  cfg.training.optimizer)
            start = time.perf_counter()
            master.dispatcher.latency = self.metrics.latency
            plan = self._settle_placement(master, table, resume)
            timings["placement_s"] = time.perf_counter() - start
            self._publish_placement(plan)
            start_step = self._load_start_state(master, resume)
            workers = RayWorkers(self.cluster.handles)
            received_before, compute_before = self._worker_totals()
            history = self._train(master, workers, timings, start_step, plan)
            received_after, compute_after = self._worker_totals()
            received = [after - before for after, before in zip(received_after, received_before)]
            timings["worker_compute_s"] = [after - before for after, before in zip(compute_after, compute_before)]
            export(master, workers, self.out_dir / "adapter")
            summary = self._summarize(plan, self.cluster, history, timings, master.dispatcher.counter.snapshot(),
                                      received)
            summary["report"] = str(write_report(self.out_dir).resolve())
            return summary
        finally:
            self.transport.close()
            self.cluster.shutdown()

    def _worker_totals(self) -> tuple[list[int], list[float]]:
        """Per worker: bytes received and seconds of expert compute so far."""
        handles = self.cluster.handles
        received = [h.received.remote() for h in handles]
        compute = [h.compute_seconds.remote() for h in handles]
        return ray.get(received), ray.get(compute)

    def _resume_point(self) -> dict | None:
        """The checkpoint to continue from: path, manifest, trainer state; refused if it does not match."""
        spec = self.config.checkpoint.resume
        if spec is None:
            return None
        path = checkpoint.resolve(spec, self.config.checkpoint_root)
        manifest = checkpoint.verify(path)  # full checksums
        checkpoint.check_compatible(manifest, self._checkpoint_meta(), path)
        trainer = json.loads((path / "trainer.json").read_text())
        logger.info("resuming from %s (step %d)", path, manifest["step"])
        return {"path": path, "manifest": manifest, "trainer": trainer}

    def _settle_placement(self, master: MasterModel, table: np.ndarray, resume: dict | None) -> Placement:
        """Profile, probe and solve (or reuse a resumed run's placement); respawn the workers if it moved."""
        saved = self._saved_placement(resume)
        if saved:
            plan, self.links = saved, []
        else:
            plan = self._place(self.cluster, self._profile(master))
        if plan.expert_to_worker != table.tolist():
            self.transport.close(), self.cluster.shutdown()
            table = np.asarray(plan.expert_to_worker)
            self.cluster = self._spawn(table)
            self.transport = self._transport(self.cluster)
            master.dispatcher.rebind(table, self.transport)
        (self.out_dir / "workers.json").write_text(json.dumps(
            {"pids": ray.get([h.pid.remote() for h in self.cluster.handles]), "nodes": self.cluster.node_ids}))
        return plan

    def _publish_placement(self, plan: Placement) -> None:
        """Placement metrics, and the drift tracker against the profile it was solved for."""
        request = getattr(self, "request", None)  # None when a resumed run reuses its placement
        probs = np.asarray(request.probs) if request else None
        comm = self._expected_comm_time(plan)
        self.metrics.set_placement(1, plan.expert_to_worker, probs_LE=probs,
                                   expected_step_time_s=plan.expected_step_time if comm is None else comm)
        self.drift = DriftTracker(probs, top_k_of(self.model)) if probs is not None else None

    def _saved_placement(self, resume: dict | None) -> Placement | None:
        """A resumed run keeps its placement when the worker count is unchanged."""
        saved = resume["trainer"]["placement"] if resume else None
        if saved and saved["num_workers"] == self.config.cluster.num_workers:
            return Placement.model_validate(saved)
        return None

    def _load_start_state(self, master: MasterModel, resume: dict | None) -> int:
        """Adapters and optimizer state to start from; returns the first step to run."""
        workers = RayWorkers(self.cluster.handles)
        if resume:
            path = resume["path"]
            ray.get([h.load_checkpoint.remote(str(path)) for h in self.cluster.handles])
            load_master_state(master, checkpoint.read_tensors(path / "backbone.safetensors"))
            return int(resume["manifest"]["step"])
        if self.config.lora.init_adapter:
            import_adapter(master, workers, self.config.lora.init_adapter)
        return 0

    def _save_checkpoint(self, master: MasterModel, step: int, plan: Placement) -> Path:
        """Atomic checkpoint of `step`: workers write their experts' parts in parallel, the master the rest."""
        cfg = self.config
        start = time.perf_counter()
        staging = checkpoint.begin(cfg.checkpoint_root, step)
        parts = [h.save_checkpoint_part.remote(str(staging)) for h in self.cluster.handles]
        tensors = master_state(master)
        tensors["rng.torch"] = torch.get_rng_state()
        checkpoint.write_tensors(staging / "backbone.safetensors", tensors)
        checkpoint.write_json(staging / "trainer.json", {
            "step": step, "data_position": step, "total_steps": cfg.training.steps,
            "lr_next": lr_at(cfg.training.optimizer, step, cfg.training.steps),
            "placement": plan.model_dump(), "config": json.loads(cfg.model_dump_json()),
        })
        ray.get(parts)
        final = checkpoint.finalize(staging, step, self._checkpoint_meta(), keep=cfg.checkpoint.keep)
        logger.info("checkpoint %s written in %.2f s", final, time.perf_counter() - start)
        return final

    def _checkpoint_meta(self) -> dict:
        layout = self.blocks[0].layout
        return {"model_type": self.model.config.model_type, "moe_layers": len(self.blocks),
                "experts": layout.num_experts, "hidden_size": layout.hidden_size,
                "lora_r": self.config.lora.r, "lora_alpha": self.config.lora.alpha}

    def _spawn(self, table: np.ndarray) -> ExpertCluster:
        cfg = self.config
        specs = [
            ExpertManagerSpec(
                worker=n, keys=[tuple(k) for k in np.argwhere(table == n).tolist()],
                model_dir=str(cfg.model.path.resolve()), activation=self.blocks[0].layout.activation,
                lora=LoraSpec(cfg.lora.r, cfg.lora.alpha),
                optim=cfg.training.optimizer, seed=cfg.training.seed, dtype=cfg.model.dtype,
                device="cuda" if cfg.cluster.num_gpus_per_worker else "cpu",
            )
            for n in range(cfg.cluster.num_workers)
        ]
        spawn = SpawnConfig(num_cpus_per_worker=cfg.cluster.num_cpus_per_worker,
                            num_gpus_per_worker=cfg.cluster.num_gpus_per_worker,
                            workers_per_node=cfg.cluster.workers_per_node,
                            master_node=self.node_id if cfg.cluster.workers_per_node else None,
                            env_vars=self.data_plane_env)
        return spawn_expert_managers(specs, spawn)

    def _transport(self, cluster: ExpertCluster):
        tiers = cluster.worker_tiers(self.node_id)
        if self.config.cluster.transport == "compiled_graph":
            return CompiledGraphTransport(cluster.handles, tiers)
        return RayObjectRefTransport(cluster.handles, tiers, zero_copy=self.config.cluster.zero_copy_tensors)

    def _profile(self, master: MasterModel) -> np.ndarray | None:
        """P [L, E] to place by: measured through the brokers, read from a file, or None (uniform)."""
        spec = self.config.placement.profile
        if spec == "uniform":
            return None
        if spec != "measure":
            return load_probs(Path(spec))
        batches = sequential_batches(self.train_set, self.config.training.batch_size,
                                     max_batches=self.config.placement.profile_batches)
        profile = profile_model(master.peft_model, batches, blocks=self.blocks, source=str(self.config.data.path))
        profile.save(self.out_dir / "profile.json", npy_path=self.out_dir / "profile.npy")
        return profile.probs_array()

    def _place(self, cluster: ExpertCluster, probs: np.ndarray | None) -> Placement:
        cfg = self.config
        num_layers, num_experts = len(self.blocks), self.blocks[0].layout.num_experts
        top_k = top_k_of(self.model)
        if probs is None:
            probs = np.full((num_layers, num_experts), top_k / num_experts)
        service = spawn_placement_service(self.node_id, self.data_plane_env)
        tokens_per_step = cfg.training.batch_size * cfg.data.seq_len
        try:
            links = ray.get(service.probe.remote(cluster.handles))
            compute = None
            if cfg.placement.cost_model == "communication+compute":  # rows a worker gets per layer, on average
                rows = max(1, tokens_per_step * top_k // cfg.cluster.num_workers)
                compute = ray.get(service.probe_compute.remote(cluster.handles, rows))
            capacities = self._capacities(cluster, num_layers * num_experts)
            request = PlacementRequest(
                probs=probs.tolist(), top_k=top_k,
                tokens_per_step=tokens_per_step, compute_seconds_per_row=compute,
                hidden_size=self.blocks[0].layout.hidden_size,
                bits_per_element=torch.finfo(getattr(torch, cfg.model.dtype)).bits,
                bandwidths=[link.bandwidth_bytes_per_s for link in links], capacities=capacities,
                worker_nodes=cluster.node_ids, master_node=self.node_id, solver=cfg.placement.solver,
                seed=cfg.placement.seed,
                placement_file=str(cfg.placement.file) if cfg.placement.file else None,
            )
            plan = ray.get(service.solve.remote(request))
        finally:
            ray.kill(service)
        self.links = links
        self.request = request
        plan.to_json(self.out_dir / "placement.json")
        return plan

    def _capacities(self, cluster: ExpertCluster, total_experts: int) -> list[int]:
        handles = cluster.handles
        per_expert = ray.get(handles[0].bytes_per_expert.remote())
        measured = ray.get([h.capacity.remote(per_expert) for h in handles])
        cap = self.config.placement.capacity
        capacities = [min(m, cap) if cap else min(m, total_experts) for m in measured]
        if sum(capacities) < total_experts:
            raise ValueError(
                f"workers hold {sum(capacities)} experts ({capacities}) but the model has {total_experts}: "
                f"need {total_experts - sum(capacities)} more expert slots (add workers or raise placement.capacity)")
        return capacities

    def _train(self, master: MasterModel, workers: RayWorkers, timings: dict, start_step: int,
               plan: Placement) -> list[dict]:
        cfg = self.config.training
        master.dispatcher.counter.reset()
        history: list[dict] = []
        self.last_checkpoint: Path | None = checkpoint.latest(self.config.checkpoint_root)
        progress = tqdm(range(start_step, cfg.steps), desc="fine-tune", unit="step", mininterval=2.0,
                        initial=start_step, total=cfg.steps)
        train_start = time.perf_counter()
        self.routing = RoutingRecorder(self.blocks, top_k_of(self.model), record_confidence=False).attach()
        try:
            self._train_loop(master, workers, progress, history, plan)
        finally:
            self.routing.detach()
        timings["train_s"] = time.perf_counter() - train_start
        if history:
            history[-1].setdefault("eval_loss", self._eval(master))
        return history

    def _train_loop(self, master: MasterModel, workers: RayWorkers, progress, history: list[dict],
                    plan: Placement) -> None:
        cfg = self.config.training
        for step in progress:
            every = self.config.checkpoint.every
            try:
                record = self._step(master, workers, step)
                if step + 1 == cfg.steps or (every and (step + 1) % every == 0):
                    self.last_checkpoint = self._save_checkpoint(master, step + 1, plan)
            except ray.exceptions.RayActorError as err:
                raise self._worker_lost(step, err) from None
            history.append(record)
            progress.set_postfix(loss=f"{record['loss']:.4f}")
            if (step + 1) % cfg.log_every == 0:
                logger.info("step %d/%d loss %.4f (%.2fs)", step + 1, cfg.steps, record["loss"],
                            record["step_time_s"])

    def _step(self, master: MasterModel, workers: RayWorkers, step: int) -> dict:
        cfg = self.config.training
        counter = master.dispatcher.counter
        batch = batch_at(self.train_set, step, cfg.batch_size, cfg.seed)
        micro = micro_batches(batch, cfg.micro_batch_size or cfg.batch_size)
        before = counter.snapshot()
        waited_before = sum(master.dispatcher.round_trip_s.values())
        start = time.perf_counter()
        loss = train_step(master, workers, micro, lr_at(cfg.optimizer, step, cfg.steps), cfg.optimizer.max_grad_norm)
        step_time = time.perf_counter() - start
        round_trip = sum(master.dispatcher.round_trip_s.values()) - waited_before
        delta = counter.snapshot() - before
        counts_LE = self.routing.take_counts().numpy()
        self.tokens_routed = counts_LE + getattr(self, "tokens_routed", 0)  # training steps only, like metrics
        record = {"step": step + 1, "loss": loss, "step_time_s": step_time, "expert_round_trip_s": round_trip,
                  "bytes_by_tier": delta.bytes_by_tier(), "bytes_by_worker": delta.bytes_by_worker()}
        self.metrics.record_step(step + 1, loss, step_time, tokens=sum(m["input_ids"].numel() for m in micro),
                                 traffic_delta=delta, expert_counts_LE=counts_LE,
                                 drift_L=self.drift.record_step(counts_LE) if self.drift else None)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            record["eval_loss"] = self._eval(master)
            self.routing.take_counts()  # the eval pass's routing is not training traffic
        return record

    def _worker_lost(self, step: int, err: Exception) -> WorkerLostError:
        """Name the dead ExpertManager(s) and the checkpoint to resume from."""
        dead = []
        for worker, handle in enumerate(self.cluster.handles):
            try:
                ray.get(handle.ping.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(worker)
        where = (f"resume from checkpoint {self.last_checkpoint} with `vela train --config ... --resume "
                 f"{self.last_checkpoint}`" if self.last_checkpoint else "no checkpoint was written yet; "
                 "set checkpoint.every to bound lost work")
        return WorkerLostError(dead, f"ExpertManager worker(s) {dead} died during step {step + 1}; "
                                     f"training stopped and its in-memory state since the last checkpoint is discarded; {where}. Cause: {err}")

    def _eval(self, master: MasterModel) -> float:
        cfg = self.config.training
        return eval_loss(master, list(sequential_batches(self.eval_set, cfg.batch_size, cfg.eval_batches)))

    def _expected_comm_time(self, plan: Placement) -> float | None:
        """The cost model's communication seconds per step for `plan` (without any compute term)."""
        request = getattr(self, "request", None)
        if request is None:  # a resumed run reuses its placement without probing
            return None
        return cost.step_time(request.problem().communication_only(), plan.as_array())

    def _summarize(self, plan: Placement, cluster: ExpertCluster, history: list[dict], timings: dict,
                   traffic: TrafficSnapshot, received: list[int]) -> dict:
        request = getattr(self, "request", None)
        step_times = [h["step_time_s"] for h in history]
        summary = {
            "losses": [h["loss"] for h in history],
            "eval_loss": history[-1]["eval_loss"],
            "steps": len(history),
            "median_step_time_s": float(np.median(step_times)),
            "step_breakdown_s": _step_breakdown(history, timings.get("worker_compute_s")),
            "traffic_bytes_by_tier": traffic.bytes_by_tier(),  # training and eval passes
            "traffic_bytes_by_worker": traffic.bytes_by_worker(),
            "sent_bytes_by_worker": traffic.bytes_by_worker(("dispatch", "grad_dispatch")),
            "worker_received_bytes": received,
            "tokens_routed": np.asarray(getattr(self, "tokens_routed", [])).astype(int).tolist(),
            "worker_tiers": traffic.worker_tiers,
            "history": history,
            "placement": {"solver": plan.solver, "expected_step_time_s": plan.expected_step_time,
                          "expected_comm_time_s": self._expected_comm_time(plan),
                          "cost_model": self.config.placement.cost_model,
                          "compute_seconds_per_row": request.compute_seconds_per_row if request else None,
                          "lower_bound_s": plan.lower_bound, "expert_to_worker": plan.expert_to_worker},
            "links": [link.model_dump(exclude={"samples"}) for link in self.links],
            "worker_nodes": cluster.node_ids,
            "master_node": self.node_id,
            "timings_s": timings,
            "adapter_dir": str((self.out_dir / "adapter").resolve()),
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def _step_breakdown(history: list[dict], worker_compute_s: list[float] | None) -> dict:
    """Where a step's time goes (medians over steps; worker compute is a per-step mean).

    expert_round_trip: the master waiting on the transport (rows there, expert compute,
    results back, forward and backward); master: the rest (backbone, router, optimizer,
    control calls). Worker compute shows how much of the round trips is arithmetic.
    """
    if not history:
        return {}
    step = float(np.median([h["step_time_s"] for h in history]))
    round_trip = float(np.median([h["expert_round_trip_s"] for h in history]))
    per_worker = [s / len(history) for s in (worker_compute_s or [])]
    return {"step": step, "expert_round_trip": round_trip, "master": step - round_trip,
            "worker_compute_per_worker": per_worker, "worker_compute_max": max(per_worker, default=0.0),
            "worker_compute_sum": sum(per_worker)}
