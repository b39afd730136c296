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
  `loading.load_backbone` before the other masters existed) sends from it instead of reading the checkpoint again;
- a process alone on its node (one master per node and no TP) reads its own shards by slice.

So the bytes a node reads are one model's (its members' TP shards of every backbone tensor, each once), for any
DP x TP, and every read and send is counted: `loading.BACKBONE_READS` (this process's reads, what
`benchmarks/master_loading.py` and the tests sum per node) and the `ReadStats` a load returns. The root keeps one
checkpoint file mapped at a time and reads the files in storage order; a dim-0 shard is sent from the map itself,
a dim-1 shard is first gathered into one tensor of its own.

Not done here: the broadcast runs over gloo from host memory (a GPU master receives into its host skeleton, then
moves it to its GPU, as it did when it read its own shards), not GPU to GPU. With FSDP2
(`masters.shard_frozen_backbone`, `tensor_parallel.shard_frozen`) the decoder layers are sharded over the
data-parallel masters after loading, so until then each rank holds its whole TP shard: the bytes read per node
stay one model's, but a node hosting several data-parallel masters holds their copies for that moment.

A backbone tensor that transformers *converts* (lara_mini's fused in_proj split in four, inkling2's padded lm_head)
needs its whole source tensors: the root reads them whole, converts them with `loading.convert_whole` and takes the
shards. Experts are never read here: the master does not hold them (ExpertManagers do).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
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


class ShardReader:
    """Reads TP shards by slice from memory-mapped safetensors files into `loading.BACKBONE_READS`.

    One file is kept open (mapped) at a time: the pages a map has touched count in the process's RSS while it is
    mapped, so reading file by file (specs are ordered so) bounds that to one file's worth. A context manager so
    the last map is closed."""

    def __init__(self):
        self._file: str | None = None
        self._ctx = None
        self._handle = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
        self._file = self._ctx = self._handle = None

    def _open(self, file: str):
        if file != self._file:
            self._close()
            self._ctx = safe_open(file, "pt")
            self._handle = self._ctx.__enter__()
            self._file = file
        return self._handle

    def read(self, file: str | Path, name: str, dim: int | None = None, tp: int = 1, tp_rank: int = 0
             ) -> torch.Tensor:
        """Shard `tp_rank` of `tp` of tensor `name` along `dim` (the whole tensor when dim is None), read by slice:
        only the shard's pages are touched. A dim-0 shard is a view of the memory map (copy it, do not keep it); a
        dim>0 one is gathered into memory of its own (collectives need contiguous tensors)."""
        piece = self._open(str(file)).get_slice(name)
        if dim is None:
            tensor = piece[:]
        else:
            start, stop = shard_range(piece.get_shape()[dim], tp, tp_rank)
            tensor = piece[(slice(None),) * dim + (slice(start, stop),)]
        return BACKBONE_READS.add(tensor.contiguous())


def _data_offsets(file: str) -> dict[str, int]:
    """{tensor name: byte offset of its data} from a safetensors header (8-byte length, then JSON)."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def order_by_storage(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Specs in file order, then in the order of their data in the file: the root then reads each file once,
    forward (sequential I/O, readahead useful), with one file mapped at a time."""
    offsets: dict[str, dict[str, int]] = {}
    for spec in specs:
        if spec.file not in offsets:
            offsets[spec.file] = _data_offsets(spec.file)
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


def _narrow(tensor: torch.Tensor, dim: int | None, tp: int, tp_rank: int) -> torch.Tensor:
    if dim is None:
        return tensor
    start, stop = shard_range(tensor.shape[dim], tp, tp_rank)
    return tensor.narrow(dim, start, stop - start).contiguous()


def _read_shards(reader: ShardReader, converted: _Converted, spec: TensorSpec, tp: int, wanted: set[int]
                 ) -> dict[int, torch.Tensor]:
    """{tp rank: its shard of `spec`} for the `wanted` TP ranks, each read once: a replicated or converted tensor
    whole (then narrowed), a sharded one shard by shard, by slice."""
    if spec.convert:
        whole = converted.take(spec).to(spec.dtype)
        return {t: _narrow(whole, spec.dim, tp, t) for t in wanted}
    if spec.dim is None:
        whole = reader.read(spec.file, spec.source).to(spec.dtype)
        return {t: whole for t in wanted}
    return {t: reader.read(spec.file, spec.source, spec.dim, tp, t).to(spec.dtype) for t in sorted(wanted)}


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
                  holds_backbone: bool = False) -> ReadStats:
    """Fill a master rank's backbone (a `loading.backbone_skeleton`, peft-wrapped, sharded by
    `tensor_parallel.parallelize_backbone` with `plan`, or whole with `plan` None) from the checkpoint, each tensor
    read once by `node`'s first member (see the module docstring); alone (`node` None) it reads its own shards.

    Collective over `node` (a gloo group of the master processes on this node, in any order of their TP ranks).
    `holds_backbone`: this process is the root and its `model` already holds the whole backbone (no TP): it sends
    from it. What a rank then holds is what `load_backbone` + `parallelize_backbone` give it."""
    from vela_ray.model import loading

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    tp, tp_rank = (plan.size, plan.rank) if plan is not None else (1, 0)
    if holds_backbone and tp > 1:
        raise ValueError("a root holding the whole backbone sends it to ranks without tensor parallelism only")
    targets = _targets(inner)
    dims = _tp_dims(plan, "base_model.model." if inner is not model else "")
    key = loading.model_key(model_dir, trust_remote_code)
    specs = [s for s in backbone_specs(key, dims.get, dtype, trust_remote_code) if s.name in targets]  # tied: not
    stats, start, reads = ReadStats(), time.perf_counter(), BACKBONE_READS.bytes
    with torch.no_grad():
        if node is not None and node.rank() > 0:
            _receive(specs, targets, tp_rank, node, stats)
        else:
            _serve(specs, targets, tp, tp_rank, key, node, holds_backbone, stats)
        _zero_row_parallel_biases(model, plan)
    if getattr(inner.config, "tie_word_embeddings", False):
        inner.tie_weights()
    stats.bytes_read, stats.seconds = BACKBONE_READS.bytes - reads, time.perf_counter() - start
    return stats


