"""InProcessPool: the ExpertManagers in the runner's own process.

The one-process form of a vela-ray run: the same JobRunner, ExpertManagers and brokers as on
Ray, with `InProcessTransport` (a direct call) as the data plane. Links are function calls,
so all are reported equal and the placement balances routing mass across workers.

    summary = JobRunner(config, InProcessPool(config)).run()
"""

from __future__ import annotations

import os

import numpy as np

from vela_ray.config import JobConfig
from vela_ray.model.traffic import LOCAL_NODE
from vela_ray.model.transport import InProcessTransport
from vela_ray.runtime.pool import HostedExperts, capacity_from_memory, fill_unmeasured, manager_specs
from vela_ray.training.expert_manager import ExpertManager
from vela_ray.training.step import ExpertWorkers
from vela_ray.training.summary import LinkRecord

IN_PROCESS_LINK = LinkRecord(latency_s=0.0, bandwidth_bytes_per_s=1e12)


class InProcessPool:
    """`WorkerPool` whose workers are plain ExpertManager objects in this process."""

    master_node = LOCAL_NODE

    def __init__(self, config: JobConfig):
        self.config = config
        self.managers: list[ExpertManager] = []

    def start(self, table: np.ndarray) -> HostedExperts:
        self.managers = [ExpertManager(spec) for spec in manager_specs(self.config, table)]
        return HostedExperts(ExpertWorkers.in_process(self.managers), InProcessTransport(self.managers),
                             [LOCAL_NODE] * len(self.managers))

    def measure_links(self) -> list[LinkRecord]:
        return [IN_PROCESS_LINK] * len(self.managers)

    def measure_compute(self, num_rows: int) -> list[float]:
        return fill_unmeasured([m.seconds_per_row(num_rows) for m in self.managers])

    def capacities(self) -> list[int]:
        per_expert = next(m.bytes_per_expert() for m in self.managers if m.keys)
        return capacity_from_memory([m.free_bytes() for m in self.managers], per_expert)

    def pids(self) -> list[int]:
        return [os.getpid()] * len(self.managers)

    def lost_workers(self, error: BaseException) -> list[int] | None:
        return None  # an in-process worker cannot die apart from the runner

    def close(self) -> None:
        self.managers = []
