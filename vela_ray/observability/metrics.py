"""Live training metrics in Prometheus form: expert traffic, routing, load, loss, step time, expert tiers.

The master feeds a `MetricsSink` plain data it already has, once per step:

    sink = MetricsSink(backend)                        # MemoryMetricsBackend() here, RayMetricsBackend() in actors
    sink.set_placement(version=1, expert_to_worker=table, num_workers=3, probs_LE=probs,
                       expected_comm_time_s=0.01)
    sink.record_step(step=1, loss=2.3, step_time_s=0.8, tokens=1024,
                     traffic_delta=after - before,     # TrafficSnapshot of this step
                     expert_counts_LE=counts_LE,       # [L, E] rows routed to each expert
                     drift_L=tv_L)                     # [L] TV distance to the initial profile
    latency = sink.latency                             # the broker: latency.observe(layer, seconds)
    sink.set_method("zo")                              # `training.method`, once
    sink.record_tiers(workers.tier_stats())            # `expert_tiers`: [N] TierCounters (None: untiered)
    sink.record_sequence_moves(record.sequence_moves)  # `masters.sequence_migration`: the step's, all masters

Every metric is declared once in `METRICS` (name, kind, unit in the name, tags);
the Grafana dashboard and its test read the names from there. Ray exports
them through the node's metrics agent (`ray start --metrics-export-port`)
with a `ray_` prefix, e.g. `ray_vela_expert_traffic_bytes_total`, but only from
processes inside a Ray job (driver, actors, tasks).

Backends: `MemoryMetricsBackend` (here) keeps values in dicts, for tests and for
runs outside Ray; `actors.metrics.RayMetricsBackend` wraps `ray.util.metrics`. It
lives with the actors because this side of the code never imports Ray: the runtime
that knows it is inside Ray builds `MetricsSink(RayMetricsBackend())`. Counters are
cumulative, so the sink feeds them deltas and skips zeros (Ray refuses increments <= 0).

Shape legend: L = MoE layers, E = experts per layer, N = workers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Literal, Protocol, Sequence

import numpy as np

from placement.cost import routing_mass
from vela_ray.model.traffic import DIRECTIONS, TrafficSnapshot

if TYPE_CHECKING:
    from vela_ray.training.tiers import TierCounters

MetricKind = Literal["counter", "gauge", "histogram"]
PROMETHEUS_PREFIX = "ray_"  # what Ray's metrics agent puts in front of every application metric

TRAINING_METHODS = ("first_order", "zo")  # `training.method`
# TierCounters fields exported as counters: (counter, tier label or None, field); cumulative on the worker
TIER_COUNTERS = (("vela_tier_rows_total", "cpu", "rows_cpu"), ("vela_tier_rows_total", "device", "rows_device"),
                 ("vela_tier_uploads_total", None, "uploads"), ("vela_tier_upload_bytes_total", None, "upload_bytes"))

# Seconds: 50 us .. 30 s, for one broker round trip (a layer's dispatch + gather on all workers).
ROUND_TRIP_BUCKETS_S = [5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0, 30.0]
# Seconds: 10 ms .. 10 min, for one optimizer step.
STEP_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 600.0]


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its Prometheus name (without Ray's `ray_` prefix), kind, help text and tag keys."""

    name: str
    kind: MetricKind
    description: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


def _specs(*specs: MetricSpec) -> dict[str, MetricSpec]:
    return {s.name: s for s in specs}


