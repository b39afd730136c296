"""Start ExpertManager actors with placement groups, and know where each one runs.

This is the one place where `ray.remote` turns the plain `ExpertManager` class
into an actor (`actors.workers.ExpertManagerActor`: the class, plus calls whose answers stay on the actor). One
placement-group bundle per worker reserves its CPUs (and its
GPU with `num_gpus_per_worker=1`, so Ray pins each actor to one device):

    cluster = spawn_expert_managers(specs, SpawnConfig(num_gpus_per_worker=1, workers_per_node=8))
    transport = RayObjectRefTransport(cluster.handles, cluster.worker_tiers())
    ...
    cluster.shutdown()

`launch_expert_managers` starts the actors without waiting (they load their experts while the
caller does other work, e.g. the master loading its backbone); `cluster.wait_ready()` then waits.

Actors do not restart (`max_restarts=0`): a dead worker loses its experts'
optimizer state, so recovery belongs to checkpointing, not to Ray.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vela_ray.errors import ClusterError
from actors.workers import ExpertManagerActor
from vela_ray.training.expert_manager import ExpertManagerSpec
from vela_ray.model.traffic import LinkTier, link_tiers

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # set by Ray on every node; pins a bundle to a node


class SpawnConfig(BaseModel):
    """How ExpertManager actors are laid out over the Ray cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per ExpertManager")
    num_gpus_per_worker: Literal[0, 1] = Field(0, description="1: one GPU per ExpertManager (Ray pins it)")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement-group strategy when `workers_per_node` is not set"
    )
    workers_per_node: int | None = Field(
        None, ge=1, description="pin workers to nodes in blocks of this size (worker n on node n // size)"
    )
    master_node: str | None = Field(None, description="node id filled first with `workers_per_node`")
    ready_timeout_s: float = Field(300.0, gt=0, description="how long to wait for resources and actors")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="set in each worker process at start (e.g. actors.transports.data_plane_env)")


@dataclass
class ExpertCluster:
    """Spawned ExpertManagers: `handles[n]` is worker n, running on node `node_ids[n]`."""

    handles: list[Any]
    node_ids: list[str]
    placement_group: PlacementGroup | None  # None without actors (every worker in the master's process)

    def bundle_nodes(self) -> list[str]:
        """The node of each worker's bundle, known once `launch_expert_managers` returns (the bundles are
        reserved), before the actors are up: worker n runs on `bundle_nodes()[n]`."""
        if self.placement_group is None:
            return []
        nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        return [nodes[n] for n in range(len(self.handles))]

    def worker_tiers(self, master_node_id: str | None = None) -> list[LinkTier]:
        """Link tier of each worker from `master_node_id` (default: the caller's node)."""
        master = master_node_id or ray.get_runtime_context().get_node_id()
        return link_tiers(master, self.node_ids)

    def wait_ready(self, timeout_s: float) -> "ExpertCluster":
        """Wait until every actor is up (its experts loaded) and learn its node; shut down and raise
        ClusterError if they are not up within `timeout_s`."""
        try:
            reports = ray.get([h.report.remote() for h in self.handles], timeout=timeout_s)
            self.node_ids = [report.node_id for report in reports]
        except ray.exceptions.GetTimeoutError as exc:
            self.shutdown()
            raise ClusterError(f"ExpertManagers not up after {timeout_s} s; raise "
                               "`ready_timeout_s` if loading the experts is slow") from exc
        logger.info("spawned %d expert workers on %d nodes", len(self.handles), len(set(self.node_ids)))
        return self

    def shutdown(self) -> None:
        """Kill the actors and release their placement group."""
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def spawn_expert_managers(
    specs: Sequence[ExpertManagerSpec], config: SpawnConfig | None = None, **options: Any
) -> ExpertCluster:
    """Start one ExpertManager actor per spec (worker n = specs[n]) and wait until all are up.

    `options` are SpawnConfig fields, for callers without a config object.
    Raises ClusterError when the resources do not appear within `ready_timeout_s`.
    """
    config = config or SpawnConfig(**options)
    return launch_expert_managers(specs, config).wait_ready(config.ready_timeout_s)


def launch_expert_managers(specs: Sequence[ExpertManagerSpec], config: SpawnConfig) -> ExpertCluster:
    """Reserve the bundles and start the actors, without waiting for them to load: the cluster's
    `node_ids` are empty until `wait_ready`."""
    _check_specs(specs, config)
    pg = reserve_bundles(len(specs), config)
    return ExpertCluster([_start_actor(spec, pg, config) for spec in specs], [], pg)


