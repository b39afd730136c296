"""WorkerPool: what the job runner needs from wherever the experts live.

A pool starts ExpertManagers for a placement table and hands back their control plane
(`ExpertWorkers`) and data plane (`Transport`); it measures what the placement needs
(links, compute per row, capacity) and says whether an error means a worker died. Two
implementations: `vela_ray.runtime.local.InProcessPool` (this process) and
`actors.pool.RayWorkerPool` (Ray actors, one per GPU or CPU bundle).

A pool also hosts the master ranks other than master 0 (`rank_hosts`: Ray actors, or threads of
this process), which `vela_ray.runtime.masters.MasterGroup` starts and drives. What the workers and
the workers are built from comes from the config here, in one place: `manager_specs` (the masters':
`runtime.masters.master_spec`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from placement import SharedLink
from placement.cost import hosted

from vela_ray.config import JobConfig
from vela_ray.model.traffic import LinkTier
from vela_ray.model.transport import Transport
from vela_ray.training.expert_manager import ExpertManagerSpec, MigrationStats
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.summary import LinkRecord

if TYPE_CHECKING:
    from vela_ray.runtime.masters import MasterMesh, RankHosts


@dataclass
class HostedExperts:
    """ExpertManagers hosting one placement table: worker n runs on `node_ids[n]`."""

    workers: ExpertWorkers
    transport: Transport
    node_ids: list[str]

    @property
    def tiers(self) -> list[LinkTier]:
        return self.transport.worker_tiers()


class WorkerPool(Protocol):
    master_node: str

    def launch(self, table: np.ndarray) -> None:
        """Begin starting the workers for `table` without waiting, so they load their experts while the
        master loads its backbone; `start(table)` finishes. A pool in one process has nothing to begin."""
        ...

    def start(self, table: np.ndarray) -> HostedExperts:
        """(Re)start the workers so that worker n hosts the experts `table` gives n."""
        ...

    def rank_hosts(self, mesh: "MasterMesh", nodes: list[str]) -> "RankHosts":
        """Where the master ranks other than master 0 run (`vela_ray.runtime.masters`), master m's on
        `nodes[m]`, with brokers to the started workers; a ValueError naming the setting this pool cannot host."""
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
            quantization=config.quantization_spec,
        )
        for n in range(config.cluster.num_workers)
    ]


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