METRICS: dict[str, MetricSpec] = _specs(
    MetricSpec("vela_tokens_routed_total", "counter",
               "Token rows the routers sent to each expert (one per (token, top-k slot)).", ("layer", "expert")),
    MetricSpec("vela_expert_traffic_bytes_total", "counter",
               "Bytes between the master and an ExpertManager, by MoE layer, worker, direction and link tier.",
               ("layer", "worker", "direction", "link_tier")),
    MetricSpec("vela_expert_traffic_rows_total", "counter",
               "Token rows between the master and an ExpertManager, by MoE layer, worker and direction.",
               ("layer", "worker", "direction")),
    MetricSpec("vela_broker_round_trip_seconds", "histogram",
               "Seconds one broker call took: dispatch to all owning workers and gather their results.",
               ("layer", "phase"), tuple(ROUND_TRIP_BUCKETS_S)),
    MetricSpec("vela_worker_load_ratio", "gauge",
               "Rows a worker received in the last step over the rows its placement predicted (1: as planned).",
               ("worker",)),
    MetricSpec("vela_worker_experts", "gauge", "Experts the current placement puts on each worker.", ("worker",)),
    MetricSpec("vela_placement_version", "gauge", "Version of the placement in use (1 = first solved placement)."),
    MetricSpec("vela_placement_expected_comm_seconds", "gauge",
               "Communication seconds per step the cost model expects for the current placement."),
    MetricSpec("vela_train_step", "gauge", "Last finished optimizer step."),
    MetricSpec("vela_train_loss", "gauge", "Training loss of the last step."),
    MetricSpec("vela_tokens_per_second", "gauge", "Tokens per second of the last step (non-padding batch tokens / step time)."),
    MetricSpec("vela_step_time_seconds", "gauge", "Wall-clock seconds of the last optimizer step."),
    MetricSpec("vela_step_duration_seconds", "histogram", "Distribution of optimizer step wall-clock seconds.",
               (), tuple(STEP_BUCKETS_S)),
    MetricSpec("vela_locality_drift", "gauge",
               "Total-variation distance between the last step's expert access and the profile placed by.",
               ("layer",)),
    MetricSpec("vela_training_method_info", "gauge",
               "1 for the training method in use (first_order: backward + AdamW; zo: ZO-SGD, two forwards per "
               "step, no backward traffic), 0 for the others.", ("method",)),
    MetricSpec("vela_tier_rows_total", "counter",
               "Expert rows a tiered worker computed on its CPU or its device (expert_tiers, APTMoE).",
               ("worker", "tier")),
    MetricSpec("vela_tier_uploads_total", "counter",
               "Expert weight copies from a tiered worker's host memory into its device cache.", ("worker",)),
    MetricSpec("vela_tier_upload_bytes_total", "counter",
               "Bytes of expert weights a tiered worker uploaded from host memory into its device cache.",
               ("worker",)),
    MetricSpec("vela_tier_predictor_overlap_ratio", "gauge",
               "Accuracy of a tiered worker's next-layer popularity predictor so far: mean demand overlap "
               "(1: the predicted expert shares were exact).", ("worker",)),
    MetricSpec("vela_sequence_migration_bytes_total", "counter",
               "Bytes of hidden states and their gradients the data-parallel masters sent each other when "
               "sequences migrated (masters.sequence_migration), by the link they crossed.", ("link_tier",)),
)


# --- backends -----------------------------------------------------------------------------------


class MetricsBackend(Protocol):
    def inc(self, name: str, value: float, tags: dict[str, str]) -> None: ...
    def set(self, name: str, value: float, tags: dict[str, str]) -> None: ...
    def observe(self, name: str, value: float, tags: dict[str, str]) -> None: ...


TagKey = tuple[tuple[str, str], ...]


def tag_key(tags: dict[str, str]) -> TagKey:
    """A hashable, order-free key for one series' tags (backends store values per series)."""
    return tuple(sorted(tags.items()))


@dataclass
class MemoryMetricsBackend:
    """Keeps every value in memory: counters summed, gauges last set, histograms as observation lists."""

    counters: dict[str, dict[TagKey, float]] = field(default_factory=dict)
    gauges: dict[str, dict[TagKey, float]] = field(default_factory=dict)
    histograms: dict[str, dict[TagKey, list[float]]] = field(default_factory=dict)

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        series = self.counters.setdefault(name, {})
        series[tag_key(tags)] = series.get(tag_key(tags), 0.0) + value

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        self.gauges.setdefault(name, {})[tag_key(tags)] = value

    def observe(self, name: str, value: float, tags: dict[str, str]) -> None:
        self.histograms.setdefault(name, {}).setdefault(tag_key(tags), []).append(value)

    def value(self, name: str, **tags: str) -> float:
        """A counter's total or a gauge's value for exactly these tags (0 if never recorded)."""
        store = self.counters if METRICS[name].kind == "counter" else self.gauges
        return store.get(name, {}).get(tag_key({k: str(v) for k, v in tags.items()}), 0.0)


