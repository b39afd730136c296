"""A tiered ExpertManager's data plane: APTMoE's CPU/device expert tiers (paper §III).

With `expert_tiers.enabled` a worker keeps its experts' frozen weights in host memory (pinned
with CUDA) and at most `cache_experts` of them on its device, and computes each expert of a request
where Eq. 1 says (`vela_ray.training.tiers`). `ExpertManager` calls this (`manager.tiers`) instead of its shard:

    tiered = TieredExperts(shard, prototypes, lora, ExpertTiersConfig(enabled=True), torch.device("cuda"))
    out_RD = tiered.forward_rows(layer, expert_ids_R, rows_RD, key)     # ExpertShard's calls
    grad_RD = tiered.backward_rows(key, grad_out_RD)

Stages of one forward request (one MoE layer of one micro-batch):
  1. rows per hosted expert; the popularity predictor's forecast for this layer is scored against them;
  2. each expert's tier from its rows, the cache's residents and the measured `TierSpeeds` (Eq. 1);
  3. the next layer's demand forecast (`popularity.PopularityPredictor` on these rows) and the cache
     plan (`tiers.upload_order`): this layer's device experts, the next layer's predicted device experts,
     historically popular ones; the copies queue in that order (on CUDA a few at a time on the
     upload stream; the plan re-orders what an earlier one queued);
  4. the CPU experts computed by the host shard while the copies run (the paper's overlap; the device
     part comes second, so its uploads have the CPU's time to land);
  5. the device experts, one by one, each a `LayerExperts` over views of the cache's own tensors that
     shares the host's adapters (`expert_on_device`): no second device copy of the weights, and under
     `expert_cache.DroppedWeights` the graph keeps none of them either (backward fetches them again);
     what a call needs besides the cache is its activations (`working_bytes`, for a device budget);
  6. both tiers' outputs scattered back into request order: one autograd graph, kept by the shard.
Backward keeps the forward's tiers (the routing is known, §III-C 5): the plan uploads this key's device
experts, then those of the layer whose backward comes next; autograd runs both tiers.

LoRA factors, gradients and AdamW stay in host memory (the shard and its `ShardTrainer` are on the
CPU; fp32 in a bf16 model, `experts.adapter_dtype`): device experts read factors copied, and cast to
the weights' dtype, in each call, and gradients flow back through the copy, so one optimizer over host
tensors steps every expert wherever it computed, and results equal an untiered worker's (tests check
forward, input and LoRA gradients to 1e-6 in fp32, bit for bit in bf16).

Left out: offloading the experts' activations. The paper's pipeline stages and their loading of attention and gate
blocks are the master's (`masters.pipeline_stages`, `vela_ray.training.pipeline`; `vela_ray.model.streaming`).

Legend: R = rows of the request, D = hidden size, E = hosted experts of the layer.
"""

from __future__ import annotations

import functools
import logging
import time
from itertools import chain
from typing import Hashable, Mapping

import torch
from torch import nn

from vela_ray.model import wire
from vela_ray.model.experts import (
    ExpertAdapter, ExpertKey, ExpertParams, ExpertShard, LayerExperts, LoraSpec, lora_in_out,
)
from vela_ray.training.expert_cache import DeviceExpertCache, DroppedWeights
from vela_ray.training.popularity import PopularityPredictor, demand_overlap
from vela_ray.training.tiers import (
    ExpertTiersConfig, TierCounters, TierSpeeds, affinity_split, device_working_bytes, historical_order,
    request_seconds_per_row, upload_order,
)

logger = logging.getLogger(__name__)

# the row counts `measure_speeds` times (the profiler's lookup table, `TierSpeeds.cpu_table`): one row, a few, and
# enough to be past launch overheads on a GPU, whose seconds per row also stand for larger calls
PROFILE_ROWS = (1, 16, 256)
_POPULARITY_DECAY = 0.5  # historical popularity: each request of a layer halves its experts' past rows


