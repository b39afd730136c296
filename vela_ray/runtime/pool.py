"""WorkerPool: what the job runner needs from wherever the experts live.

A pool starts ExpertManagers for a placement table and hands back their control plane
(`ExpertWorkers`) and data plane (`Transport`); it measures what the placement needs
(links, compute per row, capacity) and says whether an error means a worker died. Two
implementations: `vela_ray.runtime.local.InProcessPool` (this process) and
`actors.pool.RayWorkerPool` (Ray actors, one per GPU or CPU bundle).

A pool also starts the other data-parallel masters (`PeerMasters`, the protocol master 0's
runner drives them by; `SoloMaster` when there is one; `vela_ray.runtime.masters` has the
rest). What the workers and the masters are built from comes from the config here, in one
place each: `manager_specs` and `master_spec`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from placement import SharedLink
from placement.cost import hosted

from vela_ray.config import JobConfig
from vela_ray.model.traffic import LinkTier, TrafficSnapshot
from vela_ray.model.transport import Transport
from vela_ray.training.expert_manager import ExpertManagerSpec, MigrationStats
from vela_ray.training.replicas import SINGLE, Replicas
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel, MasterSpec, master_device
from vela_ray.training.step import Batch
from vela_ray.training.summary import LinkRecord


@dataclass
class HostedExperts:
    """ExpertManagers hosting one placement table: worker n runs on `node_ids[n]`."""

    workers: ExpertWorkers
    transport: Transport
    node_ids: list[str]

    @property
    def tiers(self) -> list[LinkTier]:
        return self.transport.worker_tiers()


Wait = Callable[[], list[dict]]  # blocks until every peer's step is done; returns their `peer_step` records


class PeerMasters(Protocol):
    """Masters 1..M-1 as master 0's runner drives them."""

    replicas: Replicas  # master 0's member of the masters' group
    num_masters: int
    nodes: list[str]  # node of each master, master 0's first

    def start_step(self, micro_batches: Sequence[Batch], lr: float, max_grad_norm: float | None) -> Wait:
        """Start every peer's `train_step` on its rows of `micro_batches`; master 0 then runs its own."""
        ...

    def abort(self) -> None:
        """Master 0's step failed: release the peers from the step (they may wait in a gradient sum that
        master 0 will never join) and discard it; the next `start_step` starts clean."""
        ...

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Backbone LoRA and AdamW state (`master.master_state` of master 0) into every peer."""
        ...

    def rebind(self, table: np.ndarray) -> None:
        """Every peer's brokers to a new table, or to its own of per-master routes (after a migration)."""
        ...

    def traffic(self) -> list[TrafficSnapshot]:
        """Each peer's traffic counts since it started, or since `reset_traffic`."""
        ...

    def reset_traffic(self) -> None:
        """Zero every peer's traffic counts (as master 0's are when training starts)."""
        ...

    def pids(self) -> list[int]:
        """Each peer's process id (operators and tests signal them by it)."""
        ...

    def close(self) -> None:
        ...


class SoloMaster:
    """One master: no peers, nothing to sum or to tell."""

    replicas = SINGLE
    num_masters = 1

    def __init__(self, node: str = ""):
        self.nodes = [node]

    def start_step(self, micro_batches, lr, max_grad_norm) -> Wait:
        return lambda: []

    def abort(self) -> None:
        pass

    def load_state(self, tensors) -> None:
        pass

    def rebind(self, table) -> None:
        pass

    def traffic(self) -> list[TrafficSnapshot]:
        return []

    def reset_traffic(self) -> None:
        pass

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