def _serve(specs: list[TensorSpec], targets: dict[str, list[torch.Tensor]], tp: int, tp_rank: int, key: str,
           node: dist.ProcessGroup | None, holds_backbone: bool, stats: ReadStats) -> None:
    """The root (or a lone rank): every spec's shards that the node's members hold, read once (or taken from the
    backbone it holds); its own copied in, the others sent, each member its own."""
    members = _member_tp_ranks(node)
    wanted = {tp_rank, *members.values()}
    converted = _Converted(key)
    with ShardReader() as reader:
        for tag, spec in enumerate(specs, start=1):
            own = targets[spec.name]
            if holds_backbone:
                shards = {0: own[0].detach().to("cpu").contiguous()}
            else:
                shards = _read_shards(reader, converted, spec, tp, wanted)
                _copy_into(own, shards[tp_rank], spec.name)
            sends = [node.send([shards[t]], member, tag) for member, t in members.items()]
            for work in sends:
                work.wait()
            stats.bytes_sent += sum(shards[t].numel() * shards[t].element_size() for t in members.values())


def _receive(specs: list[TensorSpec], targets: dict[str, list[torch.Tensor]], tp_rank: int,
             node: dist.ProcessGroup, stats: ReadStats) -> None:
    """A member other than the root: its TP rank told to the root, then every spec's shard received from it,
    straight into its tensor where that is contiguous."""
    node.send([torch.tensor([tp_rank])], 0, 0).wait()
    for tag, spec in enumerate(specs, start=1):
        own = targets[spec.name]
        buffer = own[0] if own[0].is_contiguous() else torch.empty_like(own[0])
        node.recv([buffer], 0, tag).wait()
        _copy_into([t for t in own if t is not buffer], buffer, spec.name)
        stats.bytes_received += buffer.numel() * buffer.element_size()


def _member_tp_ranks(node: dist.ProcessGroup | None) -> dict[int, int]:
    """{node member: its TP rank} for the root: what each of the others said (`_receive`'s first message)."""
    members = {}
    for member in range(1, node.size() if node is not None else 1):
        said = torch.empty(1, dtype=torch.long)
        node.recv([said], member, 0).wait()
        members[member] = int(said)
    return members


def _copy_into(tensors: list[torch.Tensor], value: torch.Tensor, name: str) -> None:
    for tensor in tensors:
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: this rank's shard is {tuple(value.shape)} but the sharded model holds "
                             f"{tuple(tensor.shape)}")
        tensor.copy_(value)


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
    """This process's VmRSS, VmHWM (its peak RSS so far) and RssAnon, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM", "RssAnon")}


def _resident_bytes(model: nn.Module) -> int:
    """Bytes of the tensors `model` holds in host memory (each storage once; DTensors' local shards)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type == "cpu" and local.untyped_storage().data_ptr() not in seen:
            seen.add(local.untyped_storage().data_ptr())
            total += local.untyped_storage().nbytes()
    return total


@contextlib.contextmanager
def load_record(what: str) -> Iterator[dict]:
    """Around one backbone load: with $VELA_LOAD_RECORD set (a directory), write what this process read from the
    checkpoint meanwhile (`loading.BACKBONE_READS`), its host memory before and after (VmHWM: its peak) and the
    backbone it then holds (the caller puts its model under "model" in the yielded dict), one JSON file per load.
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
    out = dict(what=what, pid=os.getpid(), host=socket.gethostname(), bytes_read=BACKBONE_READS.bytes - reads[0],
               tensors_read=BACKBONE_READS.tensors - reads[1], memory_before=before, memory_after=_memory(),
               resident_bytes=_resident_bytes(model) if model is not None else 0, **record)
    path = Path(directory) / f"{os.getpid()}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(out))
