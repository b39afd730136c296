"""Placement groups for ExpertManagers: pinning workers to nodes, and errors that say how to fix them."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from actors.cluster import SpawnConfig, reserve_bundles, spawn_expert_managers
from vela_ray.errors import ClusterError
from tests.ray.helpers import DATA_PLANE_ENV, specs_for, split_weights, synthetic_placement, synthetic_weights


def test_spawned_workers_start_with_the_data_plane_environment(synthetic_cluster):
    assert DATA_PLANE_ENV == {"RAY_max_direct_call_object_size": str(4 << 20), "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    for pid in [r.pid for r in ray.get([h.report.remote() for h in synthetic_cluster.handles])]:
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        assert {k: environ.get(k) for k in DATA_PLANE_ENV} == DATA_PLANE_ENV


def test_workers_per_node_pins_bundles_to_the_master_node(ray_session):
    node = ray.get_runtime_context().get_node_id()
    pg = reserve_bundles(2, SpawnConfig(num_cpus_per_worker=0.1, workers_per_node=2, master_node=node, ready_timeout_s=30))
    try:
        assert set(placement_group_table(pg)["bundles_to_node_id"].values()) == {node}
    finally:
        remove_placement_group(pg)


def test_more_workers_than_nodes_can_hold_is_refused(ray_session):
    with pytest.raises(ClusterError, match=r"3 workers at workers_per_node=2 need 2 nodes but the cluster has 1"):
        reserve_bundles(3, SpawnConfig(workers_per_node=2))


def test_unknown_master_node_is_refused(ray_session):
    with pytest.raises(ClusterError, match="master_node 'nowhere' is not an alive node"):
        reserve_bundles(1, SpawnConfig(workers_per_node=1, master_node="nowhere"))


def test_resources_that_never_appear_fail_fast_with_the_fix(ray_session):
    specs = specs_for(split_weights(synthetic_weights(), synthetic_placement(), 3))
    with pytest.raises(ClusterError, match="cannot reserve 3 x .*lower num_cpus_per_worker"):
        spawn_expert_managers(specs, num_cpus_per_worker=64, ready_timeout_s=2)


def test_specs_must_be_in_worker_order_and_match_the_devices(ray_session):
    specs = specs_for(split_weights(synthetic_weights(), synthetic_placement(), 3))
    with pytest.raises(ValueError, match=r"specs\[n\].worker must equal n"):
        spawn_expert_managers(list(reversed(specs)))
    cuda = [spec.model_copy(update={"device": "cuda"}) for spec in specs]
    with pytest.raises(ValueError, match="num_gpus_per_worker is 0: set it to 1"):
        spawn_expert_managers(cuda)
