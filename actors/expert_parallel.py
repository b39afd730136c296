"""Launch conventional expert parallelism (`vela_ray.baselines.expert_parallel`) on Ray: one actor per rank.

    summary = run_expert_parallel(config)   # a `mode: expert_parallel` job; Ray must be initialised

`cluster.num_workers` ranks (one per GPU with `num_gpus_per_worker: 1`, else
`num_cpus_per_worker` CPUs each) are reserved with one placement group, filled
node by node from the driver's node when `cluster.workers_per_node` is set (the
same layout as vela-ray's ExpertManagers, so rank r and vela's worker r share a
node). Rank 0's actor picks a free port on its node address; every rank joins
`torch.distributed` there (gloo on CPU over the interface that carries its Ray
node address, NCCL on GPU), builds its replica and trains the job's steps in
lockstep.

The run writes into `output.dir` what a vela-ray run writes, so both modes are read
the same way: `config.json`, `adapter/` (the peft adapter of the original model:
rank 0's backbone LoRA, equal on every rank after each all-reduced step, and every
rank's expert LoRA, gathered here), `summary.json` (a `RunSummary` with mode
"expert_parallel") and `report.html`. A step's time is the max over ranks (each
rank times from a barrier, and the group has finished a step when its slowest rank
has); losses are the same on every rank (all-reduced); traffic is summed over ranks
(each transfer counted once) and the backbone all-reduce reported apart.

`RankActor` is a plain class; `ray.remote` is applied only in `_spawn_ranks`.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray
import torch.distributed as dist
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoTokenizer

from actors.cluster import SpawnConfig, reserve_bundles
from placement import sequential_table
from vela_ray.baselines.expert_parallel import ExpertParallelRank, build_rank
from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_rows, build_dataset, micro_batches, sequential_batches
from vela_ray.model.adapters import backbone_state_of, export_adapter
from vela_ray.model.loading import moe_layout
from vela_ray.model.traffic import TrafficSnapshot, link_tiers
from vela_ray.observability.report import write_report
from vela_ray.training.schedule import lr_at
from vela_ray.training.step import eval_loss, train_step
from vela_ray.training.summary import PlacementRecord, RunSummary, StepRecord

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 300


def interface_for(address: str) -> str:
    """Name of the network interface that carries `address` (gloo must bind there, not to the hostname's)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise ValueError(f"no network interface carries the Ray node address {address}")


class RankActor:
    """One EP rank: joins the process group, builds its replica, trains, reports."""

    def __init__(self, config: JobConfig, rank: int, num_ranks: int):
        self.config, self.rank, self.num_ranks = config, rank, num_ranks
        self.device = "cuda" if config.cluster.num_gpus_per_worker else "cpu"
        tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
        dataset = build_dataset(config.data, tokenizer, warn=False)  # the driver's preflight warned already
        self.train_set, self.eval_set = dataset.split(config.training.eval_fraction, config.training.seed)
        self.replica: ExpertParallelRank | None = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self) -> str:
        """`tcp://address:port` of a free port on this actor's node address (called on rank 0)."""
        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((address, 0))
            return f"tcp://{address}:{sock.getsockname()[1]}"

    def setup(self, init_method: str, rank_nodes: list[str]) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface_for(ray.util.get_node_ip_address())
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.num_ranks,
                                timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
        cfg = self.config
        self.replica = build_rank(cfg.model.path, cfg.model.dtype, cfg.lora_spec,
                                  cfg.training.optimizer, cfg.training.seed, rank_nodes, device=self.device,
                                  init_adapter=cfg.lora.init_adapter)

    def train(self) -> dict:
        """Every step of the job: this rank's step times (from a barrier) and traffic, then the eval loss."""
        cfg, replica = self.config.training, self.replica
        history = [self._step(step) for step in range(cfg.steps)]
        eval_batches = [b for b in sequential_batches(self.eval_set, cfg.batch_size, cfg.eval_batches)
                        if b["input_ids"].shape[0] >= self.num_ranks]
        loss = (eval_loss(replica.master, eval_batches, loss_fn=replica.loss, replicas=replica.replicas)
                if eval_batches else None)  # every rank filters the same batches: the collectives still pair
        return {"history": history, "eval_loss": loss,
                "traffic": replica.master.dispatcher.traffic().model_dump(),
                "control_bytes": replica.transport.control_bytes, "received_bytes": replica.experts.received_bytes,
                "data_plane": replica.transport.describe()}

    def _step(self, step: int) -> dict:
        cfg, replica = self.config.training, self.replica
        rows = batch_rows(self.train_set, step, cfg.batch_size, cfg.seed)
        micro = micro_batches(self.train_set.rows(rows), cfg.micro_batch_size or cfg.batch_size)
        dispatcher = replica.master.dispatcher
        before, grad_bytes_before = dispatcher.traffic(), replica.replicas.grad_bytes
        dist.barrier()
        start = time.perf_counter()
        loss = train_step(replica.master, replica.workers, micro, lr_at(cfg.optimizer, step, cfg.steps),
                          cfg.optimizer.max_grad_norm, loss_fn=replica.loss, replicas=replica.replicas)
        step_time = time.perf_counter() - start
        if self.rank == 0 and (step + 1) % cfg.log_every == 0:
            logger.info("step %d/%d loss %.4f (%.2fs on rank 0)", step + 1, cfg.steps, loss, step_time)
        return {"step": step + 1, "loss": loss, "step_time_s": step_time,
                "tokens": int(self.train_set.attention_mask[rows].sum()),
                "bytes_by_tier": (dispatcher.traffic() - before).bytes_by_tier(),
                "allreduce_bytes": replica.replicas.grad_bytes - grad_bytes_before}

    def adapter_parts(self) -> dict:
        """This rank's expert LoRA (on the CPU); rank 0 adds the backbone LoRA and what export needs."""
        parts: dict[str, Any] = {"experts": self.replica.experts.lora_state()}
        if self.rank == 0:
            master = self.replica.master
            parts.update(model_config=master.peft_model.base_model.model.config, lora_config=master.full_lora_config,
                         backbone={k: v.detach().cpu() for k, v in backbone_state_of(master.peft_model).items()})
        return parts

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_expert_parallel(config: JobConfig) -> RunSummary:
    """Train `config` with expert parallelism over `cluster.num_workers` ranks and write its outputs.

    Writes `config.json`, `adapter/`, `summary.json` and `report.html` into `output.dir`
    (see the module docstring) and returns the summary. Ray must already be initialised.
    """
    if not ray.is_initialized():
        raise ValueError("run_expert_parallel needs an initialised Ray: call it from VelaJob.run or after ray.init")
    out_dir = Path(config.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(config.model_dump_json(indent=1))
    master_node = ray.get_runtime_context().get_node_id()
    handles, pg = _spawn_ranks(config, master_node)
    try:
        rank_nodes = ray.get([h.node_id.remote() for h in handles])
        init_method = ray.get(handles[0].rendezvous.remote())
        ray.get([h.setup.remote(init_method, rank_nodes) for h in handles])
        start = time.perf_counter()
        results = ray.get([h.train.remote() for h in handles])
        train_s = time.perf_counter() - start
        adapter_dir = _export(ray.get([h.adapter_parts.remote() for h in handles]), out_dir / "adapter")
        ray.get([h.shutdown.remote() for h in handles])
    finally:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        remove_placement_group(pg)
    summary = _summarize(results, rank_nodes, master_node, _table(config, len(rank_nodes)))
    summary.timings_s["train_s"] = train_s
    summary.family_check = config.family_check
    summary.adapter_dir = str(adapter_dir.resolve())
    return _write(summary, out_dir)


def _spawn_ranks(config: JobConfig, master_node: str) -> tuple[list[Any], Any]:
    cluster = config.cluster
    spawn = SpawnConfig(num_cpus_per_worker=cluster.num_cpus_per_worker,
                        num_gpus_per_worker=cluster.num_gpus_per_worker,
                        workers_per_node=cluster.workers_per_node,
                        master_node=master_node if cluster.workers_per_node else None)
    pg = reserve_bundles(cluster.num_workers, spawn)
    remote_cls = ray.remote(RankActor)
    handles = [
        remote_cls.options(
            num_cpus=cluster.num_cpus_per_worker, num_gpus=cluster.num_gpus_per_worker, max_restarts=0,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=n),
        ).remote(config, n, cluster.num_workers)
        for n in range(cluster.num_workers)
    ]
    return handles, pg


