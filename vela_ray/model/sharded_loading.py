"""Filling a master rank's backbone from safetensors, each tensor read once per node (issues 37, 51; thesis §3.3).

What the runtime does. Every master process (`training.master.build_master_rank`, for every rank of
`runtime.masters.MasterGroup`) builds the backbone's unread skeleton (`loading.backbone_skeleton`), wraps it (brokers,
peft) and, under tensor parallelism, shards it over its TP group (`tensor_parallel.parallelize_backbone`). Then
`read_backbone` fills it:

- the master processes on one node form a node group (gloo; made by `actors.masters.RayRanks`, which knows where
  each rank runs). Its first member, the root, reads each backbone tensor from the checkpoint once: by slice, only
  the TP shards the node's members hold (all of it when they hold every TP index), each shard once whatever the
  number of data-parallel masters on the node. It keeps its own shard and sends every other member its shard,
  point to point; a member receives straight into its parameter (or into its vocab-parallel DTensor's local
  tensor), so receiving costs no host memory beyond the model it keeps;
- a root that already holds the whole backbone (master 0 without TP: `runtime.state.Backbone.load` read it with
  `training.master.seeded_backbone`, alone, before the other masters existed) sends from it instead of reading the
  checkpoint again;
- a process alone on its node (one master per node and no TP) reads its own shards by slice.

So the bytes a node reads are one model's (its members' TP shards of every backbone tensor, each once), for any
DP x TP, and every read and send is counted: `loading.BACKBONE_READS` (this process's reads, what
`benchmarks/master_loading.py` and the tests sum per node) and the `ReadStats` a load returns.

Host memory: loading holds next to nothing beyond the model it fills (issue 51). Each tensor streams in chunks of
whole rows (`chunk_bytes`: 1/512 of the backbone, 64 KiB to 16 MiB), the files in storage order, one open at a
time. The root reads its own rows with pread(2) straight into its parameter, and each other TP rank's rows into a
staging buffer it sends from (a replicated tensor's rows from its own parameter); the members receive each chunk
straight into theirs. Nothing is memory-mapped, so no checkpoint page is charged to a master's resident set (the
page cache holds what was read, as the kernel's reclaimable cache), and no whole tensor is materialised to be
sliced: a few chunks of staging (`ReadStats.staged_bytes`; none on a member, none on a lone reader whose
checkpoint dtype is the model's) are all the load adds.

Not done here: the broadcast runs over gloo from host memory (a GPU master receives into its host skeleton, then
moves it to its GPU, as it did when it read its own shards), not GPU to GPU. With FSDP2
(`masters.shard_frozen_backbone`, `tensor_parallel.shard_frozen`) the decoder layers are sharded over the
data-parallel masters after loading, so until then each rank holds its whole TP shard: the bytes read per node
stay one model's, but a node hosting several data-parallel masters holds their copies for that moment.

A backbone tensor that transformers *converts* (lara_mini's fused in_proj split in four, inkling2's padded lm_head)
needs its whole source tensors: the root reads them whole, converts them with `loading.convert_whole` and takes the
shards (the converted tensor is held whole meanwhile, and counted in `ReadStats.staged_bytes`). Experts are never
read here: the master does not hold them (ExpertManagers do).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vela_ray.model.loading import BACKBONE_READS

logger = logging.getLogger(__name__)

LOAD_RECORD_ENV = "VELA_LOAD_RECORD"
"""A directory: when set, every backbone load writes what it read and its host memory there (`load_record`)."""


def shard_range(size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) of shard `tp_rank` of a dimension of `size`. Uneven splits are refused: the TP
    modules split heads and features evenly, and a silent uneven split would misalign them."""
    if size % tp:
        raise ValueError(f"a dimension of size {size} does not split evenly over tp={tp}")
    step = size // tp
    return tp_rank * step, (tp_rank + 1) * step


@dataclass(frozen=True)
class TensorSpec:
    """One backbone tensor: its model name, where it is stored (`source`: its checkpoint name, read under it when
    renamed), its full shape, the dtype it is loaded in, the dimension its TP shards split (None: replicated).
    `convert`: transformers converts it from whole checkpoint tensors (see the module docstring)."""

    name: str
    file: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None
    convert: bool = False


