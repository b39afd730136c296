"""The master's frozen backbone streamed block by block from host memory (ZO-Offloading §4, `masters.streaming`).

A decoder layer's frozen weights are needed only while that layer runs, forward and again backward. So the master
keeps them in host memory (pinned on a GPU master) and holds on its device only a reusable buffer of
`buffer_blocks` slots, each the size of the largest layer's frozen tensors: the device's memory for the decoder
layers drops from all of them to `buffer_blocks` of them. The trainable LoRA tensors, the embedding, the final norm
and the LM head stay resident.

    stream = stream_backbone(master.peft_model, buffer_blocks=2, device=torch.device("cuda"))
    loss = master.peft_model(**batch).loss               # every layer runs from a slot of the buffer
    loss.backward()                                      # and again, uploaded once more, last layer first
    stream.peak_bytes, stream.trace                      # the most bytes the buffer held; uploads and computes

How it runs. Every decoder layer (`tensor_parallel.decoder_layers`) is replaced in its ModuleList by a
`StreamedLayer` that shares the layer's submodules and tensors (so every parameter keeps its name, peft's and the
checkpoints'). At rest a layer's frozen tensors are views of one flat host copy of that layer (`_Block`). When
layer i is called:

  1. its upload is waited for (queued now if it was not: the first layer of the first pass);
  2. the uploads of layers i+1 .. i+buffer_blocks-1 are queued into the slots no layer of that window holds: their
     copies run while layer i computes. A no-grad forward's window wraps around to the next pass's first layers
     (ZO's two passes follow each other); one that keeps a graph stops at the last layer, which its backward needs
     first;
  3. the layer's frozen tensors are pointed at its slot and it runs; then they point at the host copy again.

With grad enabled the forward runs under saved-tensor hooks: a tensor it saves that lies in the layer's slot (a
frozen weight, or a view of one) is kept as where it lies (dtype, shape, strides, offset), not as the slot, which
later layers overwrite; the backward asks for it again, and the layer's block is uploaded once more if it was
evicted, the layers below it (which the backward reaches next) queued behind it. `expert_cache.DroppedWeights` does
the same for a tiered worker's experts.

On a CUDA device the uploads are non-blocking copies from pinned memory on a side stream: the compute stream
waits on the layer's upload event, and an upload into a slot waits for every kernel the compute stream had been
given when the slot was chosen (those that read its previous layer). On the CPU the device is a stand-in: the
upload is a copy from the host tensors into the slot on one background thread, so the overlap is as real (and as
visible in `trace`) as on a GPU.

Micro-batches in flight (`training.overlap`) pass the buffer in step, GPipe's schedule as Mobius and APTMoE run it
(`layer_major`, `training.step._through_the_buffer`): a wave of them on threads of their own, each entering layer i
only once all of them entered layer i-1, so a block is uploaded once per wave rather than once per micro-batch; the
threads share the slot of a layer they compute, which is never reused under them; then one backward over the wave.

Exact: an upload copies bytes, so a streamed forward and backward equal the resident ones bit for bit. Streamed are
a layer's frozen parameters and its persistent buffers (a quantized backbone's weights, `model.quantization`); its
non-persistent buffers (rotary frequencies) are small and stay.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Protocol

import torch
from torch import nn

from vela_ray.model import wire
from vela_ray.model.tensor_parallel import decoder_layers
from vela_ray.model.traffic import RowFormat

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every tensor of a block starts at a multiple of this (any dtype's view of it is aligned)
TRACE_EVENTS = 4096  # the latest uploads and computes a stream keeps (a long run's would grow without end)


@dataclass(frozen=True)
class StreamSettings:
    """`masters.streaming` as a master is built with it (`stream_backbone`'s arguments)."""

    buffer_blocks: int
    upload_format: RowFormat = "exact"
    activation_budget: int | None = None  # bytes of saved activations kept on the device; None: all of them
    prefetch: bool = True  # queue the next layers' uploads while a layer computes; False: each when it runs


@dataclass(frozen=True)
class TraceEvent:
    """One upload or one layer's compute, in `time.perf_counter` seconds (on CUDA: when the host issued it)."""

    kind: Literal["upload", "compute"]
    layer: int
    start: float
    end: float


@dataclass(frozen=True)
class _Tensor:
    """Where one frozen tensor of a layer lives in its block's flat bytes."""

    owner: nn.Module
    name: str
    is_param: bool
    offset: int
    dtype: torch.dtype
    shape: torch.Size

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + _nbytes(self.dtype, self.shape)].view(self.dtype).view(self.shape)


