"""APTMoE's affinity-aware CPU/GPU expert tiers (paper §III), as policies: numbers in, decisions out.

A tiered ExpertManager (`vela_ray.training.tiered`) keeps its experts' frozen weights in host memory and
at most `cache_experts` of them on its device. For every request (one MoE layer of one micro-batch)
these functions decide, and the manager carries the decisions out:

    speeds = TierSpeeds(cpu_s_per_row=2e-5, device_s_per_row=1e-7, upload_bytes_per_s=2.5e10,
                        bytes_per_expert=2**20)
    on_device_E = affinity_split(rows_E, resident_E, speeds, max_device=8)     # Eq. 1: CPU or device
    order = upload_order([now, next_layer_predicted, historically_popular], capacity=8)

- `affinity_split`: which experts compute on the CPU and which on the device (§III-C, Eq. 1): the
  CPU computes the low-intensity experts while the host-to-device link loads the high-intensity ones.
- `upload_order`: what the device cache should hold, most urgent first (demand-priority scheduling,
  §III-D): this layer's device experts, then the next layer's predicted ones, then historically
  popular ones (`historical_order`).

No torch here (`vela_ray.config` reads `ExpertTiersConfig` without it), so tests can brute-force
the rule on small instances. Legend: E = the hosted experts of one MoE layer, in the caller's order.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Hashable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vela_ray.model.traffic import RowFormat


class ExpertTiersConfig(BaseModel):
    """`expert_tiers`: APTMoE's CPU/device expert tiers on every ExpertManager."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        False, description="keep each worker's frozen expert weights in host memory (pinned with CUDA) and compute "
                           "each expert of a request on the CPU or on the worker's device as APTMoE's Eq. 1 decides, "
                           "uploading into a bounded device cache; false: every expert lives on the device")
    cache_experts: int = Field(
        8, ge=1, description="experts whose frozen weights the worker's device holds at once (the cache); also the "
                             "most experts one request computes on the device")
    upload_format: RowFormat = Field(
        "exact", description="how frozen expert weights travel from host to device cache: exact, or LOSSY "
                             "bfloat16 / float8 (e4m3, a scale per row; ZO-Offloading §5.4): fewer upload bytes, and "
                             "device experts compute with the rounded weights while CPU experts keep the exact ones")
    copies_in_flight: int = Field(
        2, ge=1, description="prefetch copies handed to the device's copy stream at once; the rest of a plan waits in "
                             "a host queue that each new plan re-orders and a demand jumps (APTMoE's demand-priority "
                             "scheduling); two keep the link busy between copies. CUDA only: on the CPU the cache's "
                             "copies are made as they are planned")


class TierSpeeds(BaseModel):
    """What Eq. 1 weighs, measured on the worker (`vela_ray.training.tiered.measure_speeds`).

    The static profiler's lookup table (§III-B): a call's seconds at a few row counts per tier
    (`cpu_table`, `device_table`), interpolated between them, since a few rows cost the CPU more per
    row than many (they do not saturate its cores, §II-C 3); past the last count, that count's seconds
    per row. Without a table a tier's time is linear in rows (`cpu_s_per_row`, `device_s_per_row`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_s_per_row: float = Field(gt=0, description="CPU seconds of one row's forward + backward through an expert")
    device_s_per_row: float | None = Field(None, gt=0, description="the same on the device; None without one")
    upload_bytes_per_s: float | None = Field(None, gt=0, description="host-to-device copy rate; None without a device")
    bytes_per_expert: int = Field(ge=0, description="frozen weight bytes one expert upload moves")
    cpu_table: tuple[tuple[int, float], ...] = Field(
        (), description="(rows, CPU seconds of one expert's forward + backward over that many rows), rows ascending: "
                        "the profiler's lookup table; empty: rows x cpu_s_per_row")
    device_table: tuple[tuple[int, float], ...] = Field((), description="the same on the device")

    @field_validator("cpu_table", "device_table")
    @classmethod
    def _ascending(cls, table: tuple[tuple[int, float], ...], info) -> tuple[tuple[int, float], ...]:
        """Rows and seconds both ascending: a costlier call for fewer rows would make Eq. 1's split by rows inexact."""
        if any(r1 <= r0 or t1 < t0 for (r0, t0), (r1, t1) in zip(table, table[1:])) or any(r < 1 for r, _ in table):
            raise ValueError(f"{info.field_name}: rows must ascend from 1 and seconds must not fall; got {table}")
        return table

    @property
    def has_device(self) -> bool:
        """Whether there is a device tier to send experts to (a worker without CUDA has none)."""
        return self.device_s_per_row is not None and self.upload_bytes_per_s is not None

    def cpu_seconds(self, rows: float) -> float:
        """Seconds the CPU computes one expert's `rows` (forward + backward)."""
        return _looked_up(self.cpu_table, rows, self.cpu_s_per_row)

    def device_seconds(self, rows: float) -> float:
        """Seconds the device computes one expert's `rows`; infinite without a device tier."""
        return _looked_up(self.device_table, rows, self.device_s_per_row) if self.has_device else float("inf")

    def load_seconds(self) -> float:
        """Seconds to upload one expert's frozen weights (Eq. 1's Load_expert)."""
        return self.bytes_per_expert / self.upload_bytes_per_s if self.upload_bytes_per_s else float("inf")