def _export(parts: list[dict], out_dir: Path) -> Path:
    """One peft adapter of the original model from the ranks' parts (`RankActor.adapter_parts`)."""
    experts: dict = {}
    for part in parts:
        experts.update(part["experts"])
    head = parts[0]
    return export_adapter(out_dir, head["model_config"], head["lora_config"], head["backbone"], experts)


def _summarize(results: list[dict], rank_nodes: list[str], master_node: str,
               table: list[list[int]]) -> RunSummary:
    """Rank 0's losses (every rank's are equal), the max step time over ranks, traffic summed over ranks."""
    history = [_step_record(records) for records in zip(*[r["history"] for r in results])]
    if history:
        history[-1].eval_loss = results[0]["eval_loss"]
    traffic = [TrafficSnapshot.model_validate(r["traffic"]) for r in results]
    by_tier = {t: sum(s.bytes_by_tier()[t] for s in traffic) for t in traffic[0].bytes_by_tier()}
    return RunSummary(
        mode="expert_parallel",
        data_plane=results[0]["data_plane"],
        steps=len(history),
        losses=[h.loss for h in history],
        eval_loss=results[0]["eval_loss"],
        median_step_time_s=float(np.median([h.step_time_s for h in history])) if history else 0.0,
        history=history,
        traffic_bytes_by_tier=by_tier,
        traffic_bytes_by_worker=[sum(s.bytes_by_worker()) - s.bytes_by_tier()["same_process"] for s in traffic],
        worker_received_bytes=[r["received_bytes"] for r in results],
        worker_tiers=link_tiers(master_node, rank_nodes),
        worker_nodes=rank_nodes,
        master_node=master_node,
        placement=PlacementRecord(solver="expert_parallel", expert_to_worker=table, cost_model="none"),
        allreduce_bytes_per_step=history[0].allreduce_bytes if history else 0,
        control_bytes=sum(r["control_bytes"] for r in results),
    )


def _step_record(records: tuple[dict, ...]) -> StepRecord:
    """One step over all ranks: rank 0's loss, the slowest rank's time, every rank's bytes."""
    tiers = [rec["bytes_by_tier"] for rec in records]
    return StepRecord(step=records[0]["step"], loss=records[0]["loss"],
                      step_time_s=max(rec["step_time_s"] for rec in records), tokens=records[0]["tokens"],
                      bytes_by_tier={t: sum(b[t] for b in tiers) for t in tiers[0]},
                      allreduce_bytes=records[0]["allreduce_bytes"])


def _table(config: JobConfig, num_ranks: int) -> list[list[int]]:
    num_layers, num_experts = moe_layout(config.model.path)
    return sequential_table(num_layers, num_experts, num_ranks).tolist()


def _write(summary: RunSummary, out_dir: Path) -> RunSummary:
    """summary.json, then the report that reads it, then summary.json again naming the report."""
    summary.write(out_dir)
    summary.report = str(write_report(out_dir).resolve())
    summary.write(out_dir)
    logger.info("expert-parallel run written to %s", out_dir)
    return summary