class _Block:
    """A decoder layer's frozen tensors packed into one flat host tensor `host` [nbytes] (uint8), which they are
    views of at rest; `point(flat)` makes them views of `flat` (a slot, or `host` again). With a low-bit
    `upload_format` (LOSSY) the host also keeps `wire` [wire_bytes], each floating tensor in that form
    (`vela_ray.model.wire`, a scale per row of its last dimension for float8), which is what an upload copies."""

    def __init__(self, layer: nn.Module, pin: bool, upload_format: RowFormat = "exact"):
        self.tensors: list[_Tensor] = []
        offset = 0
        for owner, name, tensor, is_param in _frozen_tensors(layer):
            self.tensors.append(_Tensor(owner, name, is_param, offset, tensor.dtype, tensor.shape))
            offset += _aligned(tensor.numel() * tensor.dtype.itemsize)
        self.nbytes = offset
        self.host = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
        for entry in self.tensors:
            entry.view_in(self.host).copy_(_current(entry))
        self.point(self.host)
        self.upload_format = upload_format
        self.wire, self.wire_parts = _wire_form(self, upload_format, pin)
        self.upload_bytes = self.nbytes if self.wire is None else self.wire.numel()

    def point(self, flat: torch.Tensor) -> None:
        for entry in self.tensors:
            view = entry.view_in(flat)
            if entry.is_param:
                entry.owner._parameters[entry.name].data = view
            else:
                entry.owner._buffers[entry.name] = view

    def reencode(self) -> None:
        """Encode `host` into `wire` again, in place: after the host copy was written (full-parameter ZO)."""
        if self.wire is None:
            return
        for entry, (offset, dtype, shape) in zip(self.tensors, self.wire_parts):
            if entry.dtype.is_floating_point:
                part = self.wire[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)
                part.copy_(_encoded(entry.view_in(self.host), self.upload_format))

    def upload_into(self, flat: torch.Tensor, staging: torch.Tensor | None, non_blocking: bool) -> None:
        """Fill the slot `flat` from the host: a copy of `host`, or of `wire` into `staging` decoded into the slot."""
        if self.wire is None:
            flat[:self.nbytes].copy_(self.host, non_blocking=non_blocking)
            return
        staging[:self.wire.numel()].copy_(self.wire, non_blocking=non_blocking)
        for entry, (offset, dtype, shape) in zip(self.tensors, self.wire_parts):
            part = staging[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)
            decoded = wire.decode(part, entry.dtype) if entry.dtype.is_floating_point else part.view(entry.dtype)
            entry.view_in(flat).copy_(decoded.view(entry.shape))


def _wire_form(block: _Block, upload_format: RowFormat, pin: bool
               ) -> tuple[torch.Tensor | None, list[tuple[int, torch.dtype, tuple[int, ...]]]]:
    """(the block's tensors in `upload_format`, packed; each one's (offset, dtype, shape) in it); (None, []) for
    exact. A floating tensor is encoded as rows of its last dimension (a 1-D one as one row); others stay as are."""
    if upload_format == "exact":
        return None, []
    forms = [_encoded(entry.view_in(block.host), upload_format) for entry in block.tensors]
    parts, offset = [], 0
    for form in forms:
        parts.append((offset, form.dtype, tuple(form.shape)))
        offset += _aligned(_nbytes(form.dtype, form.shape))
    packed = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for form, (start, dtype, shape) in zip(forms, parts):
        packed[start:start + _nbytes(dtype, shape)].view(dtype).view(shape).copy_(form)
    return packed, parts


