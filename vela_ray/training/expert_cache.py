"""The device tier of a tiered ExpertManager: a bounded cache of experts' frozen weights, copied from host.

    cache = DeviceExpertCache(host_params, capacity=8, device=torch.device("cuda"))
    cache.schedule([(0, 3), (0, 5), (1, 2)])     # start the copies, most urgent first (prefetch)
    params = cache.fetch((0, 3))                 # ready on the current stream: {parameter: [..]}

- Host weights are pinned by the caller (`vela_ray.training.tiered`), so on CUDA the copies run on a
  stream of their own and overlap the CPU's experts and the device's compute; a CUDA event per expert
  tells the compute stream when its weights have landed. Demand-priority scheduling (APTMoE §III-D): a
  copy the computation needs now (a miss in `fetch`: the real gate chose an expert no plan foresaw) goes
  on a second, high-priority stream instead of queueing behind the prefetches already issued, which a
  stream cannot re-order; the two share the link rather than the demand waiting for the whole queue. On the
  CPU the "device" is the CPU: the copies are clones, so the same code path, counters and evictions run in
  tests.
- Eviction: at most `capacity` experts; room is made by evicting the least recently used expert outside
  the latest plan (`schedule`), failing that the least recently used one of the plan, never one the
  caller has in use (`fetch(..., protected=...)`). A plan never exceeds the capacity, so its own
  copies never evict each other.
- Low-bit uploads (`expert_tiers.upload_format`, LOSSY): `host_params` gives the weights in a
  wire form of fewer bytes (`vela_ray.model.wire`) and `decode` restores them on the device, so the
  link carries half (bf16) or about a quarter (fp8) of the bytes; `upload_bytes` counts what crossed.
- `DroppedWeights`: saved-tensor hooks for a forward graph that keep no device copy of the frozen
  weights between forward and backward: the device holds only the cache's experts, not every expert
  whose graph waits for its backward; backward fetches them again (a hit when prefetched).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable

import torch

from vela_ray.model.experts import ExpertKey, ExpertParams


class DeviceExpertCache:
    """At most `capacity` experts' frozen weights on `device`, copied from `host_params(key)`."""

    def __init__(self, host_params: Callable[[ExpertKey], ExpertParams], capacity: int, device: torch.device,
                 decode: Callable[[ExpertParams], ExpertParams] | None = None):
        """`decode`: the weights from `host_params`'s wire form, on the device (None: they are as they are)."""
        if capacity < 1:
            raise ValueError(f"the device cache must hold at least one expert, got capacity {capacity}")
        self.host_params = host_params
        self.capacity = capacity
        self.device = device
        self.decode = decode
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # prefetches, in plan order
        # a demand's copy, ahead of the queued prefetches (the highest priority CUDA gives a stream)
        self.demand_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._entries: OrderedDict[ExpertKey, tuple[ExpertParams, torch.cuda.Event | None]] = OrderedDict()
        self._wanted: set[ExpertKey] = set()
        self.uploads = self.upload_bytes = self.hits = self.evictions = 0

    def resident(self, key: ExpertKey) -> bool:
        return key in self._entries

    def keys(self) -> list[ExpertKey]:
        """Resident experts, least recently used first."""
        return list(self._entries)

    def schedule(self, order: Iterable[ExpertKey]) -> None:
        """Make `order` (at most `capacity`, most urgent first) resident: copy the missing ones in that order,
        asynchronously on CUDA. `order` is the plan the evictions respect until the next call."""
        order = list(order)[:self.capacity]
        self._wanted = set(order)
        for key in order:
            if key not in self._entries:
                self._upload(key, in_use=set())

    def fetch(self, key: ExpertKey, protected: Iterable[ExpertKey] = ()) -> ExpertParams:
        """`key`'s weights on the device, usable on the current stream; copied now on a miss, which never
        evicts the experts in `protected` (those the caller is using)."""
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
        else:
            self._upload(key, in_use=set(protected), stream=self.demand_stream)
        params, ready = self._entries[key]
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for tensor in params.values():
                tensor.record_stream(stream)  # freed on eviction only once this stream is done with it
        return params

    def clear(self) -> None:
        """Drop every device copy, once the copies in flight have read their host bytes (which the caller may
        write next: full-parameter ZO)."""
        for stream in (self.stream, self.demand_stream):
            if stream is not None:
                stream.synchronize()
        self._entries.clear()
        self._wanted = set()

    def _upload(self, key: ExpertKey, in_use: set[ExpertKey], stream: torch.cuda.Stream | None = None) -> None:
        """Copy `key` in, on `stream` (None: the prefetch stream)."""
        self._make_room(in_use | {key})
        host = self.host_params(key)
        stream = stream or self.stream
        if stream is None:
            params = self.decode(host) if self.decode else {name: t.clone() for name, t in host.items()}
            ready = None
        else:
            with torch.cuda.stream(stream):  # allocated on, and copied by, that upload stream
                params = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
                params = self.decode(params) if self.decode else params
                ready = torch.cuda.Event()
                ready.record(stream)
        self._entries[key] = (params, ready)
        self.uploads += 1
        self.upload_bytes += sum(t.numel() * t.element_size() for t in host.values())

    def _make_room(self, in_use: set[ExpertKey]) -> None:
        """Evict the least recently used expert outside the plan, failing that the least recently used of
        the plan, never one `in_use`, until there is room for one more."""
        while len(self._entries) >= self.capacity:
            victim = next((k for k in self._entries if k not in self._wanted and k not in in_use), None)
            if victim is None:
                victim = next((k for k in self._entries if k not in in_use), None)
            if victim is None:
                raise RuntimeError(f"the device cache of {self.capacity} experts is full of experts in use "
                                   f"({list(self._entries)}); raise expert_tiers.cache_experts")
            del self._entries[victim]
            self.evictions += 1


class DroppedWeights:
    """Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)`) around one
    device computation: a saved tensor that is a view of one of `stacks` (the cache's frozen weights the
    computation reads, by any hashable name, e.g. ((layer, expert), parameter)) is kept as (name, size,
    stride, offset); backward fetches them again with `restack()` once, at the first such tensor it unpacks,
    and takes the same views of them. Frozen weights only: they do not change between forward and backward,
    so the views hold the same numbers, and the graph does not keep an evicted expert's weights alive."""

    def __init__(self, stacks: dict[Hashable, torch.Tensor], restack: Callable[[], dict[Hashable, torch.Tensor]]):
        self._names = {t.untyped_storage().data_ptr(): name for name, t in stacks.items()}
        self._restack = restack
        self._rebuilt: dict[Hashable, torch.Tensor] = {}
        self.dropped = 0

    def pack(self, tensor: torch.Tensor):
        if tensor.requires_grad or tensor.layout != torch.strided:
            return tensor
        name = self._names.get(tensor.untyped_storage().data_ptr())
        if name is None:
            return tensor
        self.dropped += 1
        return name, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        name, size, stride, offset = packed
        if not self._rebuilt:
            self._rebuilt = self._restack()
        return self._rebuilt[name].as_strided(size, stride, offset)