def _looked_up(table: Sequence[tuple[int, float]], rows: float, s_per_row: float) -> float:
    """A call's seconds for `rows` from a profiler `table` (linear between its points, from (0, 0) to its first,
    at its last point's seconds per row past it), or `rows` x `s_per_row` without one."""
    if rows <= 0:
        return 0.0
    if not table:
        return rows * s_per_row
    last_rows, last_s = table[-1]
    if rows >= last_rows:
        return last_s * rows / last_rows
    points = [(0, 0.0), *table]
    i = bisect_left([r for r, _ in points], rows)
    (r0, t0), (r1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)


def affinity_split(rows_E: Sequence[int], resident_E: Sequence[bool], speeds: TierSpeeds, max_device: int,
                   fixed_load_s: float = 0.0) -> list[bool]:
    """Eq. 1: [E] True where an expert of this request computes on the device, False on the CPU.

    rows_E: [E] rows routed to each expert; resident_E: [E] whether its weights are in the device cache;
    max_device: most experts on the device at once (the cache's capacity); fixed_load_s: the rest of
    Eq. 1's denominator (the paper's Load_MHA + Load_Gate; 0 on an ExpertManager, which loads neither).

    The paper loads experts from the highest intensity (rows) down while
    R = sum_CPU(low..high) cpu_time / (fixed + sum_loaded(high..low) load_time) > 1, i.e. while the CPU's
    share of the work outlasts the loads that run beside it; the split minimises the step's critical path
    max(CPU time of the CPU experts, load time of the device experts), the GPU's compute being taken as
    shorter than its loads (the paper's assumption). Where the paper is silent we chose:
    - which side of R = 1 to stop on: the one with the smaller max(numerator, denominator);
    - cached experts cost no load (the paper's inter-stage phase preloads them but Eq. 1 does not say):
      with room, every cached expert with rows computes on the device, as it only shortens the CPU's share;
    - the device holds at most `max_device` experts: with the cap binding, all ways of filling it with
      the top cached and top uncached experts are weighed. The result is the exact minimum of the
      critical path over all subsets of at most `max_device` experts (a test brute-forces it).
    Experts without rows stay on the CPU (nothing to compute); without a device tier all do.
    """
    on_device = [False] * len(rows_E)
    if not speeds.has_device or max_device <= 0:
        return on_device
    # 1. the candidates, most intensive first: cached ones (free) and uncached ones (one load each)
    active = [e for e, rows in enumerate(rows_E) if rows > 0]
    cached = sorted((e for e in active if resident_E[e]), key=lambda e: -rows_E[e])
    uncached = sorted((e for e in active if not resident_E[e]), key=lambda e: -rows_E[e])
    cpu_all = sum(speeds.cpu_seconds(rows_E[e]) for e in active)
    cached_s = [0.0, *accumulate(speeds.cpu_seconds(rows_E[e]) for e in cached)]  # CPU time the top k free
    uncached_s = [0.0, *accumulate(speeds.cpu_seconds(rows_E[e]) for e in uncached)]
    # 2. for each number of loads j (Eq. 1's sum from high to low), the cached experts that still fit
    best: tuple[float, int, int] | None = None
    for loads in range(min(max_device, len(uncached)) + 1):
        kept = min(max_device - loads, len(cached))
        cpu_s = cpu_all - cached_s[kept] - uncached_s[loads]  # Eq. 1's numerator
        critical = max(cpu_s, fixed_load_s + loads * speeds.load_seconds())  # vs its denominator
        if best is None or critical < best[0]:  # ties: fewer loads
            best = (critical, loads, kept)
    # 3. the winning split
    _, loads, kept = best
    for e in cached[:kept] + uncached[:loads]:
        on_device[e] = True
    return on_device


