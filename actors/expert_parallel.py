"""Launch conventional expert parallelism (`vela_ray.baselines.expert_parallel`) on Ray: one actor per rank.

    summary = run_expert_parallel(config, mode="expert_parallel")   # Ray must be initialised

`cluster.num_workers` ranks (one per GPU with `num_gpus_per_worker: 1`, else
`num_cpus_per_worker` CPUs each) are reserved with one placement group, filled
node by node from the driver's node when `cluster.workers_per_node` is set (the
same layout as vela-ray's ExpertManagers, so rank r and vela's worker r share a
node). Rank 0's actor picks a free port on its node address; every rank joins
`torch.distributed` there (gloo on CPU over the interface that carries its Ray
node address, NCCL on GPU), builds its replica and trains the job's steps in
lockstep. The summary has the keys of `VelaJob.run()`'s that apply (losses,
eval_loss, median_step_time_s, traffic_bytes_by_tier, history with
bytes_by_tier per step, worker_nodes, master_node) plus the EP-only
`allreduce_bytes_per_step` and `control_bytes`.

`RankActor` is a plain class; `ray.remote` is applied only in `_spawn_ranks`.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from typing import Any, Literal

import numpy as np
import psutil
import ray
import torch.distributed as dist
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoTokenizer

from actors.cluster import SpawnConfig, reserve_bundles, classify_link_tiers
from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_at, micro_batches, sequential_batches
from vela_ray.baselines.expert_parallel import ExpertParallelRank, build_rank, eval_loss_ep, sequential_table, train_step_ep
from vela_ray.model.experts import LoraSpec
from vela_ray.model.loading import moe_layout
from vela_ray.training.optim import lr_at
from vela_ray.model.traffic import TrafficSnapshot

logger = logging.getLogger(__name__)

Mode = Literal["vela", "expert_parallel"]
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
        dataset = config.data.build(tokenizer)
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
        self.replica = build_rank(cfg.model.path, cfg.model.dtype, LoraSpec(cfg.lora.r, cfg.lora.alpha),
                                  cfg.training.optimizer, cfg.training.seed, rank_nodes, device=self.device,
                                  init_adapter=cfg.lora.init_adapter)

    def train(self) -> dict:
        """Every step of the job; rank 0's step times (each starts at a barrier) and this rank's traffic."""
        cfg = self.config.training
        counter = self.replica.master.dispatcher.counter
        history = []
        for step in range(cfg.steps):
            batch = batch_at(self.train_set, step, cfg.batch_size, cfg.seed)
            micro = micro_batches(batch, cfg.micro_batch_size or cfg.batch_size)
            before, allreduce_before = counter.snapshot(), self.replica.allreduce_bytes
            dist.barrier()
            start = time.perf_counter()
            loss = train_step_ep(self.replica, micro, lr_at(cfg.optimizer, step, cfg.steps),
                                 cfg.optimizer.max_grad_norm, self.device)
            history.append({"step": step + 1, "loss": loss, "step_time_s": time.perf_counter() - start,
                            "bytes_by_tier": (counter.snapshot() - before).bytes_by_tier(),
                            "allreduce_bytes": self.replica.allreduce_bytes - allreduce_before})
        eval_batches = [b for b in sequential_batches(self.eval_set, cfg.batch_size, cfg.eval_batches)
                        if b["input_ids"].shape[0] >= self.num_ranks]
        return {"history": history, "eval_loss": eval_loss_ep(self.replica, eval_batches, self.device),
                "traffic": counter.snapshot().model_dump(), "control_bytes": self.replica.transport.control_bytes}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_expert_parallel(config: JobConfig, mode: Mode = "expert_parallel") -> dict:
    """Train `config` with expert parallelism over `cluster.num_workers` ranks; returns the summary.

    `mode` is the job's `cluster.mode`; only "expert_parallel" runs here (vela-ray
    jobs go through `vela_ray.api.VelaJob`). Ray must already be initialised.
    """
    if mode != "expert_parallel":
        raise ValueError(f"run_expert_parallel runs mode 'expert_parallel', got {mode!r}; "
                         "run vela-ray jobs with vela_ray.api.VelaJob")
    if not ray.is_initialized():
        raise ValueError("run_expert_parallel needs an initialised Ray: call it from VelaJob.run or after ray.init")
    master_node = ray.get_runtime_context().get_node_id()
    handles, pg = _spawn_ranks(config, master_node)
    try:
        rank_nodes = ray.get([h.node_id.remote() for h in handles])
        init_method = ray.get(handles[0].rendezvous.remote())
        ray.get([h.setup.remote(init_method, rank_nodes) for h in handles])
        results = ray.get([h.train.remote() for h in handles])
        ray.get([h.shutdown.remote() for h in handles])
        return _summarize(results, rank_nodes, master_node, config)
    finally:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        remove_placement_group(pg)


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


def _summarize(results: list[dict], rank_nodes: list[str], master_node: str, config: JobConfig) -> dict:
    """Rank 0's losses and step times; traffic summed over ranks (each transfer counted once)."""
    history = []
    for step, records in enumerate(zip(*[r["history"] for r in results])):
        tiers = [rec["bytes_by_tier"] for rec in records]
        history.append({**records[0], "step_time_s": max(rec["step_time_s"] for rec in records),
                        "bytes_by_tier": {t: sum(b[t] for b in tiers) for t in tiers[0]}})
    traffic = [TrafficSnapshot.model_validate(r["traffic"]) for r in results]
    by_tier = {t: sum(s.bytes_by_tier()[t] for s in traffic) for t in traffic[0].bytes_by_tier()}
    return {
        "mode": "expert_parallel",
        "losses": [h["loss"] for h in history],
        "eval_loss": results[0]["eval_loss"],
        "steps": len(history),
        "median_step_time_s": float(np.median([h["step_time_s"] for h in history])),
        "traffic_bytes_by_tier": by_tier,
        "traffic_bytes_by_worker": [sum(s.bytes_by_worker()) - s.bytes_by_tier()["same_process"] for s in traffic],
        "allreduce_bytes_per_step": history[0]["allreduce_bytes"] if history else 0,
        "control_bytes": sum(r["control_bytes"] for r in results),
        "history": history,
        "placement": {"solver": "expert_parallel", "expected_step_time_s": None,
                      "expert_to_worker": _table(config, len(rank_nodes))},
        "links": [],
        "worker_nodes": rank_nodes,
        "worker_tiers": classify_link_tiers(master_node, rank_nodes),
        "master_node": master_node,
    }


def _table(config: JobConfig, num_ranks: int) -> list[list[int]]:
    num_layers, num_experts, _ = moe_layout(config.model.path)
    return sequential_table(num_layers, num_experts, num_ranks).tolist()