class TieredExperts:
    """An `ExpertShard` in host memory plus a bounded device cache of its experts (see the module docstring)."""

    def __init__(self, shard: ExpertShard, prototypes: Mapping[int, nn.Module] | nn.Module, lora: LoraSpec,
                 config: ExpertTiersConfig, device: torch.device, worker: int = 0,
                 previous: TieredExperts | None = None):
        """`previous`: the tiers of this worker before a `rehost`, whose speeds, predictor and counters go on."""
        self.shard = shard
        self.prototype_of = (lambda layer: prototypes) if isinstance(prototypes, nn.Module) else prototypes.__getitem__
        self.lora = lora
        self.device = torch.device(device)
        if self.device.type == "cuda":
            pin_frozen_weights(shard)
        self.upload_format = config.upload_format
        self._wire_params: dict[ExpertKey, ExpertParams] = {}  # low-bit uploads: each expert encoded once
        self._host_dtypes: dict[str, torch.dtype] = {}
        self.cache = DeviceExpertCache(self.upload_params, config.cache_experts, self.device,
                                       decode=None if self.upload_format == "exact" else self._decode_upload,
                                       copies_in_flight=config.copies_in_flight if self.device.type == "cuda" else None)
        self.speeds: TierSpeeds | None = previous.speeds if previous else None
        self.predictor: PopularityPredictor | None = previous.predictor if previous else None
        self.counters = previous.stats() if previous else TierCounters(worker=worker)  # the old cache's counts in
        self._plans: dict[Hashable, tuple[int, list[int]]] = {}  # backward key -> (layer, device experts)
        self._forecast: dict[int, torch.Tensor] = {}  # MoE layer -> predicted rows per expert [experts of layer]
        self._popularity: dict[ExpertKey, float] = {}
        self._num_layers = 1 + max((int(layer) for layer in shard.layers), default=0)

    # -- ExpertShard's data-plane calls -------------------------------------------------------

    def forward_rows(self, layer: int, expert_ids_R: torch.Tensor, rows_RD: torch.Tensor,
                     key: Hashable | None = None, adapters: bool = True) -> torch.Tensor:
        if rows_RD.shape[0] == 0 or str(layer) not in self.shard.layers:  # the shard's own answers
            return self.shard.forward_rows(layer, expert_ids_R, rows_RD, key, adapters=adapters)
        experts = self.shard.layers[str(layer)].expert_ids
        rows_E = _rows_per_expert(expert_ids_R, experts)
        self._score_forecast(layer, rows_E)  # 1.
        on_device = self._split(layer, experts, rows_E)  # 2.
        device_experts = _busiest_first(experts, rows_E, on_device)
        self._remember_popularity(layer, experts, rows_E)
        self._plan_uploads(layer, device_experts, rows_RD)  # 3.
        self._count(rows_E, on_device)
        compute = functools.partial(self._compute, layer, device_experts)  # 4.-6.
        out_RD = self.shard.forward_rows(layer, expert_ids_R, rows_RD, key, compute=compute, adapters=adapters)
        if key is not None:
            self._forget_released()
            self._plans[key] = (layer, device_experts)
        return out_RD

    def backward_rows(self, key: Hashable, grad_out_RD: torch.Tensor) -> torch.Tensor:
        layer, device_experts = self._plans.pop(key, (None, []))
        if device_experts:
            following = next((plan[1] for plan in reversed(self._plans.values()) if plan[0] == layer - 1), [])
            self.cache.schedule(upload_order([[(layer, e) for e in device_experts],
                                              [(layer - 1, e) for e in following]], self.cache.capacity))
        return self.shard.backward_rows(key, grad_out_RD)

    # -- decisions -----------------------------------------------------------------------------

    def _split(self, layer: int, experts: list[int], rows_E: list[int]) -> list[bool]:
        resident_E = [self.cache.resident((layer, e)) for e in experts]
        return affinity_split(rows_E, resident_E, self.measured_speeds(), self.cache.capacity)

    def _plan_uploads(self, layer: int, device_experts: list[int], rows_RD: torch.Tensor) -> None:
        """Forecast the next layer and start the cache's copies, most urgent first (demand priority)."""
        upcoming = self._forecast_next(layer, rows_RD)
        self.cache.schedule(upload_order([
            [(layer, e) for e in device_experts],  # inter-expert: needed now
            [(layer + 1, e) for e in upcoming],  # inter-layer: predicted for the next layer
            historical_order(self._popularity, self._num_layers, layer),  # inter-stage: popular lately
        ], self.cache.capacity) if device_experts or upcoming else [])

    def _forecast_next(self, layer: int, rows_RD: torch.Tensor) -> list[int]:
        """The next layer's experts Eq. 1 would put on the device for the predicted demand, busiest first."""
        nxt = layer + 1
        if self.predictor is None or str(nxt) not in self.shard.layers or nxt not in self.predictor.layers():
            return []
        experts = self.shard.layers[str(nxt)].expert_ids
        predicted = self.predictor.predict_rows(nxt, rows_RD.detach())
        self._forecast[nxt] = predicted
        rows_E = predicted[experts].tolist()
        return _busiest_first(experts, rows_E, self._split(nxt, experts, rows_E))

    def _score_forecast(self, layer: int, rows_E: list[int]) -> None:
        predicted = self._forecast.pop(layer, None)
        if predicted is None:
            return
        overlap = demand_overlap(predicted[self.shard.layers[str(layer)].expert_ids], torch.tensor(rows_E))
        if overlap is not None:
            self.counters.predictions += 1
            self.counters.predicted_overlap_sum += overlap

    def _count(self, rows_E: list[int], on_device: list[bool]) -> None:
        counters = self.counters
        for rows, dev in zip(rows_E, on_device):
            if rows:
                counters.experts_device += dev
                counters.experts_cpu += not dev
                counters.rows_device += rows if dev else 0
                counters.rows_cpu += 0 if dev else rows

    # -- compute ------------------------------------------------------------------------------

    def _compute(self, layer: int, device_experts: list[int], expert_ids_R: torch.Tensor,
                 rows_RD: torch.Tensor) -> torch.Tensor:
        """Unweighted outputs [R, D]: CPU experts on the host shard, then the device experts; differentiable."""
        host_layer = self.shard.layers[str(layer)]
        if not device_experts:
            return host_layer(expert_ids_R, rows_RD)
        on_device_R = torch.isin(expert_ids_R, torch.tensor(device_experts, dtype=expert_ids_R.dtype))
        cpu_R, dev_R = (~on_device_R).nonzero().squeeze(1), on_device_R.nonzero().squeeze(1)
        parts = []
        if len(cpu_R):
            parts.append((cpu_R, host_layer(expert_ids_R[cpu_R], rows_RD[cpu_R])))
        parts.append((dev_R, self._device_forward(layer, device_experts, expert_ids_R[dev_R], rows_RD[dev_R])))
        out_RD = parts[0][1].new_zeros(rows_RD.shape[0], parts[0][1].shape[1])
        for index_R, part_RD in parts:
            out_RD = out_RD.index_copy(0, index_R, part_RD)
        return out_RD

    def _device_forward(self, layer: int, experts: list[int], expert_ids_R: torch.Tensor,
                        rows_RD: torch.Tensor) -> torch.Tensor:
        """`experts`' rows through their cached weights on the device, the host adapters shared: each expert
        computes from the cache's own tensors (`expert_on_device`), so no second device copy of the weights is
        made; the graph keeps none of them either (`DroppedWeights`: backward fetches them again)."""
        keys = [(layer, e) for e in experts]
        cached = {key: self.cache.fetch(key, protected=keys) for key in keys}
        hooks = DroppedWeights({(key, name): t for key, params in cached.items() for name, t in params.items()},
                               lambda: {(key, name): t for key in keys
                                        for name, t in self.cache.fetch(key, protected=keys).items()})
        host_layer, prototype = self.shard.layers[str(layer)], self.prototype_of(layer)
        index = {key: (expert_ids_R == key[1]).nonzero().squeeze(1) for key in keys}  # on the host, with the ids
        busy = [key for key in keys if len(index[key])]
        order_R = torch.cat([index[key] for key in busy])
        rows_by_expert = rows_RD[order_R].to(self.device).split([len(index[key]) for key in busy])  # one copy
        factors = factors_on_device([host_layer.adapters[str(key[1])] for key in busy], self.device)  # one copy
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            pieces = [expert_on_device(layer, prototype, key[1], cached[key], self.lora, adapter, host_layer.dtype)(
                          expert_ids_R[index[key]], rows_rD)
                      for key, rows_rD, adapter in zip(busy, rows_by_expert, factors)]
        self.counters.dropped_weights += hooks.dropped
        out_RD = torch.cat(pieces)[torch.argsort(order_R).to(self.device)]  # back into the rows' order
        return out_RD.to(rows_RD.device)

    def working_bytes(self, layer: int, rows: int, experts: int) -> int:
        """Device bytes one call of `rows` rows through `experts` of `layer`'s device experts needs besides
        the cached weights (`tiers.device_working_bytes`): what a device budget must leave the cache."""
        host_layer, prototype = self.shard.layers[str(layer)], self.prototype_of(layer)
        dtype = host_layer.dtype  # what the device computes in (a quantized or low-bit upload is decoded to it)
        in_out = [lora_in_out(prototype, stack) for stack in host_layer.stacks]
        folded = 0 if host_layer.low_rank else experts * sum(  # peft's fold: a folded copy of each expert
            i * o for i, o in in_out) * dtype.itemsize
        return device_working_bytes(rows, in_out, self.lora.r, dtype.itemsize, experts, folded)

    def host_params(self, key: ExpertKey) -> ExpertParams:
        """One expert's frozen tensors in host memory: views of its layer's stacks (pinned with CUDA)."""
        layer_experts = self.shard.layers[str(key[0])]
        local = int(layer_experts.local_of[key[1]])
        module = layer_experts.module
        return {name: t[local] for name, t in chain(module.named_parameters(recurse=False),
                                                    module.named_buffers(recurse=False))}

    def upload_params(self, key: ExpertKey) -> ExpertParams:
        """What an upload of `key` copies: its host tensors, or with a low-bit `upload_format` (LOSSY) their
        wire form (`vela_ray.model.wire`), encoded at the first upload and kept (pinned with CUDA), so
        each later upload moves fewer bytes and costs no encoding."""
        if self.upload_format == "exact":
            return self.host_params(key)
        if key not in self._wire_params:
            host = self.host_params(key)
            self._host_dtypes = {name: t.dtype for name, t in host.items()}  # the same for every expert
            encoded = {name: wire.encode(t, self.upload_format) if t.is_floating_point() else t
                       for name, t in host.items()}
            if self.device.type == "cuda":
                encoded = {name: t if t.is_pinned() else t.pin_memory() for name, t in encoded.items()}
            self._wire_params[key] = encoded
        return self._wire_params[key]

    def weights_changed(self) -> None:
        """The host copies are about to be written (full-parameter ZO): drop every device copy and low-bit form made
        from them (the copies in flight done reading first), so the next uploads carry what was written."""
        self.cache.clear()
        self._wire_params.clear()

    def _decode_upload(self, params: ExpertParams) -> ExpertParams:
        dtypes = self._host_dtypes
        return {name: wire.decode(t, dtypes[name]) if dtypes[name].is_floating_point else t
                for name, t in params.items()}

    # -- bookkeeping ----------------------------------------------------------------------------

    def _remember_popularity(self, layer: int, experts: list[int], rows_E: list[int]) -> None:
        for e, rows in zip(experts, rows_E):
            self._popularity[(layer, e)] = _POPULARITY_DECAY * self._popularity.get((layer, e), 0.0) + rows

    def _forget_released(self) -> None:
        """Drop plans of graphs the shard released without a backward (an abandoned step, `ShardTrainer`)."""
        saved = self.shard._saved  # the shard owns the graphs; a plan lives exactly as long as its graph
        if len(self._plans) > len(saved):
            self._plans = {k: plan for k, plan in self._plans.items() if k in saved}

    def use_speeds(self, speeds: TierSpeeds) -> None:
        """Decide tiers by `speeds` instead of this worker's own measurement (taken at its first request)."""
        self.speeds = speeds

    def use_predictor(self, predictor: PopularityPredictor) -> None:
        """Forecast each next layer's demand with `predictor` (fitted on the master: `popularity`)."""
        self.predictor = predictor

    def request_seconds_per_row(self, layer: int, num_rows: int, num_hosted: int) -> float:
        """Seconds per row of a request of `num_rows` spread over `layer`'s experts, the layer's share of
        the cache resident (of `num_hosted` experts in all), each expert computed where Eq. 1 puts it, from
        the measured `TierSpeeds` (`tiers.request_seconds_per_row`)."""
        experts = len(self.shard.layers[str(layer)].expert_ids)
        cache = self.cache.capacity
        resident = min(experts, experts * cache // num_hosted)  # the layer's share of the cache
        return request_seconds_per_row(self.measured_speeds(), num_rows, experts, resident, cache)

    def measured_speeds(self) -> TierSpeeds:
        if self.speeds is None:
            self.speeds = measure_speeds(self)
            logger.info("tier speeds: %s", self.speeds)
        return self.speeds

    def stats(self) -> TierCounters:
        """The counters so far, the cache's included (and those of caches before a `rehost`)."""
        c, cache = self.counters, self.cache
        return c.model_copy(update=dict(uploads=c.uploads + cache.uploads, cache_hits=c.cache_hits + cache.hits,
                                        upload_bytes=c.upload_bytes + cache.upload_bytes,
                                        evictions=c.evictions + cache.evictions,
                                        copies_dropped=c.copies_dropped + cache.copies_dropped,
                                        demand_jumps=c.demand_jumps + cache.demand_jumps, speeds=self.speeds))


def _busiest_first(experts: list[int], rows_E: list[int], on_device_E: list[bool]) -> list[int]:
    """The device experts, most rows first (the order their uploads are queued in)."""
    return [e for _, e, dev in sorted(zip(rows_E, experts, on_device_E), key=lambda t: -t[0]) if dev]


def _rows_per_expert(expert_ids_R: torch.Tensor, experts: list[int]) -> list[int]:
    """Rows of each of `experts` (global ids within the layer) in the request."""
    counts = torch.bincount(expert_ids_R.cpu(), minlength=max(experts) + 1)
    return counts[experts].tolist()


def expert_on_device(layer: int, prototype: nn.Module, expert: int, params: ExpertParams, lora: LoraSpec,
                     adapter: nn.Module, dtype: torch.dtype | None = None) -> LayerExperts:
    """A `LayerExperts` of one expert whose frozen weights are views of `params` (the cache's tensors, [1, ...]
    each), not a copy, and whose LoRA factors are `adapter`'s: the host shard's `ExpertAdapter`, or its copy
    on the device (`factors_on_device`), so gradients reach the host's factors either way. `dtype`: what it
    computes in (its host layer's: required for quantized stacks, `LayerExperts`)."""
    view = LayerExperts(layer, prototype, {expert: {name: t.new_empty(0) for name, t in params.items()}}, lora,
                        adapters={expert: adapter}, dtype=dtype)  # built over empty tensors on the device: no bytes
    module = view.module
    for name, tensor in params.items():
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(tensor.unsqueeze(0), requires_grad=False)
        else:
            module._buffers[name] = tensor.unsqueeze(0)
    return view


def factors_on_device(adapters: list[ExpertAdapter], device: torch.device) -> list[nn.Module]:
    """The adapters' LoRA factors on `device` in one host-to-device copy (a copy per expert and factor would
    each wait for the device), differentiably: gradients flow back to the host's parameters. Each a module
    with the adapter's factor names as attributes, which is what `LayerExperts` reads of an adapter."""
    named = [list(adapter.named_parameters()) for adapter in adapters]
    flat = torch.cat([p.reshape(-1) for params in named for _, p in params]).to(device)
    pieces = iter(flat.split([p.numel() for params in named for _, p in params]))
    copies = []
    for params in named:
        copy = nn.Module()
        for name, p in params:
            copy.__dict__[name] = next(pieces).view(p.shape)  # a plain attribute: not a parameter of its own
        copies.append(copy)
    return copies


def pin_frozen_weights(shard: ExpertShard) -> None:
    """Move the shard's frozen expert stacks into page-locked host memory, so uploads run asynchronously
    (from pageable memory a copy is staged through a pinned buffer and blocks the host)."""
    for layer_experts in shard.layers.values():
        module = layer_experts.module
        for name, param in list(module._parameters.items()):
            if param is not None and not param.is_pinned():
                module._parameters[name] = nn.Parameter(param.detach().pin_memory(), requires_grad=False)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not buffer.is_pinned():
                module._buffers[name] = buffer.pin_memory()


def seconds_per_row(layer_experts: LayerExperts, expert: int, num_rows: int, repeats: int = 3) -> float:
    """Wall seconds of one row's forward + backward through `expert` of `layer_experts`, best of `repeats`,
    on the device of its weights. Random rows; gradients are returned, not accumulated, so training
    state is untouched. Grad mode is on whatever the caller's: a tiered worker first measures inside a
    request, which may be a no-grad forward (eval, ZO), an inference-mode one (the routing profile: grad
    cannot be turned back on inside it, only inference mode off) or the broker's autograd Function."""
    with torch.inference_mode(False), torch.enable_grad():
        return _seconds_per_row(layer_experts, expert, num_rows, repeats)


def _seconds_per_row(layer_experts: LayerExperts, expert: int, num_rows: int, repeats: int) -> float:
    device = layer_experts.local_of.device
    dtype = layer_experts.dtype
    ids_R = torch.full((num_rows,), expert, dtype=torch.long)  # on the host, as the broker sends them
    rows_RD = torch.randn(num_rows, layer_experts.hidden_size, dtype=dtype, device=device, requires_grad=True)
    timings = []
    for _ in range(repeats + 1):  # the first call warms kernels and the allocator
        start = time.perf_counter()
        out_RD = layer_experts(ids_R, rows_RD)
        torch.autograd.grad(out_RD, [rows_RD, *layer_experts.adapters[str(expert)].parameters()],
                            torch.ones_like(out_RD))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - start)
    return min(timings[1:]) / num_rows