@dataclass
class ReadStats:
    """What one rank's load moved: bytes it read from the checkpoint (what the slices return, i.e. what a disk
    without a page cache delivers), bytes it received from and sent to its node group."""

    bytes_read: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    staged_bytes: int = 0
    """The most host bytes the load held at once beyond the model it filled: its staging buffers (a few chunks,
    `chunk_bytes`) and any whole tensor a conversion needed."""


_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                  **{f"U{bits}": getattr(torch, f"uint{bits}") for bits in (16, 32, 64)
                     if hasattr(torch, f"uint{bits}")}}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as a safetensors file stores it: dtype (None: one torch has no dtype for), shape and the file offset
    of its (row-major) data."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    offset: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _stored_tensors(file: str) -> dict[str, StoredTensor]:
    """{tensor name: StoredTensor} from a safetensors header (8-byte length, then JSON; data follows it)."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = StoredTensor(_STORED_DTYPES.get(entry["dtype"]), tuple(entry["shape"]),
                                 8 + length + entry["data_offsets"][0])
    return out


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous host tensor's bytes."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of a checkpoint file at byte {offset + done}")
        done += n


class ShardReader:
    """Reads rows of checkpoint tensors (their TP shard's columns, if asked) with pread(2) straight into a tensor
    the caller gives: its parameter, or a staging buffer. Nothing is memory-mapped, so no checkpoint page is
    charged to the process (the kernel's page cache holds what was read, reclaimable and not part of any process's
    resident set), and no whole tensor is materialised to take a slice of it. Every byte read is counted in
    `loading.BACKBONE_READS`. One file is open at a time (specs come in storage order); a context manager, so the
    last is closed."""

    def __init__(self):
        self._file: str | None = None
        self._fd: int | None = None
        self._stored: dict[str, dict[str, StoredTensor]] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._file = self._fd = None

    def _open(self, file: str) -> int:
        if file != self._file:
            self._close()
            self._fd = os.open(file, os.O_RDONLY)
            self._file = file
        return self._fd

    def stored(self, file: str | Path, name: str) -> StoredTensor:
        file = str(file)
        if file not in self._stored:
            self._stored[file] = _stored_tensors(file)
        return self._stored[file][name]

    def read_rows(self, file: str | Path, name: str, rows: tuple[int, int], out: torch.Tensor,
                  cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (only its dim-1 columns [start, stop) with `cols`) into `out`, a
        contiguous host tensor of the stored dtype and their shape; returns `out`. A column range is read row by
        row (a dim-1 shard is strided in the file)."""
        stored = self.stored(file, name)
        if stored.dtype is None:
            raise ValueError(f"{file}: {name}'s stored dtype is not one torch reads")
        if out.dtype != stored.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"{name}: reads go into a contiguous host tensor of its stored dtype {stored.dtype}")
        buffer, fd = _bytes_of(out), self._open(str(file))
        if cols is None:
            if len(buffer) != (rows[1] - rows[0]) * stored.row_bytes:
                raise ValueError(f"{name}: rows {rows} do not fit a buffer of {len(buffer)} bytes")
            _pread_into(fd, buffer, stored.offset + rows[0] * stored.row_bytes)
        else:
            column = math.prod(stored.shape[2:]) * stored.dtype.itemsize
            segment = (cols[1] - cols[0]) * column
            if len(buffer) != (rows[1] - rows[0]) * segment:
                raise ValueError(f"{name}: rows {rows}, columns {cols} do not fit a buffer of {len(buffer)} bytes")
            for i, row in enumerate(range(*rows)):
                _pread_into(fd, buffer[i * segment:(i + 1) * segment],
                            stored.offset + row * stored.row_bytes + cols[0] * column)
        BACKBONE_READS.bytes += len(buffer)
        return out

    def read(self, file: str | Path, name: str, dim: int | None = None, tp: int = 1, tp_rank: int = 0
             ) -> torch.Tensor:
        """Shard `tp_rank` of `tp` of tensor `name` along `dim` (0 or 1; the whole tensor when None) in a tensor of
        its own, in the stored dtype: only the shard's bytes are read."""
        stored = self.stored(file, name)
        if stored.dtype is None:
            raise ValueError(f"{file}: {name}'s stored dtype is not one torch reads")
        shape, rows, cols = list(stored.shape), (0, stored.rows), None
        if dim == 0:
            rows = shard_range(stored.shape[0], tp, tp_rank)
        elif dim == 1:
            cols = shard_range(stored.shape[1], tp, tp_rank)
        elif dim is not None:
            raise ValueError(f"{name}: shards along dim {dim} are not read (TP shards dims 0 and 1)")
        if dim is not None:
            shape[dim] //= tp
        out = self.read_rows(file, name, rows, torch.empty(shape, dtype=stored.dtype), cols)
        BACKBONE_READS.tensors += 1
        return out