class WorkerPool(Protocol):
    master_node: str

    def launch(self, table: np.ndarray) -> None:
        """Begin starting the workers for `table` without waiting, so they load their experts while the
        master loads its backbone; `start(table)` finishes. A pool in one process has nothing to begin."""
        ...

    def start(self, table: np.ndarray) -> HostedExperts:
        """(Re)start the workers so that worker n hosts the experts `table` gives n."""
        ...

    def start_peers(self, table: np.ndarray, leader: MasterModel) -> PeerMasters:
        """Masters 1..M-1 of `masters.count`, with brokers over `table` to the started workers
        (`vela_ray.runtime.masters`), or with `cluster.master_tp` the other ranks of master 0 (`leader`, which
        is sharded with them); `SoloMaster` when there is one."""
        ...

    def migrate(self, table: np.ndarray) -> list[MigrationStats]:
        """Move the experts whose worker differs in `table` between the live workers
        (`vela_ray.runtime.migration`); the workers, their control and data planes stay."""
        ...

    def replace(self, workers: list[int]) -> HostedExperts:
        """Start new workers in place of the lost `workers`, hosting the same experts (fresh state:
        the caller loads a checkpoint); returns the planes over the survivors and the new ones."""
        ...

    def measure_links(self, shared: bool = False) -> tuple[list[LinkRecord], list[SharedLink]]:
        """The master's link to each worker, and with `shared` what those links share, with its measured
        bandwidth (the NICs of `placement.node_shared_links`; none without `shared`)."""
        ...

    def measure_compute(self, num_rows: int) -> list[float]:
        """Seconds per routed row of expert forward+backward on each worker."""
        ...

    def capacities(self) -> list[int]:
        """Experts each worker could hold in its free device memory (measured, before any config cap)."""
        ...

    def bytes_per_expert(self) -> int:
        """Device bytes one hosted expert takes (frozen weights, LoRA, its gradient and AdamW moments)."""
        ...

    def pids(self) -> list[int]:
        ...

    def lost_workers(self, error: BaseException) -> list[int] | None:
        """The workers that died if `error` means a worker was lost, else None."""
        ...

    def close(self) -> None:
        ...


def manager_specs(config: JobConfig, table: np.ndarray, device: str = "cpu") -> list[ExpertManagerSpec]:
    """One ExpertManagerSpec per worker: the experts `table` gives it (a table [L, E], or per-master routes
    [M, L, E] of replicated experts), read from the model's checkpoint."""
    table = np.asarray(table)
    hosts = hosted(table if table.ndim == 3 else table[None], config.cluster.num_workers)
    lora = config.lora_spec  # resolved against the model once (rank/alpha patterns), not once per worker
    return [
        ExpertManagerSpec(
            worker=n, keys=[tuple(k) for k in np.argwhere(hosts[n]).tolist()],
            model_dir=str(config.model.path.resolve()), lora=lora,
            optim=config.training.optimizer, seed=config.training.seed, dtype=config.model.dtype, device=device,
            tiers=config.expert_tiers, trust_remote_code=config.model.trust_remote_code,
        )
        for n in range(config.cluster.num_workers)
    ]


def master_spec(config: JobConfig) -> MasterSpec:
    """What every master replica of this job is built from (`master.build_master_replica`)."""
    return MasterSpec(
        model_dir=config.model.path, dtype=config.torch_dtype, lora=config.lora_spec, optim=config.training.optimizer,
        seed=config.training.seed, trust_remote_code=config.model.trust_remote_code,
        num_masters=config.masters.count * config.cluster.master_tp, row_format=config.data_plane.row_format,
        device=master_device(bool(config.cluster.master_gpus)),
        activation_checkpointing=config.training.activation_checkpointing and config.training.method != "zo",
    )


def capacity_from_memory(free_bytes: list[int], bytes_per_expert: int, memory_pools: list[str] | None = None
                         ) -> list[int]:
    """Experts of `bytes_per_expert` that fit in each worker's free memory. `memory_pools[n]` names the memory
    worker n measured (`WorkerReport.memory_pool`): workers that share one (CPU or tiered workers on one
    node's host memory, in-process workers on one GPU) split it evenly instead of each counting all of it."""
    if bytes_per_expert <= 0:
        raise ValueError(f"bytes_per_expert must be positive, got {bytes_per_expert}")
    pools = memory_pools or [str(n) for n in range(len(free_bytes))]
    sharing = Counter(pools)
    return [int(free // sharing[pool] // bytes_per_expert) for free, pool in zip(free_bytes, pools)]


def fill_unmeasured(per_row_s: list[float | None]) -> list[float]:
    """A worker without experts cannot time one: it gets the median of the others."""
    known = [s for s in per_row_s if s is not None]
    if not known:
        raise ValueError("no worker hosts an expert, so compute per row cannot be measured")
    fallback = float(np.median(known))
    return [fallback if s is None else s for s in per_row_s]
