"""Ray fixtures: one local Ray instance per session, a shared synthetic cluster, per-test pools.

Tests that need their own actors spawn them through `ray_pool`, which tears
them down (transports first) when the test ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray

from actors.cluster import ExpertCluster
from vela_ray.training.expert_manager import ExpertManagerSpec
from tests.ray.helpers import (
    NUM_WORKERS, RAY_CPUS, spawn, specs_for, split_weights, synthetic_placement, synthetic_weights,
)


RAY_TESTS = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The tests here run Ray or whole jobs: `job`-marked (before `-m` selects), so `make test-fast` skips them."""
    for item in items:
        if RAY_TESTS in item.path.parents:
            item.add_marker(pytest.mark.job)


@pytest.fixture(scope="session")
def ray_session():
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def synthetic_cluster(ray_session) -> ExpertCluster:
    """3 ExpertManagers hosting the synthetic model under `synthetic_placement()`."""
    cluster = spawn(specs_for(split_weights(synthetic_weights(), synthetic_placement(), NUM_WORKERS)))
    yield cluster
    cluster.shutdown()


@dataclass
class RayPool:
    """Clusters and transports a test started; closed in reverse order when it ends."""

    clusters: list[ExpertCluster] = field(default_factory=list)
    transports: list = field(default_factory=list)

    def spawn(self, specs: list[ExpertManagerSpec]) -> ExpertCluster:
        self.clusters.append(spawn(specs))
        return self.clusters[-1]

    def track(self, transport):
        self.transports.append(transport)
        return transport

    def close(self) -> None:
        for transport in reversed(self.transports):
            transport.close()
        for cluster in reversed(self.clusters):
            cluster.shutdown()


@pytest.fixture
def ray_pool(ray_session):
    pool = RayPool()
    yield pool
    pool.close()