def order_by_storage(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Specs in file order, then in the order of their data in the file: the root then reads each file once,
    forward (sequential I/O, readahead useful), with one file mapped at a time."""
    offsets: dict[str, dict[str, int]] = {}
    for spec in specs:
        if spec.file not in offsets:
            offsets[spec.file] = {name: t.offset for name, t in _stored_tensors(spec.file).items()}
    return sorted(specs, key=lambda s: (s.file, offsets[s.file].get(s.source, 0)))


def backbone_specs(model_dir: str | Path, dims: Callable[[str], int | None], dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False) -> list[TensorSpec]:
    """Specs of the master's tensors (every model tensor but the experts) under the model's names, through
    `loading`'s checkpoint index and key mapping; `dims`: a model name's TP shard dimension. Shapes are the model's
    (the meta skeleton's), dtypes `dtype` or the config's (as `load_backbone`). Metadata only: no weights read."""
    from transformers import AutoConfig

    from vela_ray.model import loading
    from vela_ray.model.dtypes import torch_dtype

    key = loading.model_key(model_dir, trust_remote_code)
    ckpt = loading.checkpoint_layout(key)
    dtype = torch_dtype(dtype or getattr(AutoConfig.from_pretrained(key), "dtype", None) or torch.float32)
    experts = tuple(f"{path}." for path in ckpt.experts_paths)
    specs = []
    for target, source in ckpt.sources.items():
        if target.startswith(experts):
            continue
        converted = source.converter is not None
        if converted and dims(target) is not None:
            logger.info("%s is converted by transformers from %s: its reader reads the sources whole",
                        target, list(source.names))
        specs.append(TensorSpec(target, str(source.files[0]), source.names[0], tuple(ckpt.shapes[target]), dtype,
                                dims(target), converted))
    return order_by_storage(specs)


MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20
CHUNK_FRACTION = 512
"""Loading streams each tensor in chunks of rows of about `chunk_bytes`: 1/CHUNK_FRACTION of the backbone, within
[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES] (a handful of chunks is all the host memory loading holds beyond the model)."""


def chunk_bytes(backbone_bytes: int) -> int:
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, backbone_bytes // CHUNK_FRACTION))


def _shard_shape(spec: TensorSpec, tp: int) -> tuple[int, ...]:
    shape = list(spec.shape)
    if spec.dim is not None:
        shape[spec.dim] //= tp
    return tuple(shape)


def _chunks(spec: TensorSpec, tp: int, chunk: int) -> Iterator[tuple[int, int]]:
    """The [start, stop) row ranges (dim 0) of a TP shard of `spec` that loading moves one at a time, each about
    `chunk` bytes of whole rows (at least one row): every member of a node group cuts them alike. A 0-d tensor is
    one row."""
    shape = _shard_shape(spec, tp)
    rows = shape[0] if shape else 1
    full_row = math.prod(spec.shape[1:]) * spec.dtype.itemsize  # a dim-1 shard's rows are read whole
    step = max(1, chunk // max(full_row, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _rows(tensor: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    return tensor if tensor.dim() == 0 else tensor.narrow(0, rows[0], rows[1] - rows[0])


class _Staging:
    """The host buffers loading holds beyond the model it fills, reused chunk after chunk, and the bytes they (and
    any whole converted tensor) hold: `peak`, the most at once, is what `ReadStats.staged_bytes` reports."""

    def __init__(self):
        self._buffers: dict[object, torch.Tensor] = {}
        self._held = 0
        self.peak = 0

    def _note(self, nbytes: int) -> None:
        self._held += nbytes
        self.peak = max(self.peak, self._held)

    def buffer(self, key: object, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` and `dtype` (its contents undefined): the one kept under `key`, grown if need be."""
        nbytes = math.prod(shape) * dtype.itemsize
        kept = self._buffers.get(key)
        if kept is None or kept.numel() < nbytes:
            if kept is not None:
                self._note(-kept.numel())
                del self._buffers[key], kept
            self._buffers[key] = kept = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self._note(kept.numel())
        return kept[:nbytes].view(dtype).view(shape)

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        self._note(tensor.numel() * tensor.element_size())
        return tensor

    def drop(self, tensor: torch.Tensor) -> None:
        self._note(-tensor.numel() * tensor.element_size())


class _Converted:
    """Whole-tensor conversions for `convert` specs, each run once per source and dropped when its targets have
    all been taken (a Split makes several targets from one source)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._done: dict[str, torch.Tensor] = {}

    def take(self, spec: TensorSpec) -> torch.Tensor:
        from vela_ray.model import loading

        if spec.name not in self._done:
            ckpt = loading.checkpoint_layout(self.model_dir)
            with loading.OpenFiles() as files:  # counted in BACKBONE_READS by convert_whole
                self._done.update(loading.convert_whole(files, ckpt.sources[spec.name], ckpt.skeleton))
        return self._done.pop(spec.name)


def _tp_dims(plan, prefix: str) -> dict[str, int]:
    """Checkpoint (model) tensor name -> the dim this rank's shard splits, from what `parallelize_backbone` did:
    column-parallel weights and biases on dim 0, row-parallel weights on dim 1, vocab-parallel embedding and LM head
    on dim 0. `prefix`: the module paths' prefix before the model's own names (peft's "base_model.model.")."""
    if plan is None:
        return {}
    dims: dict[str, int] = {}
    for path, style in plan.styles.items():
        name = path[len(prefix):] if path.startswith(prefix) else path
        dims[f"{name}.weight"] = 0 if style == "colwise" else 1
        if style == "colwise":
            dims[f"{name}.bias"] = 0
    for path in plan.vocab_parallel:
        dims[f"{path[len(prefix):] if path.startswith(prefix) else path}.weight"] = 0
    return dims


def _targets(inner: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Checkpoint name -> the model's (local) tensors holding it: peft's wrappers (a LoRA layer's base, a module
    trained in full: its frozen original and its copy) map to the wrapped module's name."""
    targets: dict[str, list[torch.Tensor]] = {}
    for name, tensor in [*inner.named_parameters(), *inner.named_buffers()]:
        if tensor.device.type != "meta" and ".lora_" not in name:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a vocab-parallel DTensor
            targets.setdefault(re.sub(r"\.(base_layer|original_module|modules_to_save\.[^.]+)\.", ".", name),
                               []).append(local)
    return targets


def read_backbone(model: nn.Module, plan, model_dir: str | Path, dtype: torch.dtype | None = None,
                  trust_remote_code: bool = False, node: dist.ProcessGroup | None = None,
                  holds_backbone: bool = False, filled: Callable[[str], None] | None = None) -> ReadStats:
    """Fill a master rank's backbone (a `loading.backbone_skeleton`, peft-wrapped, sharded by
    `tensor_parallel.parallelize_backbone` with `plan`, or whole with `plan` None) from the checkpoint, each tensor
    read once by `node`'s first member (see the module docstring); alone (`node` None) it reads its own shards.

    Collective over `node` (a gloo group of the master processes on this node, in any order of their TP ranks).
    `holds_backbone`: this process is the root and its `model` already holds the whole backbone (no TP): it sends
    from it. What a rank then holds is what `load_backbone` + `parallelize_backbone` give it. `filled(name)`: called
    as each tensor is whole here (and sent on), e.g. to hold it quantized from then on (`quantized_model.
    quantize_as_read`); the loader keeps no reference to it after."""
    from vela_ray.model import loading

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    tp, tp_rank = (plan.size, plan.rank) if plan is not None else (1, 0)
    if holds_backbone and tp > 1:
        raise ValueError("a root holding the whole backbone sends it to ranks without tensor parallelism only")
    targets = _targets(inner)
    dims = _tp_dims(plan, "base_model.model." if inner is not model else "")
    stats, start, reads = ReadStats(), time.perf_counter(), BACKBONE_READS.bytes
    staging = _Staging()
    with torch.no_grad():
        if node is not None and node.rank() > 0:
            specs, chunk = _plan_from_root(node, tp_rank, targets, tp)
            _receive(specs, targets, tp, node, chunk, staging, stats, filled)
        else:
            key = loading.model_key(model_dir, trust_remote_code)
            every = backbone_specs(key, dims.get, dtype, trust_remote_code)
            chunk = chunk_bytes(sum(math.prod(s.shape) * s.dtype.itemsize for s in every))
            specs = [s for s in every if s.name in targets]  # tied: not
            for spec in specs:
                _check_shapes(targets[spec.name], _shard_shape(spec, tp), spec.name)
            members = _member_tp_ranks(node)
            _tell_members(node, members, specs, chunk)
            _serve(specs, targets, tp, tp_rank, key, node, members, holds_backbone, chunk, staging, stats, filled)
        _zero_row_parallel_biases(model, plan)
    if getattr(inner.config, "tie_word_embeddings", False):
        inner.tie_weights()
    stats.bytes_read, stats.seconds = BACKBONE_READS.bytes - reads, time.perf_counter() - start
    stats.staged_bytes = staging.peak
    return stats


def _serve(specs: list[TensorSpec], targets: dict[str, list[torch.Tensor]], tp: int, tp_rank: int, key: str,
           node: dist.ProcessGroup | None, members: dict[int, int], holds_backbone: bool, chunk: int,
           staging: _Staging, stats: ReadStats, filled: Callable[[str], None] | None = None) -> None:
    """The root (or a lone rank): every spec's shards that the node's `members` ({member: TP rank}) hold, read once
    (or taken from the backbone it holds), chunk by chunk: its own read straight into its tensors, each other TP
    rank's into a staging buffer sent to the members holding that rank (a replicated tensor is sent from the root's
    own)."""
    wanted = sorted({tp_rank, *members.values()})
    converted = _Converted(key)
    tag = 0
    with ShardReader() as reader:
        for spec in specs:
            own = targets[spec.name]
            whole = None
            if holds_backbone:
                pass
            elif spec.convert:
                whole = staging.hold(converted.take(spec).to(spec.dtype))
            else:
                BACKBONE_READS.tensors += 1 if spec.dim is None else len(wanted)
            for rows in _chunks(spec, tp, chunk):
                tag += 1
                if holds_backbone:
                    pieces = {0: _host_rows(own[0], rows, staging)}
                elif whole is not None:
                    pieces = _pieces_of(whole, spec, tp, rows, wanted, tp_rank, own, staging)
                else:
                    pieces = _read_pieces(reader, spec, tp, rows, wanted, tp_rank, own, staging)
                sends = [node.send([pieces[t]], member, tag) for member, t in members.items()]
                for work in sends:
                    work.wait()
                stats.bytes_sent += sum(pieces[t].numel() * pieces[t].element_size() for t in members.values())
            if whole is not None:
                staging.drop(whole)
                del whole
            _done(spec.name, targets, filled)


def _host_rows(tensor: torch.Tensor, rows: tuple[int, int], staging: _Staging) -> torch.Tensor:
    """`rows` of a tensor the root holds, as a contiguous host tensor to send: the rows themselves when they are one."""
    part = _rows(tensor, rows)
    if _is_host_buffer(part):
        return part
    return staging.buffer("send", part.shape, part.dtype).copy_(part)


def _fill_own(own: list[torch.Tensor], rows: tuple[int, int], value: torch.Tensor, staging: _Staging
              ) -> torch.Tensor:
    """Copy `value` (host) into `rows` of each of this rank's tensors that does not hold it already; returns them as
    a contiguous host tensor of their dtype (what it sends to members of its own TP rank): its first tensor's rows
    where they are one (a GPU master 0's are not: it fills its GPU shards from host chunks)."""
    first = _rows(own[0], rows)
    for tensor in own:
        part = _rows(tensor, rows)
        if part.data_ptr() != value.data_ptr() or part.stride() != value.stride():
            part.copy_(value)
    if _is_host_buffer(first):
        return first
    if value.dtype == first.dtype and value.is_contiguous():
        return value
    return staging.buffer("own", first.shape, first.dtype).copy_(value)


def _is_host_buffer(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _pieces_of(whole: torch.Tensor, spec: TensorSpec, tp: int, rows: tuple[int, int], wanted: list[int],
               tp_rank: int, own: list[torch.Tensor], staging: _Staging) -> dict[int, torch.Tensor]:
    """{TP rank: its `rows`} of a converted tensor held whole; this rank's copied into its tensors."""
    pieces = {}
    for t in wanted:
        part = _rows(_shard_of(whole, spec.dim, tp, t), rows)
        if t == tp_rank:
            pieces[t] = _fill_own(own, rows, part, staging)
        else:
            pieces[t] = (part if part.is_contiguous()
                         else staging.buffer(("send", t), part.shape, part.dtype).copy_(part))
    return pieces


def _shard_of(tensor: torch.Tensor, dim: int | None, tp: int, tp_rank: int) -> torch.Tensor:
    if dim is None:
        return tensor
    start, stop = shard_range(tensor.shape[dim], tp, tp_rank)
    return tensor.narrow(dim, start, stop - start)


def _read_pieces(reader: ShardReader, spec: TensorSpec, tp: int, rows: tuple[int, int], wanted: list[int],
                 tp_rank: int, own: list[torch.Tensor], staging: _Staging) -> dict[int, torch.Tensor]:
    """{TP rank: its `rows`} of `spec`, each byte read once: this rank's straight into its tensor (through a
    staging buffer where its dtype differs from the stored one), the others' into their send buffers. A dim-1
    shard's rows: the whole rows read once when every TP rank is wanted, then split; else each rank's columns."""
    stored = reader.stored(spec.file, spec.source)
    shard = _shard_shape(spec, tp)
    n = rows[1] - rows[0]
    shape = (n, *shard[1:]) if shard else ()
    if spec.dim == 1 and len(wanted) == tp and tp > 1:
        full = staging.buffer("rows", (n, *stored.shape[1:]), stored.dtype)
        reader.read_rows(spec.file, spec.source, rows, full)
        pieces = {}
        for t in wanted:
            part = _shard_of(full, 1, tp, t)
            if t == tp_rank:
                pieces[t] = _fill_own(own, rows, part, staging)
            else:
                pieces[t] = staging.buffer(("send", t), shape, spec.dtype).copy_(part)
        return pieces
    pieces = {}
    for t in wanted if spec.dim is not None else [tp_rank]:
        file_rows, cols = rows, None
        if spec.dim == 0:
            offset = shard_range(stored.shape[0], tp, t)[0]
            file_rows = (offset + rows[0], offset + rows[1])
        elif spec.dim == 1:
            cols = shard_range(stored.shape[1], tp, t)
        mine = _rows(own[0], rows) if t == tp_rank else None
        if mine is not None and _is_host_buffer(mine) and stored.dtype == spec.dtype:
            dest = mine
        elif mine is not None:  # cast, or a GPU rank's: through a buffer of its own (sent from, if need be)
            dest = staging.buffer("own-read", shape, stored.dtype)
        elif stored.dtype == spec.dtype:
            dest = staging.buffer(("send", t), shape, spec.dtype)
        else:
            dest = staging.buffer("rows", shape, stored.dtype)
        reader.read_rows(spec.file, spec.source, file_rows, dest, cols)
        if t == tp_rank:
            pieces[t] = _fill_own(own, rows, dest, staging)
        elif dest.dtype != spec.dtype:
            pieces[t] = staging.buffer(("send", t), shape, spec.dtype).copy_(dest)
        else:
            pieces[t] = dest
    if spec.dim is None:  # replicated: every member gets the root's own rows
        pieces = {t: pieces[tp_rank] for t in wanted}
    return pieces


def _done(name: str, targets: dict[str, list[torch.Tensor]], filled: Callable[[str], None] | None) -> None:
    """Tensor `name` is whole here (and sent on): tell `filled`, and let go of it (it may be replaced)."""
    if filled is not None:
        del targets[name]
        filled(name)


def _receive(specs: list[TensorSpec], targets: dict[str, list[torch.Tensor]], tp: int, node: dist.ProcessGroup,
             chunk: int, staging: _Staging, stats: ReadStats, filled: Callable[[str], None] | None = None) -> None:
    """A member other than the root: every spec's shard received from the root chunk by chunk, straight into its
    tensor where that is contiguous."""
    tag = 0
    for spec in specs:
        own = targets[spec.name]
        for rows in _chunks(spec, tp, chunk):
            tag += 1
            mine = _rows(own[0], rows)
            buffer = mine if _is_host_buffer(mine) else staging.buffer("recv", mine.shape, mine.dtype)
            node.recv([buffer], 0, tag).wait()
            _fill_own(own, rows, buffer, staging)
            stats.bytes_received += buffer.numel() * buffer.element_size()
        del own
        _done(spec.name, targets, filled)


def _tell_members(node: dist.ProcessGroup | None, members: dict[int, int], specs: list[TensorSpec],
                  chunk: int) -> None:
    """The root tells each member what it will send, in order: each spec's name, whole shape, dtype and TP dim,
    and the chunk size (`_plan_from_root`): a member needs neither the checkpoint's layout nor transformers'
    conversion mapping (whose cached meta model would cost it host memory of its own)."""
    plan = json.dumps(dict(chunk=chunk, specs=[[s.name, list(s.shape), str(s.dtype).removeprefix("torch."), s.dim]
                                               for s in specs])).encode()
    payload = torch.frombuffer(bytearray(plan), dtype=torch.uint8)
    for member in members:
        node.send([torch.tensor([len(plan)])], member, 0).wait()
        node.send([payload], member, 0).wait()


def _plan_from_root(node: dist.ProcessGroup, tp_rank: int, targets: dict[str, list[torch.Tensor]], tp: int
                    ) -> tuple[list[TensorSpec], int]:
    """A member: its TP rank told to the root, then the specs and chunk size it sends (`_tell_members`), checked
    against the tensors this rank holds."""
    node.send([torch.tensor([tp_rank])], 0, 0).wait()
    length = torch.empty(1, dtype=torch.long)
    node.recv([length], 0, 0).wait()
    payload = torch.empty(int(length), dtype=torch.uint8)
    node.recv([payload], 0, 0).wait()
    plan = json.loads(payload.numpy().tobytes())
    specs = []
    for name, shape, dtype, dim in plan["specs"]:
        if name not in targets:
            raise ValueError(f"{name}: the node group's root sends a tensor this rank's model does not hold")
        spec = TensorSpec(name, "", name, tuple(shape), getattr(torch, dtype), dim)
        _check_shapes(targets[name], _shard_shape(spec, tp), name)
        if any(t.dtype != spec.dtype for t in targets[name]):
            raise ValueError(f"{name}: the node group's root sends {spec.dtype}, this rank holds "
                             f"{targets[name][0].dtype}")
        specs.append(spec)
    return specs, plan["chunk"]


def _member_tp_ranks(node: dist.ProcessGroup | None) -> dict[int, int]:
    """{node member: its TP rank} for the root: what each of the others said (`_plan_from_root`'s first message)."""
    members = {}
    for member in range(1, node.size() if node is not None else 1):
        said = torch.empty(1, dtype=torch.long)
        node.recv([said], member, 0).wait()
        members[member] = int(said)
    return members


def _check_shapes(tensors: list[torch.Tensor], shape: tuple[int, ...], name: str) -> None:
    for tensor in tensors:
        if tuple(shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: this rank's shard is {tuple(shape)} but the sharded model holds "
                             f"{tuple(tensor.shape)}")


def _zero_row_parallel_biases(model: nn.Module, plan) -> None:
    """A row-parallel bias is added once, by rank 0's partial sum: zero elsewhere, as `parallelize_backbone` left it."""
    if plan is None or plan.rank == 0:
        return
    for path, style in plan.styles.items():
        module = model.get_submodule(path)
        bias = getattr(module.get_base_layer() if hasattr(module, "get_base_layer") else module, "bias", None)
        if style == "rowwise" and bias is not None:
            bias.zero_()


def _memory() -> dict[str, int]:
    """This process's VmRSS, VmHWM (its peak RSS so far), and the parts of VmRSS: RssAnon (its own memory), RssFile
    (mapped files: its code, shared libraries) and RssShmem, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")}


def _host_tensors(model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(tensor, its host local tensor, whether it is a frozen parameter) for `model`'s parameters and buffers in host
    memory (a DTensor's local shard)."""
    tensors = [(p, not p.requires_grad) for p in model.parameters()] + [(b, False) for b in model.buffers()]
    for tensor, frozen in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type == "cpu":
            yield tensor, local, frozen


def _resident_bytes(model: nn.Module) -> int:
    """Bytes of the tensors `model` holds in host memory (each storage once; DTensors' local shards)."""
    storages = {local.untyped_storage().data_ptr(): local.untyped_storage().nbytes()
                for _, local, _ in _host_tensors(model)}
    return sum(storages.values())


def model_tensors(model: nn.Module) -> dict[int, weakref.ref]:
    """{id: weak reference} of `model`'s parameters and buffers: which tensors it holds now (`load_record`'s
    "tensors_at_start"), without keeping them alive."""
    return {id(t): weakref.ref(t) for t in [*model.parameters(), *model.buffers()]}


def _loaded_bytes(model: nn.Module, at_start: dict[int, weakref.ref], filled: bool) -> int:
    """Bytes of the tensors `model` holds in host memory that came to be during a load: tensors it did not hold at
    its start (`at_start`: `model_tensors` then; a model built during the load has none), and, when the load
    `filled` the model's frozen parameters, those (an unread skeleton's pages are first touched by the load). What
    the load's peak growth is to be compared with: not the LoRA peft drew before it, say. Each storage once."""
    storages = {}
    for tensor, local, frozen in _host_tensors(model):
        ref = at_start.get(id(tensor))
        if ref is None or ref() is not tensor or (filled and frozen):
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


@contextlib.contextmanager
def load_record(what: str) -> Iterator[dict]:
    """Around one backbone load: with $VELA_LOAD_RECORD set (a directory), write what this process read from the
    checkpoint meanwhile (`loading.BACKBONE_READS`), its host memory before and after (VmHWM: its peak), the tensors
    it then holds (the caller puts its model under "model" in the yielded dict: `resident_bytes`) and of those the
    ones the load brought about (`loaded_bytes`; the caller puts `model_tensors` of a model that existed before
    under "tensors_at_start", and "filled": False if the load only sent from it), one JSON file per load.
    Switching it on resets the process's VmHWM as each load starts.
    How `benchmarks/master_loading.py` and the tests see each master process's load inside a real job."""
    directory = os.environ.get(LOAD_RECORD_ENV)
    if directory:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the load's own peak (Linux >= 4.0)
    before, reads = _memory(), (BACKBONE_READS.bytes, BACKBONE_READS.tensors)
    record: dict = {}
    yield record
    if not directory:
        return
    model = record.pop("model", None)
    at_start, filled = record.pop("tensors_at_start", {}), record.pop("filled", True)
    out = dict(what=what, pid=os.getpid(), host=socket.gethostname(), bytes_read=BACKBONE_READS.bytes - reads[0],
               tensors_read=BACKBONE_READS.tensors - reads[1], memory_before=before, memory_after=_memory(),
               resident_bytes=_resident_bytes(model) if model is not None else 0,
               loaded_bytes=_loaded_bytes(model, at_start, filled) if model is not None else 0, **record)
    path = Path(directory) / f"{os.getpid()}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(out))
