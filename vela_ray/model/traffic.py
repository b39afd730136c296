"""Traffic counters: rows and bytes per (MoE layer, worker, direction), and per link tier.

The broker records every transfer here as it happens, whatever the transport,
so the counts are what was really moved:

    dispatch       master -> worker   token rows (forward)
    gather         worker -> master   expert outputs (forward)
    grad_dispatch  master -> worker   d(outputs) (backward)
    grad_gather    worker -> master   d(rows) (backward)

Each worker sits on a link tier seen from the master: `same_process`
(in-process shards), `same_node` or `cross_node` (`link_tiers` decides which).

The same counter holds the routing: the (token, k) pairs each expert of each layer was
given (`routed`, counted from the broker's dispatch plan before condensation), which the
step records, the drift tracker and the re-placement read.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

Direction = Literal["dispatch", "gather", "grad_dispatch", "grad_gather"]
DIRECTIONS: tuple[Direction, ...] = ("dispatch", "gather", "grad_dispatch", "grad_gather")
LinkTier = Literal["same_process", "same_node", "cross_node"]
LINK_TIERS: tuple[LinkTier, ...] = ("same_process", "same_node", "cross_node")
RowFormat = Literal["exact", "bfloat16", "float8"]  # how tensors cross a link (`vela_ray.model.wire`)


class TrafficSnapshot(BaseModel):
    """Counts at one moment: `rows`/`bytes` are [num_layers][num_workers][4 directions], `routed`
    [num_layers][num_experts] the (token, k) pairs routed to each expert."""

    model_config = ConfigDict(frozen=True)

    rows: list[list[list[int]]]
    bytes: list[list[list[int]]]
    worker_tiers: list[LinkTier]
    routed: list[list[int]] = []

    @property
    def routed_LE(self) -> np.ndarray:
        return np.asarray(self.routed, dtype=np.int64)

    def bytes_by_tier(self) -> dict[str, int]:
        per_worker = np.asarray(self.bytes, dtype=np.int64).sum(axis=(0, 2))
        return {tier: int(per_worker[[t == tier for t in self.worker_tiers]].sum()) for tier in LINK_TIERS}

    def bytes_by_worker(self, directions: tuple[Direction, ...] = DIRECTIONS) -> list[int]:
        picked = [DIRECTIONS.index(d) for d in directions]
        return np.asarray(self.bytes, dtype=np.int64)[:, :, picked].sum(axis=(0, 2)).tolist()

    def total_bytes(self) -> int:
        return int(np.asarray(self.bytes, dtype=np.int64).sum())

    def __add__(self, other: "TrafficSnapshot") -> "TrafficSnapshot":
        """Counts of both (data-parallel masters' traffic to the same workers), with this one's link tiers."""
        return TrafficSnapshot(
            rows=(np.asarray(self.rows) + np.asarray(other.rows)).tolist(),
            bytes=(np.asarray(self.bytes) + np.asarray(other.bytes)).tolist(),
            worker_tiers=self.worker_tiers,
            routed=(self.routed_LE + other.routed_LE).tolist() if self.routed and other.routed else self.routed,
        )

    def __sub__(self, earlier: "TrafficSnapshot") -> "TrafficSnapshot":
        return TrafficSnapshot(
            rows=(np.asarray(self.rows) - np.asarray(earlier.rows)).tolist(),
            bytes=(np.asarray(self.bytes) - np.asarray(earlier.bytes)).tolist(),
            worker_tiers=self.worker_tiers,
            routed=(self.routed_LE - earlier.routed_LE).tolist() if self.routed and earlier.routed else self.routed,
        )


class TrafficCounter:
    """Accumulates rows and bytes per (layer, worker, direction), and the pairs routed per (layer, expert)
    (with `num_experts`); cheap enough for the hot path."""

    def __init__(self, num_layers: int, num_workers: int, worker_tiers: list[LinkTier] | None = None,
                 num_experts: int = 0):
        self.rows = np.zeros((num_layers, num_workers, len(DIRECTIONS)), dtype=np.int64)
        self.bytes = np.zeros_like(self.rows)
        self.routed = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.worker_tiers: list[LinkTier] = list(worker_tiers or ["same_process"] * num_workers)
        if len(self.worker_tiers) != num_workers:
            raise ValueError(f"worker_tiers has {len(self.worker_tiers)} entries for {num_workers} workers")

    def record(self, layer: int, worker: int, direction: Direction, rows: int, nbytes: int) -> None:
        d = DIRECTIONS.index(direction)
        self.rows[layer, worker, d] += rows
        self.bytes[layer, worker, d] += nbytes

    def route(self, layer: int, expert_R: np.ndarray) -> None:
        """The experts of one forward's routed (token, k) pairs at `layer`."""
        self.routed[layer] += np.bincount(expert_R, minlength=self.routed.shape[1])

    def snapshot(self) -> TrafficSnapshot:
        return TrafficSnapshot(rows=self.rows.tolist(), bytes=self.bytes.tolist(), worker_tiers=self.worker_tiers,
                               routed=self.routed.tolist())

    def reset(self) -> None:
        self.rows[:] = 0
        self.bytes[:] = 0
        self.routed[:] = 0


LOCAL_NODE = "local"
"""The node id of a worker built in this process without Ray (`ExpertManager.report().node_id` outside Ray)."""


def link_tiers(origin_node: str, nodes: Sequence[str], origin_index: int | None = None) -> list[LinkTier]:
    """The link tier from a process on `origin_node` to each process on `nodes`.

    "same_process" for the origin itself (`nodes[origin_index]`, an expert-parallel rank
    seen from its own rank) and for in-process workers (node `LOCAL_NODE`); "same_node"
    for another process on the origin's node; "cross_node" otherwise. The one classifier
    for vela-ray's master -> worker links and for the baseline's rank -> rank links, so
    both systems' traffic is binned the same way.
    """
    return [
        "same_process" if n == origin_index or node == LOCAL_NODE
        else "same_node" if node == origin_node
        else "cross_node"
        for n, node in enumerate(nodes)
    ]