def _encoded(tensor: torch.Tensor, upload_format: RowFormat) -> torch.Tensor:
    """A floating tensor in `upload_format`, as rows of its last dimension (a 1-D one as one row); others as are."""
    if not tensor.is_floating_point():
        return tensor
    rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(1, -1)
    return wire.encode(rows, upload_format)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def _frozen_tensors(layer: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
    """(module, name, tensor, is_param) of every frozen parameter and persistent buffer under `layer`, once each."""
    found, seen = [], set()
    for module in layer.modules():
        tensors = [(n, p, True) for n, p in module._parameters.items() if p is not None and not p.requires_grad]
        tensors += [(n, b, False) for n, b in module._buffers.items()
                    if b is not None and n not in module._non_persistent_buffers_set]
        for name, tensor, is_param in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((module, name, tensor, is_param))
    return found


def _current(entry: _Tensor) -> torch.Tensor:
    table = entry.owner._parameters if entry.is_param else entry.owner._buffers
    return table[entry.name].detach()


class _Copier(Protocol):
    """How a block's bytes reach a slot, and how compute and uploads wait on each other."""

    def upload(self, layer: int, block: _Block, flat: torch.Tensor, staging: torch.Tensor | None) -> None: ...

    def before_compute(self, layer: int) -> None: ...  # returns once `layer`'s last upload is visible to its compute

    def drain(self) -> None: ...  # returns once every upload queued so far has read its host bytes

    def close(self) -> None: ...


class _ThreadCopier:
    """The CPU stand-in: uploads run in order on one background thread while the caller computes."""

    def __init__(self, trace: deque[TraceEvent]):
        self.trace = trace
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vela-stream")
        self.pending: dict[int, Future] = {}

    def upload(self, layer: int, block: _Block, flat: torch.Tensor, staging: torch.Tensor | None) -> None:
        def copy() -> None:
            start = time.perf_counter()
            block.upload_into(flat, staging, non_blocking=False)
            self.trace.append(TraceEvent("upload", layer, start, time.perf_counter()))
        self.pending[layer] = self.pool.submit(copy)

    def before_compute(self, layer: int) -> None:
        self.pending[layer].result()  # kept: a layer still in its slot at the next pass waits on it again, done

    def drain(self) -> None:
        for upload in self.pending.values():
            upload.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _CudaCopier:
    """Non-blocking copies from pinned memory on a side stream, ordered against the compute stream by events."""

    def __init__(self, device: torch.device, trace: deque[TraceEvent]):
        self.device = device
        self.trace = trace
        self.stream = torch.cuda.Stream(device)
        self.uploaded: dict[int, torch.cuda.Event] = {}

    def upload(self, layer: int, block: _Block, flat: torch.Tensor, staging: torch.Tensor | None) -> None:
        start = time.perf_counter()
        # every kernel that reads the slot's previous layer (its forward, or its backward's) was issued before the
        # stream chose to reuse the slot: the copy waits for what the compute stream has been given so far (one
        # compute stream, micro-batches in flight too: `training.step.layer_major_waves`)
        issued = torch.cuda.Event()
        issued.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(issued)
            block.upload_into(flat, staging, non_blocking=True)
            self.uploaded[layer] = torch.cuda.Event()
            self.uploaded[layer].record(self.stream)
        self.trace.append(TraceEvent("upload", layer, start, time.perf_counter()))

    def before_compute(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.uploaded[layer])  # kept, as `_ThreadCopier`'

    def drain(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()


class BackboneStream:
    """The decoder layers' frozen tensors in host memory, run through `buffer_blocks` device slots (see the module
    docstring). `resident_bytes`: the bytes of the layers the slots hold now (uploaded or being uploaded);
    `peak_bytes`: the most it held; `uploads`, `upload_bytes`: the blocks copied into slots so far; `trace`: the
    latest `TRACE_EVENTS` uploads and computes, in the order they ended."""

    def __init__(self, layers: list[nn.Module], buffer_blocks: int, device: torch.device,
                 upload_format: RowFormat = "exact", activation_budget: int | None = None, prefetch: bool = True):
        if buffer_blocks < 2:
            raise ValueError(f"masters.streaming.buffer_blocks is {buffer_blocks}: it needs at least 2 (one block "
                             "computing while the next uploads)")
        self.upload_format = upload_format
        self.blocks = [_Block(layer, pin=device.type == "cuda", upload_format=upload_format) for layer in layers]
        self.buffer_blocks = min(buffer_blocks, len(self.blocks))
        block_bytes = max(block.nbytes for block in self.blocks)
        self.slots = [torch.empty(block_bytes, dtype=torch.uint8, device=device) for _ in range(self.buffer_blocks)]
        # a low-bit upload lands in its slot's staging buffer and is decoded from there into the slot
        wire_bytes = max(block.upload_bytes for block in self.blocks)
        self.staging = [torch.empty(wire_bytes, dtype=torch.uint8, device=device) if upload_format != "exact"
                        else None for _ in range(self.buffer_blocks)]
        self.trace: deque[TraceEvent] = deque(maxlen=TRACE_EVENTS)
        self.copier: _Copier = (_CudaCopier(device, self.trace) if device.type == "cuda"
                                else _ThreadCopier(self.trace))
        self.slot_of: dict[int, int] = {}  # layer -> the slot that holds it (or is receiving it)
        self.layer_in: list[int | None] = [None] * self.buffer_blocks
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.uploads = self.upload_bytes = 0
        # micro-batches in flight (`layer_major`): one lock over the slots, the threads computing each layer (whose
        # slot is never reused under them), and the wave's gate
        self.lock = threading.Condition()
        self.computing: dict[int, int] = {}
        self.wave: _Wave | None = None
        # activations the layers save for backward (`activation_budget`): the bytes the graphs hold on the device now
        # and at most, and those offloaded to host memory
        self.activation_budget = activation_budget
        self.ahead = self.buffer_blocks if prefetch else 1  # layers a window holds: the running one and those queued
        self.activation_bytes = self.peak_activation_bytes = 0
        self.offloads = self.offloaded_bytes = 0

    @property
    def frozen_bytes(self) -> int:
        """Every streamed layer's frozen bytes: what the device would hold without streaming."""
        return sum(block.nbytes for block in self.blocks)

    @contextmanager
    def layer_major(self, micro_batches: int) -> Iterator[None]:
        """`micro_batches` forwards, each on a thread of its own, pass the layers in step (GPipe's schedule through the
        buffer): one enters layer i only once all of them have entered layer i-1, so each block is uploaded once for
        all of them, not once each. Every one of them must run (or the others wait for it)."""
        with self.lock:
            self.wave = _Wave(micro_batches)
        try:
            yield
        finally:
            self.end_wave()

    def end_wave(self) -> None:
        """No gate from now on: the wave ended, or one of its micro-batches failed (the others must not wait for it)."""
        with self.lock:
            self.wave = None
            self.lock.notify_all()

    def run(self, layer: int, forward: Callable[[], Any]) -> Any:
        """Layer `layer`'s `forward()` with its frozen tensors in a slot, the next layers' uploads queued. With grad
        enabled the graph keeps no slot tensor: each is saved as where it lies in the block (`_pack`), and the
        backward uploads the block again, the layers below it prefetched (`_unpack`). Threads of a `layer_major` wave
        share the slot of the layer they compute; it points the layer at its slot while any of them computes it."""
        grad = torch.is_grad_enabled()
        # a no-grad forward's next layers wrap to the next pass's first (ZO's passes follow each other); one that
        # keeps a graph stops at the last layer, whose block its backward needs first
        window = [(layer + k) % len(self.blocks) if not grad else layer + k for k in range(self.ahead)]
        with self.lock:
            if self.wave is not None:
                self.lock.wait_for(lambda: self.wave is None or self.wave.may_enter(layer))
                if self.wave is not None:
                    self.wave.enter(layer)
                    self.lock.notify_all()
            slot = self._acquire(layer, [w for w in window if w < len(self.blocks)])
            start = time.perf_counter()
            if not self.computing.get(layer):
                self.blocks[layer].point(self.slots[slot])
            self.computing[layer] = self.computing.get(layer, 0) + 1
        try:
            if not grad:
                return forward()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(layer, slot, t), self._unpack):
                return forward()
        finally:
            with self.lock:
                self.computing[layer] -= 1
                if not self.computing[layer]:
                    self.blocks[layer].point(self.blocks[layer].host)
                self.lock.notify_all()
            self.trace.append(TraceEvent("compute", layer, start, time.perf_counter()))

    def _acquire(self, layer: int, window: list[int]) -> int:
        """The slot holding `layer` (`window[0]`) once its upload is visible to compute, the rest of `window` (the
        layers that run next, in order) queued behind it where a slot is free of them. Called holding `lock`; waits
        (releasing it) while every slot holds a layer some thread computes."""
        while layer not in self.slot_of and not self._load(layer, window):
            self.lock.wait()
        self.copier.before_compute(layer)
        for ahead in window[1:]:
            if ahead not in self.slot_of:
                self._load(ahead, window)
        return self.slot_of[layer]

    def _pack(self, layer: int, slot: int, tensor: torch.Tensor) -> Any:
        """A tensor the forward saves for backward: one in `layer`'s slot (a frozen weight, or a view of one) is kept
        as where it lies, not as the slot's bytes, which the next layers overwrite. With an `activation_budget`, an
        activation is kept on the device while the graphs hold fewer bytes than it, else offloaded (`_activation`)."""
        if tensor.device != self.slots[slot].device or \
                tensor.untyped_storage().data_ptr() != self.slots[slot].untyped_storage().data_ptr():
            return tensor if self.activation_budget is None else self._activation(tensor)
        return layer, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()

    def _activation(self, tensor: torch.Tensor) -> Any:
        """A saved activation: kept on the device (counted while a graph holds it) if the budget has room, else copied
        to host memory (pinned on CUDA, on the compute stream, so the backward's copy back is ordered after it) and
        brought back when the backward asks for it. A parameter (LoRA's, which the graph saves as is) stays, and so
        does a view (of a parameter, or of a tensor something else holds): its copy would not free its storage, and
        kernels given the copy instead of the view round differently."""
        if tensor._base is not None or (tensor.is_leaf and tensor.requires_grad):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            kept = self.activation_bytes + nbytes <= self.activation_budget
            if kept:
                self.activation_bytes += nbytes
                self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
            else:
                self.offloads += 1
                self.offloaded_bytes += nbytes
        if kept:
            return _OnDevice(tensor, self._released)
        # its strides kept (a dense tensor's; what a kernel reads them in decides its rounding), back on the device too
        host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.device.type == "cuda")
        host.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        return _OnHost(host, tensor.device)

    def _released(self, nbytes: int) -> None:
        with self.lock:
            self.activation_bytes -= nbytes

    def _unpack(self, packed: Any) -> torch.Tensor:
        """The backward's tensor: its layer's block uploaded again if evicted (the layers below it, which the
        backward reaches next, queued behind it), and the same view of it; an activation as it was kept."""
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _OnDevice):
            return packed.tensor
        if isinstance(packed, _OnHost):
            return packed.host.to(packed.device, non_blocking=packed.device.type == "cuda")
        layer, dtype, shape, stride, offset = packed
        with self.lock:
            slot = self._acquire(layer, [layer - k for k in range(self.ahead) if layer - k >= 0])
        return self.slots[slot].view(dtype).as_strided(shape, stride, offset)

    def _load(self, layer: int, window: list[int]) -> bool:
        """Queue `layer`'s upload into a slot that holds no layer of `window` and none a thread computes (an empty one
        first); False if there is no such slot."""
        free = [s for s, held in enumerate(self.layer_in) if held not in window and not self.computing.get(held)]
        if not free:
            return False
        slot = min(free, key=lambda s: self.layer_in[s] is not None)
        evicted = self.layer_in[slot]
        if evicted is not None:
            del self.slot_of[evicted]
            self.resident_bytes -= self.blocks[evicted].nbytes
        self.slot_of[layer], self.layer_in[slot] = slot, layer
        self.resident_bytes += self.blocks[layer].nbytes
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)
        self.uploads += 1
        self.upload_bytes += self.blocks[layer].upload_bytes
        self.copier.upload(layer, self.blocks[layer], self.slots[slot], self.staging[slot])
        return True

    @contextmanager
    def rewritten(self) -> Iterator[None]:
        """For writing the layers' host copies (full-parameter ZO perturbs the frozen weights where they rest): the
        uploads in flight finish reading them first, and afterwards no slot counts as holding a layer, so each is
        uploaded again from what was written (a low-bit `upload_format`'s host form encoded again first)."""
        self.copier.drain()
        try:
            yield
        finally:
            for block in self.blocks:
                block.reencode()
            self.slot_of.clear()
            self.layer_in = [None] * self.buffer_blocks
            self.resident_bytes = 0

    def close(self) -> None:
        """Wait for the uploads in flight and end the upload thread (the layers stay streamed)."""
        self.copier.close()