def measure_speeds(tiered: TieredExperts, profile_rows: tuple[int, ...] = PROFILE_ROWS, repeats: int = 3
                   ) -> TierSpeeds:
    """The worker's `TierSpeeds`, timed on its first hosted expert: the profiler's lookup table of CPU and device
    seconds per call at each of `profile_rows` (and the largest count's seconds per row), and the host-to-device
    rate of one expert's upload from pinned memory. Without CUDA the device figures are None, so every expert
    computes on the CPU. With a low-bit `upload_format` an upload is the wire form's copy and its decoding, and
    moves the wire form's bytes."""
    layer_name, host_layer = next(iter(tiered.shard.layers.items()))
    layer, expert = int(layer_name), host_layer.expert_ids[0]
    host = tiered.upload_params((layer, expert))
    expert_bytes = sum(t.numel() * t.element_size() for t in host.values())
    cpu_table = profile_table(host_layer, expert, profile_rows, repeats)
    cpu = {"cpu_s_per_row": cpu_table[-1][1] / cpu_table[-1][0], "cpu_table": cpu_table}
    if tiered.device.type != "cuda":
        return TierSpeeds(**cpu, bytes_per_expert=expert_bytes)
    copies = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        params = {name: t.to(tiered.device, non_blocking=True) for name, t in host.items()}
        params = tiered.cache.decode(params) if tiered.cache.decode else params
        torch.cuda.synchronize(tiered.device)
        copies.append(time.perf_counter() - start)
    view = expert_on_device(layer, tiered.prototype_of(layer), expert, params, tiered.lora,
                            host_layer.adapters[str(expert)], host_layer.dtype)
    device_table = profile_table(view, expert, profile_rows, repeats)
    return TierSpeeds(**cpu, device_s_per_row=device_table[-1][1] / device_table[-1][0], device_table=device_table,
                      upload_bytes_per_s=expert_bytes / min(copies[1:]), bytes_per_expert=expert_bytes)


def profile_table(layer_experts: LayerExperts, expert: int, profile_rows: tuple[int, ...], repeats: int
                  ) -> tuple[tuple[int, float], ...]:
    """(rows, seconds of one call) at each of `profile_rows`, ascending; a timing below a smaller count's (noise)
    is raised to it, so that more rows never cost less (`TierSpeeds` requires it)."""
    table, floor = [], 0.0
    for rows in sorted(profile_rows):
        floor = max(floor, seconds_per_row(layer_experts, expert, rows, repeats) * rows)
        table.append((rows, floor))
    return tuple(table)