# --- what the runtime calls -----------------------------------------------------------------------


class LatencyRecorder:
    """Broker round-trip latency per MoE layer: `observe(layer, seconds)` or `with recorder.time(layer):`."""

    def __init__(self, backend: MetricsBackend) -> None:
        self.backend = backend

    def observe(self, layer: int, seconds: float, phase: Literal["forward", "backward"] = "forward") -> None:
        self.backend.observe("vela_broker_round_trip_seconds", seconds, {"layer": str(layer), "phase": phase})

    @contextmanager
    def time(self, layer: int, phase: Literal["forward", "backward"] = "forward") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(layer, time.perf_counter() - start, phase)


class MetricsSink:
    """Turns the master's per-step data into metric updates (see the module docstring for the calls)."""

    def __init__(self, backend: MetricsBackend | None = None) -> None:
        self.backend: MetricsBackend = backend if backend is not None else MemoryMetricsBackend()
        self.latency = LatencyRecorder(self.backend)
        self._row_share_N: np.ndarray | None = None  # expected rows per token on each worker (sum of its P)
        self._tiers_seen: dict[int, dict[str, int]] = {}  # worker -> TierCounters fields last recorded

    def set_method(self, method: str) -> None:
        """Publish `training.method` ("first_order" or "zo"): its info series 1, the other's 0."""
        for known in dict.fromkeys((*TRAINING_METHODS, method)):
            self.backend.set("vela_training_method_info", float(known == method), {"method": known})

    def record_tiers(self, tiers: Sequence[TierCounters | None]) -> None:
        """Record the tiered workers' counters (`ExpertWorkers.tier_stats()`; None: an untiered worker).

        They are cumulative on each worker, so the counters grow by the difference to the last call;
        call it as often as you like (each step, every few). A worker whose counts went down was
        replaced (a recovery) and counts from zero again: all of its counts are new.
        """
        for stats in tiers:
            if stats is None:
                continue
            worker = str(stats.worker)
            seen = self._tiers_seen.get(stats.worker, {})
            now = {field: int(getattr(stats, field)) for _, _, field in TIER_COUNTERS}
            if any(now[field] < seen.get(field, 0) for field in now):
                seen = {}  # a replaced worker
            for name, tier, field in TIER_COUNTERS:
                delta = now[field] - seen.get(field, 0)
                if delta > 0:
                    self.backend.inc(name, float(delta), {"worker": worker, **({"tier": tier} if tier else {})})
            self._tiers_seen[stats.worker] = now
            if stats.predicted_overlap is not None:
                self.backend.set("vela_tier_predictor_overlap_ratio", float(stats.predicted_overlap),
                                 {"worker": worker})

    def set_placement(self, version: int, expert_to_worker: np.ndarray | list, num_workers: int,
                      probs_LE: np.ndarray | None = None, expected_comm_time_s: float | None = None) -> None:
        """Publish a placement: its version, experts per worker, and the row shares load ratios compare with.

        expert_to_worker: [L, E] worker of each expert; num_workers: N, given because a worker may
        hold no expert (the table alone would not show it); probs_LE: [L, E] the access profile it
        was solved for (rows sum to top-k), without it no load ratio is exported;
        expected_comm_time_s: the cost model's communication seconds per step (compute excluded).
        """
        table_LE = np.asarray(expert_to_worker, dtype=np.int64)
        self.backend.set("vela_placement_version", float(version), {})
        for worker, count in enumerate(np.bincount(table_LE.ravel(), minlength=num_workers)):
            self.backend.set("vela_worker_experts", float(count), {"worker": str(worker)})
        if expected_comm_time_s is not None:
            self.backend.set("vela_placement_expected_comm_seconds", float(expected_comm_time_s), {})
        self._row_share_N = None if probs_LE is None else routing_mass(probs_LE, table_LE, num_workers).sum(axis=1)

    def record_step(self, step: int, loss: float, step_time_s: float, tokens: int,
                    traffic_delta: TrafficSnapshot | Sequence[TrafficSnapshot] | None = None,
                    expert_counts_LE: np.ndarray | None = None,
                    drift_L: np.ndarray | None = None,
                    predicted_rows_per_worker: np.ndarray | None = None) -> None:
        """Record one optimizer step.

        tokens: tokens that entered each MoE layer in this step (all micro-batches);
        traffic_delta: the broker's TrafficSnapshot difference over the step; with data-parallel masters,
            one per master, each binned by its own link tiers (a worker on master 1's node is
            `same_node` to master 1's rows and `cross_node` to master 0's);
        expert_counts_LE: [L, E] rows routed to each expert in the step;
        drift_L: [L] TV distance of the step's access to the placed profile;
        predicted_rows_per_worker: [N] rows each worker should receive in the step; default:
        tokens x the worker's share of P from `set_placement`.
        """
        self.backend.set("vela_train_step", float(step), {})
        self.backend.set("vela_train_loss", float(loss), {})
        self.backend.set("vela_step_time_seconds", float(step_time_s), {})
        self.backend.observe("vela_step_duration_seconds", float(step_time_s), {})
        if step_time_s > 0:
            self.backend.set("vela_tokens_per_second", tokens / step_time_s, {})
        if traffic_delta is not None:
            deltas = [traffic_delta] if isinstance(traffic_delta, TrafficSnapshot) else list(traffic_delta)
            for delta in deltas:
                self._record_traffic(delta)
            predicted = predicted_rows_per_worker
            if predicted is None and self._row_share_N is not None:
                predicted = tokens * self._row_share_N
            if predicted is not None:
                self._record_load(sum(deltas[1:], deltas[0]), np.asarray(predicted, dtype=np.float64))
        if expert_counts_LE is not None:
            self._record_routing(np.asarray(expert_counts_LE))
        if drift_L is not None:
            for layer, tv in enumerate(np.asarray(drift_L, dtype=np.float64)):
                self.backend.set("vela_locality_drift", float(tv), {"layer": str(layer)})

    def record_sequence_moves(self, moves: dict[str, int]) -> None:
        """One step's `SequenceMoveStats` summed over the masters: bytes that crossed nodes and the rest."""
        by_tier = {"cross_node": moves["cross_node_bytes"], "same_node": moves["sent_bytes"] - moves["cross_node_bytes"]}
        for tier, size in by_tier.items():
            if size > 0:
                self.backend.inc("vela_sequence_migration_bytes_total", float(size), {"link_tier": tier})

    def _record_traffic(self, delta: TrafficSnapshot) -> None:
        bytes_LND, rows_LND = np.asarray(delta.bytes), np.asarray(delta.rows)
        for layer, worker, d in zip(*np.nonzero(bytes_LND > 0)):
            tags = {"layer": str(layer), "worker": str(worker), "direction": DIRECTIONS[d]}
            self.backend.inc("vela_expert_traffic_bytes_total", float(bytes_LND[layer, worker, d]),
                             {**tags, "link_tier": delta.worker_tiers[worker]})
            if rows_LND[layer, worker, d] > 0:
                self.backend.inc("vela_expert_traffic_rows_total", float(rows_LND[layer, worker, d]), tags)

    def _record_load(self, delta: TrafficSnapshot, predicted_N: np.ndarray) -> None:
        dispatched_N = np.asarray(delta.rows)[:, :, DIRECTIONS.index("dispatch")].sum(axis=0)
        for worker, (measured, predicted) in enumerate(zip(dispatched_N, predicted_N)):
            if predicted > 0:
                self.backend.set("vela_worker_load_ratio", float(measured / predicted), {"worker": str(worker)})

    def _record_routing(self, counts_LE: np.ndarray) -> None:
        for layer, expert in zip(*np.nonzero(counts_LE > 0)):
            self.backend.inc("vela_tokens_routed_total", float(counts_LE[layer, expert]),
                             {"layer": str(layer), "expert": str(expert)})