def respawn_expert_managers(cluster: ExpertCluster, specs: Sequence[ExpertManagerSpec],
                            config: SpawnConfig) -> None:
    """Start a new actor for each spec in its worker's bundle (whose resources the dead actor freed),
    in place in `cluster`; the other workers are untouched."""
    for spec in specs:
        ray.kill(cluster.handles[spec.worker], no_restart=True)  # dead already, or hung: make sure
        cluster.handles[spec.worker] = _start_actor(spec, cluster.placement_group, config)
    try:
        nodes = [r.node_id for r in ray.get([cluster.handles[s.worker].report.remote() for s in specs],
                                            timeout=config.ready_timeout_s)]
    except ray.exceptions.GetTimeoutError as exc:
        raise ClusterError(f"replacement ExpertManagers {[s.worker for s in specs]} not up after "
                           f"{config.ready_timeout_s} s") from exc
    for spec, node in zip(specs, nodes):
        cluster.node_ids[spec.worker] = node
    logger.info("replaced expert workers %s", [s.worker for s in specs])


def _start_actor(spec: ExpertManagerSpec, pg: PlacementGroup, config: SpawnConfig) -> Any:
    """ExpertManager `spec.worker` as an actor in bundle `spec.worker` of `pg`."""
    return ray.remote(ExpertManagerActor).options(
        num_cpus=config.num_cpus_per_worker,
        num_gpus=config.num_gpus_per_worker,
        max_restarts=0,
        max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.worker),
        **({"runtime_env": {"env_vars": config.env_vars}} if config.env_vars else {}),
    ).remote(spec)


def _check_specs(specs: Sequence[ExpertManagerSpec], config: SpawnConfig) -> None:
    if not specs:
        raise ValueError("no ExpertManagerSpec given; spawn at least one worker")
    wrong = [n for n, spec in enumerate(specs) if spec.worker != n]
    if wrong:
        raise ValueError(f"specs[n].worker must equal n; specs at positions {wrong[:8]} disagree")
    if config.num_gpus_per_worker == 0 and any(spec.device == "cuda" for spec in specs):
        raise ValueError("specs ask for device 'cuda' but num_gpus_per_worker is 0: set it to 1")


def reserve_bundles(num_workers: int, config: SpawnConfig) -> PlacementGroup:
    """A ready placement group with one bundle per worker (pinned to nodes with `workers_per_node`)."""
    bundle = {"CPU": config.num_cpus_per_worker}
    if config.num_gpus_per_worker:
        bundle["GPU"] = config.num_gpus_per_worker
    bundles = [dict(bundle) for _ in range(num_workers)]
    if config.workers_per_node is None:
        pg = placement_group(bundles, strategy=config.strategy)
    else:
        nodes = _nodes_for(num_workers, config)
        labels = [{NODE_ID_LABEL: nodes[n // config.workers_per_node]} for n in range(num_workers)]
        pg = placement_group(bundles, strategy="PACK", bundle_label_selector=labels)
    if not pg.wait(timeout_seconds=config.ready_timeout_s):
        remove_placement_group(pg)
        layout = config.strategy if config.workers_per_node is None else f"{config.workers_per_node} per node"
        raise ClusterError(
            f"cannot reserve {num_workers} x {bundle} ({layout}) within {config.ready_timeout_s} s; the cluster "
            f"has {ray.available_resources()}: lower num_cpus_per_worker / workers_per_node or add nodes"
        )
    return pg


def _nodes_for(num_workers: int, config: SpawnConfig) -> list[str]:
    """Alive node ids in fill order: the master's node first, then by id."""
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    needed = math.ceil(num_workers / config.workers_per_node)
    if needed > len(alive):
        raise ClusterError(f"{num_workers} workers at workers_per_node={config.workers_per_node} need "
                           f"{needed} nodes but the cluster has {len(alive)}: raise workers_per_node or add nodes")
    if config.master_node is not None:
        if config.master_node not in alive:
            raise ClusterError(f"master_node {config.master_node!r} is not an alive node; alive: {alive}")
        alive.remove(config.master_node)
        alive.insert(0, config.master_node)
    return alive[:needed]