class _OnDevice:
    """A saved activation kept on the device, counted against the budget while the graph holds it."""

    def __init__(self, tensor: torch.Tensor, released: Callable[[int], None]):
        self.tensor = tensor
        weakref.finalize(self, released, tensor.numel() * tensor.element_size())


@dataclass(frozen=True)
class _OnHost:
    """A saved activation offloaded to host memory, and the device it goes back to."""

    host: torch.Tensor
    device: torch.device


class _Wave:
    """The micro-batches of one `BackboneStream.layer_major` wave: how many entered each layer so far."""

    def __init__(self, size: int):
        self.size = size
        self.entered: dict[int, int] = {}

    def may_enter(self, layer: int) -> bool:
        return layer == 0 or self.entered.get(layer - 1, 0) >= self.size

    def enter(self, layer: int) -> None:
        self.entered[layer] = self.entered.get(layer, 0) + 1


class StreamedLayer(nn.Module):
    """A decoder layer run through a `BackboneStream`. It shares the layer's submodules, parameters and buffers
    (the same dicts), so every name and tensor of the model is as it was; the layer's own forward does the work."""

    def __init__(self, layer: nn.Module, index: int, stream: BackboneStream):
        super().__init__()
        self._modules, self._parameters, self._buffers = layer._modules, layer._parameters, layer._buffers
        self.__dict__["inner"] = layer  # not a submodule: its children are this module's already
        self.index = index
        self.stream = stream
        self.training = layer.training

    def forward(self, *args, **kwargs):
        return self.stream.run(self.index, lambda: self.inner(*args, **kwargs))

    def train(self, mode: bool = True) -> "StreamedLayer":
        self.inner.train(mode)  # the layer's own flag too: some layers read `self.training`
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":  # not set yet (a copy being built): nothing to fall back to
                raise
            return getattr(self.inner, name)  # the layer's plain attributes (e.g. `attention_type`)