def critical_path_s(rows_E: Sequence[int], resident_E: Sequence[bool], on_device_E: Sequence[bool],
                    speeds: TierSpeeds, fixed_load_s: float = 0.0) -> float:
    """What `affinity_split` minimises: max(CPU seconds of the CPU experts, fixed + loads of uncached device
    experts)."""
    cpu_s = sum(speeds.cpu_seconds(r) for r, dev in zip(rows_E, on_device_E) if not dev)
    loads = sum(1 for res, dev in zip(resident_E, on_device_E) if dev and not res)
    return max(cpu_s, fixed_load_s + (loads * speeds.load_seconds() if loads else 0.0))


def request_seconds_per_row(speeds: TierSpeeds, num_rows: int, num_experts: int, resident: int,
                            max_device: int) -> float:
    """Seconds per row of a request of `num_rows` rows spread evenly over `num_experts` experts, of which
    `resident` are in the device cache, computed where Eq. 1 puts them: the critical path (CPU experts
    against uploads) plus the device's compute of its rows. What a tiered worker costs the placement's
    compute-aware model per row (`placement.cost_model: communication+compute`); without a device tier,
    the CPU's seconds per row."""
    if num_rows <= 0 or num_experts <= 0:
        return speeds.cpu_s_per_row
    rows_E = [num_rows // num_experts + (e < num_rows % num_experts) for e in range(num_experts)]
    resident_E = [e < resident for e in range(num_experts)]
    on_device = affinity_split(rows_E, resident_E, speeds, max_device)
    device_s = sum(speeds.device_seconds(r) for r, dev in zip(rows_E, on_device) if dev)
    return (critical_path_s(rows_E, resident_E, on_device, speeds) + device_s) / num_rows


def device_working_bytes(rows: int, stacks: Sequence[tuple[int, int]], rank: int, element_size: int,
                         experts: int = 1, folded_bytes: int = 0) -> int:
    """Device bytes a tiered worker's device call of `rows` rows needs besides the cached weights, which it
    computes from in place (`tiered.TieredExperts._device_forward`): what a budget of device memory must
    leave beside the cache (`benchmarks/big_on_one_gpu.py`: the largest call is a whole layer's routed rows).

    `stacks`: (in, out) features of each weight stack one row goes through (Mixtral: (D, 2I), (I, D));
    `rank`: LoRA r; `element_size`: bytes per element of the weights' dtype. Per row and stack: its input
    twice (the rows as moved, then their gradient), its output, kept for backward with the LoRA intermediate,
    and two more outputs' worth of temporaries (the LoRA product, scaled and summed in forward; gradients in
    backward). Each of the call's `experts` adds its LoRA factors, copied from the host in fp32 and cast to
    the weights' dtype. On the tiny Mixtral the tensors alive at once peak at 0.73 of this
    (tests/unit/test_tiers.py); Mixtral-8x7B in bf16 at r=8: 270 KB a row and 2.5 MB an expert, 1.13 GB for
    a layer's 4 x 512 tokens routed to 2 of its 8 experts each. `folded_bytes`: a family that folds LoRA into
    the weights (peft's fold, not the low-rank path) makes a folded copy of each of the call's experts
    (`TieredExperts.working_bytes`)."""
    per_row = sum(2 * fan_in + 3 * fan_out + 2 * rank for fan_in, fan_out in stacks)
    factors = experts * rank * sum(fan_in + fan_out for fan_in, fan_out in stacks) * (4 + element_size)
    return rows * element_size * per_row + factors + folded_bytes


def upload_order(queues: Sequence[Sequence[Hashable]], capacity: int) -> list[Hashable]:
    """The experts the device cache should hold, most urgent first: the queues in priority order (the
    paper's inter-expert, inter-layer and inter-stage queues: this layer's device experts, the next
    layer's predicted ones, historically popular ones), each already sorted by demand, an expert
    counted at its first (most urgent) place, cut at `capacity`.

    The cache keeps these and evicts the least recently used of the others to make room
    (`vela_ray.training.expert_cache.DeviceExpertCache`), so an urgent upload never evicts a more
    urgent expert. As the paper does, copies wait in a host queue that each request's plan re-orders, a few
    at a time on the link (`ExpertTiersConfig.copies_in_flight`), and a demand no plan foresaw jumps the queue
    onto a high-priority stream (`DeviceExpertCache.schedule`, `fetch`).
    """
    order: list[Hashable] = []
    seen: set[Hashable] = set()
    for queue in queues:
        for key in queue:
            if len(order) == capacity:
                return order
            if key not in seen:
                seen.add(key)
                order.append(key)
    return order


def historical_order(scores: dict[tuple[int, int], float], num_layers: int, start_layer: int) -> list[tuple[int, int]]:
    """The inter-stage queue (§III-C 2): experts by historical popularity, each layer's top-ranked first,
    then each layer's second, and so on; within a rank, layers in the order they come next after
    `start_layer` (cyclic), so the soonest needed go first. `scores`: {(layer, expert): recent rows};
    experts with no rows are left out."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for key, score in sorted(scores.items(), key=lambda kv: -kv[1]):
        if score > 0:
            by_layer.setdefault(key[0], []).append(key)
    layers = [(start_layer + 1 + i) % max(num_layers, 1) for i in range(max(num_layers, 1))]
    depth = max((len(v) for v in by_layer.values()), default=0)
    return [by_layer[layer][rank] for rank in range(depth) for layer in layers
            if layer in by_layer and rank < len(by_layer[layer])]


class TierCounters(BaseModel):
    """What a tiered worker did (`ExpertManager.report().tiers`), over its lifetime."""

    model_config = ConfigDict(extra="forbid")

    worker: int = 0
    experts_cpu: int = 0
    """Experts computed on the CPU, counted once per request they had rows in."""
    experts_device: int = 0
    """The same on the device."""
    rows_cpu: int = 0
    rows_device: int = 0
    uploads: int = 0
    """Expert weight copies from host to device (forward, prefetch and backward re-loads)."""
    upload_bytes: int = 0
    cache_hits: int = 0
    """Device experts found already resident when a computation needed them."""
    evictions: int = 0
    copies_dropped: int = 0
    """Queued copies a later plan no longer wanted, dropped before they were made (CUDA's host queue)."""
    demand_jumps: int = 0
    """Queued copies a computation needed before their turn, made at once on the high-priority stream."""
    dropped_weights: int = 0
    """Frozen weights the forward graphs did not keep on the device (re-read from the cache in backward)."""
    predictions: int = 0
    """Next-layer demands the popularity predictor forecast and the next request checked."""
    predicted_overlap_sum: float = 0.0
    """Sum over those of the demand overlap, sum_e min(predicted share_e, real share_e) (1: exact)."""
    speeds: TierSpeeds | None = None

    @property
    def predicted_overlap(self) -> float | None:
        """Mean demand overlap of the popularity predictor; None before any prediction was checked."""
        return self.predicted_overlap_sum / self.predictions if self.predictions else None
