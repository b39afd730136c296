"""The device tier of a tiered ExpertManager: a bounded cache of experts' frozen weights, copied from host.

    cache = DeviceExpertCache(host_params, capacity=8, device=torch.device("cuda"), copies_in_flight=2)
    cache.schedule([(0, 3), (0, 5), (1, 2)])     # queue the copies, most urgent first (prefetch)
    params = cache.fetch((0, 3))                 # ready on the current stream: {parameter: [..]}

- Host weights are pinned by the caller (`vela_ray.training.tiered`), so on CUDA the copies run on a
  stream of their own and overlap the CPU's experts and the device's compute; a CUDA event per expert
  tells the compute stream when its weights have landed. On the CPU the "device" is the CPU: the copies
  are clones, so the same code paths, counters and evictions run in tests.
- Demand-priority scheduling (APTMoE §III-D). A stream cannot re-order work it has been given, so a plan's
  copies wait in a host queue and a feeder thread hands them to the prefetch stream `copies_in_flight` at
  a time (two keep the link busy between copies), taking the queue's head at the last moment. Each plan
  re-orders the queue: what it no longer wants is never copied (`copies_dropped`), the rest goes in its
  new order. A copy the computation needs now (`fetch`: the real gate chose it) jumps the queue
  (`demand_jumps`) onto a second, high-priority stream, which shares the link with the prefetches
  already handed over instead of waiting behind them. Without a queue (`copies_in_flight=None`)
  `schedule` makes, or on CUDA issues, a plan's copies itself.
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

import logging
import threading
from collections import OrderedDict, deque
from typing import Callable, Hashable, Iterable

import torch

from vela_ray.model.experts import ExpertKey, ExpertParams

logger = logging.getLogger(__name__)


class DeviceExpertCache:
    """At most `capacity` experts' frozen weights on `device`, copied from `host_params(key)`."""

    def __init__(self, host_params: Callable[[ExpertKey], ExpertParams], capacity: int, device: torch.device,
                 decode: Callable[[ExpertParams], ExpertParams] | None = None, copies_in_flight: int | None = None):
        """`decode`: the weights from `host_params`'s wire form, on the device (None: they are as they are).
        `copies_in_flight`: prefetches handed to the link at once by a feeder thread, the rest of a plan waiting
        in the host queue that each plan re-orders (None: a plan's copies are all made, or on CUDA all issued,
        by `schedule` itself)."""
        if capacity < 1:
            raise ValueError(f"the device cache must hold at least one expert, got capacity {capacity}")
        if copies_in_flight is not None and copies_in_flight < 1:
            raise ValueError(f"copies_in_flight must be at least 1 (or None), got {copies_in_flight}")
        self.host_params = host_params
        self.capacity = capacity
        self.device = device
        self.decode = decode
        self.copies_in_flight = copies_in_flight
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # prefetches, in plan order
        # a demand's copy, ahead of the queued prefetches (the highest priority CUDA gives a stream)
        self.demand_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._entries: OrderedDict[ExpertKey, tuple[ExpertParams, torch.cuda.Event | None]] = OrderedDict()
        self._wanted: set[ExpertKey] = set()
        self._queued: list[ExpertKey] = []  # planned, not handed to the link yet: most urgent first
        self._copying: set[ExpertKey] = set()  # taken by the feeder, not landed in `_entries` yet
        self._issued: deque[torch.cuda.Event] = deque()  # CUDA: the feeder's copies the link may still be moving
        self._feeder: threading.Thread | None = None
        self._lock = threading.Condition()
        self.uploads = self.upload_bytes = self.hits = self.evictions = 0
        self.copies_dropped = 0  # queued copies a later plan dropped before they were made: bytes never moved
        self.demand_jumps = 0  # queued copies a computation needed first: made at once, ahead of the queue
        self.copy_log: deque[ExpertKey] = deque(maxlen=256)  # the latest copies, in the order they were handed over

    def resident(self, key: ExpertKey) -> bool:
        return key in self._entries

    def keys(self) -> list[ExpertKey]:
        """Resident experts, least recently used first."""
        return list(self._entries)

    def schedule(self, order: Iterable[ExpertKey]) -> None:
        """Make `order` (at most `capacity`, most urgent first) resident: copy the missing ones in that order,
        asynchronously on CUDA. `order` is the plan the evictions respect until the next call. With a host
        queue (`copies_in_flight`) the plan replaces the queue: copies an earlier plan queued and this one does
        not want are never made, the others take their place in this order (APTMoE §III-D's re-ordering)."""
        order = list(order)[:self.capacity]
        with self._lock:
            self._wanted = set(order)
            missing = [key for key in order if key not in self._entries and key not in self._copying]
            if self.copies_in_flight is None:
                for key in missing:
                    self._upload(key, in_use=set())
                return
            self.copies_dropped += len(set(self._queued) - set(missing))
            self._queued = missing
            if missing and self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="expert-cache-feeder", daemon=True)
                self._feeder.start()

    def fetch(self, key: ExpertKey, protected: Iterable[ExpertKey] = ()) -> ExpertParams:
        """`key`'s weights on the device, usable on the current stream; copied now on a miss, which never
        evicts the experts in `protected` (those the caller is using). A copy still queued is made now,
        ahead of the queue (a demand); one the feeder is making is waited for."""
        with self._lock:
            self._lock.wait_for(lambda: key not in self._copying)
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
            else:
                if key in self._queued:
                    self._queued.remove(key)
                    self.demand_jumps += 1
                self._upload(key, in_use=set(protected), stream=self.demand_stream)
            params, ready = self._entries[key]
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for tensor in params.values():
                tensor.record_stream(stream)  # freed on eviction only once this stream is done with it
        return params

    def drain(self) -> None:
        """Return once the queue is empty and every copy handed over has read its host bytes."""
        with self._lock:
            self._lock.wait_for(lambda: self._feeder is None)
        for stream in (self.stream, self.demand_stream):
            if stream is not None:
                stream.synchronize()

    def clear(self) -> None:
        """Drop every device copy and the queue, once the copies in flight have read their host bytes (which the
        caller may write next: full-parameter ZO)."""
        with self._lock:
            self._queued = []
        self.drain()
        with self._lock:
            self._entries.clear()
            self._wanted = set()

    # -- the feeder: the host queue, handed to the link a few copies at a time --------------------------------

    def _feed(self) -> None:
        """Hand the queue's head to the prefetch stream while fewer than `copies_in_flight` copies are on the link;
        ends when the queue is empty. Each copy is taken at the last moment, so a plan that comes meanwhile
        decides what goes next. A copy that fails ends the feeding, logged: the queue is dropped, and a
        computation that needs one of its experts copies it itself (`fetch`), raising the cause if it fails again."""
        try:
            while (key := self._next_queued()) is not None:
                landed = None
                try:
                    landed = self._copy(key, self.stream)
                finally:
                    with self._lock:
                        self._copying.discard(key)
                        if landed is not None:
                            self._land(key, *landed)
                            if landed[1] is not None:
                                self._issued.append(landed[1])
                        self._lock.notify_all()
        except Exception as err:  # noqa: BLE001 - a prefetch: the computation's own fetch raises it, if it matters
            logger.warning("expert cache: a prefetch failed (%s: %s); its queue is dropped, the computation copies "
                           "what it needs itself", type(err).__name__, err)
            with self._lock:
                self._queued = []
        finally:
            with self._lock:
                if self._feeder is threading.current_thread():  # ended by a failure: no feeder now
                    self._feeder = None
                self._lock.notify_all()

    def _next_queued(self) -> ExpertKey | None:
        """The queue's head, room made for it (None: the queue is empty); first, while the link holds
        `copies_in_flight` copies, waits for the oldest of them (outside the lock)."""
        while True:
            with self._lock:
                while self._issued and self._issued[0].query():
                    self._issued.popleft()
                if not self._queued:  # ends under the lock: a plan made after this starts a feeder of its own
                    self._feeder = None
                    self._lock.notify_all()
                    return None
                if len(self._issued) < self.copies_in_flight:
                    key = self._queued.pop(0)
                    self._make_room({key})
                    self._copying.add(key)
                    self.copy_log.append(key)
                    return key
                oldest = self._issued[0]
            oldest.synchronize()

    # -- copies ----------------------------------------------------------------------------------------------

    def _upload(self, key: ExpertKey, in_use: set[ExpertKey], stream: torch.cuda.Stream | None = None) -> None:
        """Copy `key` in now, on `stream` (None: the prefetch stream); the caller holds the lock."""
        self._make_room(in_use | {key})
        self.copy_log.append(key)
        self._land(key, *self._copy(key, stream or self.stream))

    def _copy(self, key: ExpertKey, stream: torch.cuda.Stream | None
              ) -> tuple[ExpertParams, torch.cuda.Event | None, int]:
        """`key`'s weights copied from host (on `stream` on CUDA), the event marking their arrival, the bytes moved."""
        host = self.host_params(key)
        nbytes = sum(t.numel() * t.element_size() for t in host.values())
        if stream is None:
            return (self.decode(host) if self.decode else {name: t.clone() for name, t in host.items()}), None, nbytes
        with torch.cuda.stream(stream):  # allocated on, and copied by, that upload stream
            params = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
            params = self.decode(params) if self.decode else params
            ready = torch.cuda.Event()
            ready.record(stream)
        return params, ready, nbytes

    def _land(self, key: ExpertKey, params: ExpertParams, ready: torch.cuda.Event | None, nbytes: int) -> None:
        self._entries[key] = (params, ready)
        self.uploads += 1
        self.upload_bytes += nbytes

    def _make_room(self, in_use: set[ExpertKey]) -> None:
        """Evict the least recently used expert outside the plan, failing that the least recently used of
        the plan, never one `in_use`, until there is room for one more (copies the feeder is making count)."""
        while len(self._entries) + len(self._copying) >= self.capacity:
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