def stream_backbone(model: nn.Module, buffer_blocks: int, device: torch.device, upload_format: RowFormat = "exact",
                    activation_budget: int | None = None, prefetch: bool = True) -> BackboneStream:
    """Stream `model`'s decoder layers (peft-wrapped or not, built in host memory) through `buffer_blocks` slots on
    `device`: each layer replaced in its ModuleList by a `StreamedLayer`, its frozen tensors packed into host copies,
    and every other tensor (LoRA, embedding, head, norms) moved to `device`. A layer with no frozen tensor (another
    pipeline stage's, `training.pipeline.OutsideStage`) is left as it is: the stream holds the others, in order.
    Never `model.to(device)`: the layers' frozen weights would all land on the device at once, which is what
    streaming is for a model too big for."""
    layers = decoder_layers(model)
    held = [i for i, layer in enumerate(layers) if _frozen_tensors(layer)]  # a pipeline stage's own layers
    stream = BackboneStream([layers[i] for i in held], buffer_blocks, device, upload_format, activation_budget,
                            prefetch)
    for index, i in enumerate(held):
        layers[i] = StreamedLayer(layers[i], index, stream)
    _move_resident(model, stream, device)
    logger.info("backbone streamed: %d decoder layers, %.3g MB frozen in host memory, through %d device slots of "
                "%.3g MB, uploaded %s", len(layers), stream.frozen_bytes / 1e6, stream.buffer_blocks,
                stream.slots[0].numel() / 1e6, upload_format if upload_format == "exact" else f"in {upload_format} "
                "(LOSSY: the layers compute with the rounded weights)")
    return stream


def _move_resident(model: nn.Module, stream: BackboneStream, device: torch.device) -> None:
    """Every parameter and buffer of `model` but the streamed ones onto `device` (parameters in place: the optimizer
    holds them). A tensor is named by its owner's dict, which a `StreamedLayer` shares with its layer."""
    streamed = {(id(entry.owner._parameters if entry.is_param else entry.owner._buffers), entry.name)
                for block in stream.blocks for entry in block.tensors}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and (id(module._parameters), name) not in streamed:
                moved = param.data.to(device)
                if torch._has_compatible_shallow_copy_type(param, moved):  # CPU <-> CUDA
                    param.data = moved
                else:  # a device of another tensor kind (meta, XLA): the same Parameter object, swapped
                    torch.utils.swap_tensors(param, nn.Parameter(moved, requires_grad=param.requires_grad))
        for name, buffer in module._buffers.items():
            if buffer is not None and (id(module._buffers), name) not in streamed:
                module._buffers[name] = buffer.to(device)
