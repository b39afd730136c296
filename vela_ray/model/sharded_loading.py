"""Zero-redundancy loading of a tensor-parallel (TP) master from safetensors (issue 37; thesis §3.3, §4.4).

The master's ranks form a 2-D layout, `dp` data-parallel replicas × `tp` tensor-parallel ranks,
global rank = dp_rank * tp + tp_rank. Each rank needs the TP shard of every backbone tensor for its
tp_rank. Loading every rank's shard from disk (or, worse, the whole checkpoint on every rank, then
slicing) reads and holds dp × the model on a node. Here, as in the thesis:

- only the ranks of the first data-parallel replica (dp_rank 0) read, one per TP shard index, and
  each reads only its own shard of each tensor, by slice from the memory-mapped safetensors file
  (`safe_open(...).get_slice(name)[...]`), so the full tensor is never materialised;
- each reader broadcasts the shard to the other replicas holding the same tp index (its "replica
  group": the ranks {d * tp + t}), with `dist.broadcast` over that group;
- a replicated tensor (norms, routers, embeddings under the default plan) is read once per node by
  one reader (round-robin over the dp_rank-0 ranks, to spread the I/O) and broadcast to every rank.

So the bytes read from disk in total are one model's whatever dp and tp are, and the host memory a
rank needs for loading is one tensor's shard at a time (each is moved to `device` as it arrives), or
one piece of `chunk_bytes` with `on_chunk` (a gloo-fed GPU master; with NCCL the buffers are on the
GPU anyway): nothing like dp copies of the model on the host. A reader keeps one checkpoint file
mapped at a time and reads the files in storage order.

The tensor list ("specs") is built on global rank 0 from metadata only (the checkpoint index, the
config's meta-device skeleton, the safetensors headers) and broadcast as a Python object, so ranks
other than the readers open no checkpoint file at all.

What is sharded where is a `ShardPlan`: any callable from a tensor name to the dimension to split, or
None to replicate. `TPShardPlan` is the default for the families' naming (Megatron / thesis §3.1–3.2):
column-parallel q/k/v and MLP gate/up (shared experts included) on dim 0 of the [out, in] weight,
row-parallel o_proj / down_proj on dim 1, LoRA adapters consistently (lora_B of a column-parallel
module on dim 0, lora_A of a row-parallel one on dim 1, the other adapter replicated), everything
else replicated. Fused projections (qkv_proj, gate_up_proj) are not split by this plan: an even split
of a fused [q; k; v] would mix q and k rows on one rank; the TP modules' own plan must say how.

Backbone names come from `vela_ray.model.loading`: its checkpoint index and its mapping of checkpoint
names to model names through transformers' key converters (renames are free: the slice is read under
the checkpoint name). A backbone tensor that transformers *converts* (lara_mini's fused in_proj split
in four, inkling2's padded lm_head) needs the whole source tensors: its reader reads them whole,
converts them with `loading.convert_whole` and keeps its shard; this is counted (and logged) as a
full-tensor read. Experts are never read here: the master does not hold them (ExpertManagers do).

Resume: `load_sharded_files` takes any safetensors files of unsharded tensors (a peft
adapter_model.safetensors, optimizer moments saved under their parameter's name) through the same
read-by-slice-and-broadcast path; Adam's moments have their parameter's shape, so the same plan
applies to them with the parameter's name. `broadcast_from_replica_root` is the hook for state a
dp_rank-0 rank already holds in memory (e.g. a TP-sharded optimizer state dict loaded by that rank
alone): it sends it to the rank's replicas.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

logger = logging.getLogger(__name__)

ShardPlan = Callable[[str], int | None]
"""Tensor name -> the dimension its TP shards split, or None to replicate it on every tp rank."""

_COLWISE = (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$",)
_ROWWISE = (r"\.(o_proj|down_proj)\.weight$",)
_COL_MODULES = r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\."
_ROW_MODULES = r"\.(o_proj|down_proj)\."


@dataclass(frozen=True)
class TPShardPlan:
    """The default shard plan: first matching rule wins; regular expressions searched in the name.

    Rules are explicit tuples so a family with other names (or a plan that shards the embeddings
    on the vocabulary, `extra=((r"embed_tokens\\.weight$", 0),)`) is a one-line variant, not a
    subclass. Experts (".experts.") are never matched: the master does not load them."""

    colwise: tuple[str, ...] = _COLWISE
    rowwise: tuple[str, ...] = _ROWWISE
    extra: tuple[tuple[str, int | None], ...] = ()  # (pattern, dim) checked before everything else
    lora: bool = True  # shard LoRA adapters as thesis §3.2

    def __call__(self, name: str) -> int | None:
        for pattern, dim in self.extra:
            if re.search(pattern, name):
                return dim
        if ".experts." in name:
            return None
        if self.lora and (".lora_A." in name or ".lora_B." in name):
            # column-parallel W: B [out, r] split on out, A replicated; row-parallel W: A [r, in] split on in
            if re.search(_COL_MODULES, name):
                return 0 if ".lora_B." in name else None
            if re.search(_ROW_MODULES, name):
                return 1 if ".lora_A." in name else None
            return None
        if any(re.search(p, name) for p in self.colwise):
            return 0
        if any(re.search(p, name) for p in self.rowwise):
            return 1
        return None


DEFAULT_PLAN = TPShardPlan()


@dataclass(frozen=True)
class Layout:
    """dp × tp ranks, tp fastest: rank = dp_rank * tp + tp_rank (Megatron's order, so a TP group is
    a block of consecutive ranks, on one node)."""

    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def rank_of(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def replica_ranks(self, tp_rank: int) -> list[int]:
        """The ranks holding TP shard `tp_rank`: one per data-parallel replica; the first reads."""
        return [self.rank_of(d, tp_rank) for d in range(self.dp)]


def make_replica_groups(layout: Layout) -> list[dist.ProcessGroup | None]:
    """The process group of each tp index's replicas (None where dp == 1: nothing to send).

    Collective: every rank calls it, with the same layout, as `dist.new_group` requires."""
    if layout.dp == 1:
        return [None] * layout.tp
    return [dist.new_group(layout.replica_ranks(t)) for t in range(layout.tp)]


def shard_range(size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) of shard `tp_rank` of a dimension of `size`. Uneven splits are refused: the TP
    modules split heads and features evenly, and a silent uneven split would misalign them."""
    if size % tp:
        raise ValueError(f"a dimension of size {size} does not split evenly over tp={tp}")
    step = size // tp
    return tp_rank * step, (tp_rank + 1) * step


def shard_shape(shape: Iterable[int], dim: int | None, tp: int) -> tuple[int, ...]:
    shape = tuple(shape)
    if dim is None:
        return shape
    return shape[:dim] + (shape[dim] // tp,) + shape[dim + 1:]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to load: its name on the ranks, where it is stored, its full shape and dtype, its
    shard dimension. `source` is the checkpoint name (a renamed tensor reads under it); `convert` marks
    a backbone tensor transformers converts from whole tensors (read whole, see the module docstring)."""

    name: str
    file: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None
    convert: bool = False


@dataclass
class ReadStats:
    """What one rank read and received: bytes requested from the checkpoint (what the slices return,
    i.e. what a disk without a page cache would have to deliver) and bytes received by broadcast."""

    bytes_read: int = 0
    tensors_read: int = 0
    full_tensor_reads: int = 0  # tensors read whole although the plan shards them (converted sources)
    bytes_received: int = 0
    seconds: float = 0.0
    files_opened: list[str] = field(default_factory=list)


class ShardReader:
    """Reads TP shards by slice from memory-mapped safetensors files, counting the bytes it reads.

    One file is kept open (mapped) at a time: the pages a map has touched count in the process's RSS
    while it is mapped, so reading file by file (specs are ordered so) bounds that to one file's worth
    instead of the whole checkpoint. A context manager so the last map is closed."""

    def __init__(self, stats: ReadStats | None = None):
        self.stats = stats if stats is not None else ReadStats()
        self._file: str | None = None
        self._ctx = None
        self._handle_obj = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
        self._file = self._ctx = self._handle_obj = None

    def _handle(self, file: str):
        if file != self._file:
            self._close()
            self._ctx = safe_open(file, "pt")
            self._handle_obj = self._ctx.__enter__()
            self._file = file
            if file not in self.stats.files_opened:
                self.stats.files_opened.append(file)
        return self._handle_obj

    def read(self, file: str | Path, name: str, dim: int | None = None, tp: int = 1,
             tp_rank: int = 0, copy: bool = False) -> torch.Tensor:
        """Shard `tp_rank` of `tp` of tensor `name` along `dim` (the whole tensor when dim is None),
        read by slice: only the shard's pages are touched.

        safetensors returns a view of the memory map (lazy: pages are read when the data is used), so
        without `copy` a dim-0 shard costs no host memory beyond the page cache until it is used (sent,
        copied to a GPU). `copy=True` returns memory of its own: what a tensor kept on the host needs,
        or it would pin the checkpoint's mapping (and change, or fault, if the file were rewritten)."""
        piece = self._handle(str(file)).get_slice(name)
        if dim is None:
            tensor = piece[:]
        else:
            shape = piece.get_shape()
            start, stop = shard_range(shape[dim], tp, tp_rank)
            tensor = piece[(slice(None),) * dim + (slice(start, stop),)]
        if not tensor.is_contiguous():  # a dim>0 shard: gather its rows once (collectives need contiguous)
            tensor = tensor.contiguous()
        elif copy:
            tensor = tensor.clone()
        self.stats.bytes_read += tensor.numel() * tensor.element_size()
        self.stats.tensors_read += 1
        return tensor


def safetensors_specs(files: Iterable[str | Path] | Mapping[str, str | Path], plan: ShardPlan = DEFAULT_PLAN,
                      dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """Specs of every tensor in plain safetensors files (resume: LoRA adapters, optimizer moments),
    from their headers only. A mapping {tensor name: file} (a sharded checkpoint's index) restricts
    the names; names are taken as they are stored."""
    if isinstance(files, Mapping):
        by_file: dict[str, list[str]] = {}
        for name, file in files.items():
            by_file.setdefault(str(file), []).append(name)
    else:
        by_file = {str(f): None for f in files}
    specs = []
    for file, names in by_file.items():
        with safe_open(file, "pt") as handle:
            for name in (names if names is not None else sorted(handle.keys())):
                piece = handle.get_slice(name)
                stored = _dtype_of(piece.get_dtype())
                specs.append(TensorSpec(name, file, name, tuple(piece.get_shape()), dtype or stored, plan(name)))
    return order_by_storage(specs)


def _data_offsets(file: str) -> dict[str, int]:
    """{tensor name: byte offset of its data} from a safetensors header (8-byte length, then JSON)."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def order_by_storage(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Specs in file order, then in the order of their data in the file: each reader then reads each
    file once, forward (sequential I/O, readahead useful), with one file mapped at a time."""
    offsets: dict[str, dict[str, int]] = {}
    for spec in specs:
        if spec.file not in offsets:
            offsets[spec.file] = _data_offsets(spec.file)
    return sorted(specs, key=lambda s: (s.file, offsets[s.file].get(s.source, 0)))


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _dtype_of(name: str) -> torch.dtype:
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"safetensors dtype {name} is not supported by the sharded loader")
    return _SAFETENSORS_DTYPES[name]


def backbone_specs(model_dir: str | Path, plan: ShardPlan = DEFAULT_PLAN, dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False) -> list[TensorSpec]:
    """Specs of the master's tensors (every model tensor but the experts) under the model's names,
    through `loading`'s checkpoint index and key mapping; shapes are the model's (the meta skeleton's),
    dtypes `dtype` or the config's (as `load_backbone`). Metadata only: no weights are read."""
    from transformers import AutoConfig

    from vela_ray.model import loading
    from vela_ray.model.dtypes import torch_dtype

    key = loading.model_key(model_dir, trust_remote_code)
    ckpt = loading.checkpoint_layout(key)
    config = AutoConfig.from_pretrained(key)
    dtype = torch_dtype(dtype or getattr(config, "dtype", None) or torch.float32)
    experts = tuple(f"{path}." for path in ckpt.experts_paths)
    specs = []
    for target, source in ckpt.sources.items():
        if target.startswith(experts):
            continue
        dim = plan(target)
        converted = source.converter is not None
        if converted and dim is not None:
            logger.info("%s is converted by transformers from %s: its reader reads the sources whole",
                        target, list(source.names))
        specs.append(TensorSpec(target, str(source.files[0]), source.names[0], tuple(ckpt.shapes[target]), dtype,
                                dim, converted))
    return order_by_storage(specs)


class _Converted:
    """Whole-tensor conversions for `convert` specs, each run once per source and dropped when its
    targets have all been taken (a Split makes several targets from one source)."""

    def __init__(self, model_dir: str | None, stats: ReadStats):
        self.model_dir = model_dir
        self.stats = stats
        self._done: dict[str, torch.Tensor] = {}

    def take(self, reader: ShardReader, spec: TensorSpec) -> torch.Tensor:
        from vela_ray.model import loading

        if spec.name not in self._done:
            ckpt = loading.checkpoint_layout(self.model_dir)
            source = ckpt.sources[spec.name]
            with loading.OpenFiles() as files:
                out = loading.convert_whole(files, source, ckpt.skeleton)
            for n in source.names:  # what convert_whole read, whole
                self.stats.bytes_read += _nbytes_of(reader, str(source.files[source.names.index(n)]), n)
                self.stats.tensors_read += 1
            self.stats.full_tensor_reads += 1
            self._done.update(out)
        return self._done.pop(spec.name)


def _nbytes_of(reader: ShardReader, file: str, name: str) -> int:
    piece = reader._handle(file).get_slice(name)
    n = 1
    for s in piece.get_shape():
        n *= s
    return n * _dtype_of(piece.get_dtype()).itemsize


def _comm_device(group) -> torch.device:
    """Where a broadcast buffer must live for `group`'s backend: NCCL broadcasts device memory (the
    thesis's GPU-to-GPU broadcast), gloo host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_sharded(specs: list[TensorSpec] | None, layout: Layout, replica_groups: list | None = None,
                 device: torch.device | str = "cpu", model_dir: str | Path | None = None,
                 on_tensor: Callable[[str, torch.Tensor], None] | None = None,
                 on_chunk: Callable[[str, int, torch.Tensor], None] | None = None,
                 chunk_bytes: int = 16 << 20,
                 ) -> tuple[dict[str, torch.Tensor], ReadStats]:
    """This rank's TP shard of every tensor in `specs`, read once per node (see the module docstring).

    Collective over the default group of dp × tp ranks. `specs` matters on global rank 0 only (others
    may pass None): it is broadcast from there. `replica_groups` is `make_replica_groups(layout)` (made
    here when None). `model_dir` is needed for converted specs only.

    Where the shards go, one of:
    - returned, on `device` (default): each is moved there as it arrives; on a CPU `device` the result
      owns its memory (never a view of the checkpoint's map);
    - `on_tensor(name, shard)`, nothing returned: e.g. copy each shard straight into its module. On a
      reader the shard may be a view of the checkpoint's memory map: copy it, do not keep it;
    - `on_chunk(name, offset, piece)`, nothing returned: the shard, flattened, in pieces of at most
      `chunk_bytes` at element `offset`; the broadcast runs piece by piece through one reused host
      buffer, so a receiving rank's host memory for loading is `chunk_bytes`, not a whole tensor (with
      gloo feeding a GPU master: copy each piece into `param.view(-1)[offset:offset + n]`)."""
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout {layout.dp}x{layout.tp} does not match world size {dist.get_world_size()}")
    if on_tensor is not None and on_chunk is not None:
        raise ValueError("pass on_tensor or on_chunk, not both")
    started = time.perf_counter()
    box = [specs if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    specs = box[0]
    if replica_groups is None:
        replica_groups = make_replica_groups(layout)
    dp_rank, tp_rank = layout.dp_rank(rank), layout.tp_rank(rank)
    my_group = replica_groups[tp_rank]
    keep_on_host = torch.device(device).type == "cpu" and on_tensor is None and on_chunk is None
    stats = ReadStats()
    converted = _Converted(str(model_dir) if model_dir is not None else None, stats)
    staging: dict[tuple, torch.Tensor] = {}  # on_chunk: one reused receive buffer per (dtype, device)
    out: dict[str, torch.Tensor] = {}
    replicated = 0
    with ShardReader(stats) as reader:
        for spec in specs:
            if spec.dim is None:  # one reader for the node, round-robin over the first replica's ranks
                src = layout.rank_of(0, replicated % layout.tp)
                replicated += 1
                group, shard_index, tp_of_read = None, 0, 1
            else:
                src = layout.rank_of(0, tp_rank)
                group, shard_index, tp_of_read = my_group, tp_rank, layout.tp
            shape = shard_shape(spec.shape, spec.dim, tp_of_read)
            if rank == src:
                tensor = _read_spec(reader, converted, spec, tp_of_read, shard_index, copy=keep_on_host)
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{spec.name}: stored shard {list(tensor.shape)}, expected {list(shape)}")
            else:
                tensor = None
            group_size = layout.world_size if spec.dim is None else layout.dp
            if on_chunk is not None:
                _broadcast_in_chunks(spec, shape, tensor, src, group if group_size > 1 else False, on_chunk,
                                     chunk_bytes, staging, stats)
                continue
            if group_size > 1:
                comm = _comm_device(group)
                buffer = (tensor.to(comm) if tensor is not None else torch.empty(shape, dtype=spec.dtype,
                                                                                    device=comm))
                dist.broadcast(buffer, src=src, group=group)
                if tensor is None:
                    stats.bytes_received += buffer.numel() * buffer.element_size()
                tensor = buffer
            tensor = tensor.to(device)
            if on_tensor is not None:
                on_tensor(spec.name, tensor)
            else:
                out[spec.name] = tensor
    stats.seconds = time.perf_counter() - started
    logger.debug("rank %d (dp %d, tp %d): read %d B in %d tensors, received %d B, %.2fs", rank, dp_rank, tp_rank,
                 stats.bytes_read, stats.tensors_read, stats.bytes_received, stats.seconds)
    return out, stats


def _broadcast_in_chunks(spec: TensorSpec, shape: tuple[int, ...], tensor: torch.Tensor | None, src: int, group,
                         on_chunk: Callable[[str, int, torch.Tensor], None], chunk_bytes: int,
                         staging: dict, stats: ReadStats) -> None:
    """`tensor` (on the reader; None elsewhere) delivered to `on_chunk` piece by piece on every rank of
    `group` (False: this rank alone), through one reused buffer per dtype on the receivers."""
    numel = torch.Size(shape).numel()
    step = max(1, chunk_bytes // spec.dtype.itemsize)
    flat = tensor.reshape(-1) if tensor is not None else None
    comm = _comm_device(group) if group is not False else torch.device("cpu")
    for offset in range(0, numel, step):
        n = min(step, numel - offset)
        if flat is not None:
            piece = flat[offset:offset + n]
            if group is not False:
                dist.broadcast(piece.to(comm), src=src, group=group)
        else:
            key = (spec.dtype, comm)
            if key not in staging:
                staging[key] = torch.empty(step, dtype=spec.dtype, device=comm)
            piece = staging[key][:n]
            dist.broadcast(piece, src=src, group=group)
            stats.bytes_received += n * spec.dtype.itemsize
        on_chunk(spec.name, offset, piece)


def _read_spec(reader: ShardReader, converted: _Converted, spec: TensorSpec, tp: int, tp_rank: int,
               copy: bool = False) -> torch.Tensor:
    """Reader side of one spec: the shard by slice, or (a converted tensor) the whole conversion then its shard."""
    if spec.convert:
        if converted.model_dir is None:
            raise ValueError(f"{spec.name} is converted from whole checkpoint tensors: pass model_dir")
        whole = converted.take(reader, spec)
        if spec.dim is not None:
            start, stop = shard_range(whole.shape[spec.dim], tp, tp_rank)
            whole = whole.narrow(spec.dim, start, stop - start)
        return whole.to(spec.dtype).contiguous()
    return reader.read(spec.file, spec.source, spec.dim, tp, tp_rank, copy=copy).to(spec.dtype)


def load_backbone_shards(model_dir: str | Path, layout: Layout, plan: ShardPlan = DEFAULT_PLAN,
                         dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                         replica_groups: list | None = None, trust_remote_code: bool = False,
                         **deliver) -> tuple[dict[str, torch.Tensor], ReadStats]:
    """This rank's TP shard of the master's backbone tensors (model names), read once per node.

    Collective. Specs are built on global rank 0 only, so the other ranks open no checkpoint file.
    Tied embeddings are not in the checkpoint and not in the result (tie them on the module).
    `deliver`: `on_tensor` / `on_chunk` / `chunk_bytes` of `load_sharded`."""
    specs = backbone_specs(model_dir, plan, dtype, trust_remote_code) if dist.get_rank() == 0 else None
    from vela_ray.model import loading

    key = loading.model_key(model_dir, trust_remote_code) if specs is not None and any(s.convert for s in specs) \
        else str(model_dir)
    return load_sharded(specs, layout, replica_groups, device, model_dir=key, **deliver)


def load_sharded_files(files: Iterable[str | Path] | Mapping[str, str | Path], layout: Layout,
                       plan: ShardPlan = DEFAULT_PLAN, dtype: torch.dtype | None = None,
                       device: torch.device | str = "cpu", replica_groups: list | None = None,
                       **deliver) -> tuple[dict[str, torch.Tensor], ReadStats]:
    """Resume's path: this rank's TP shard of every tensor in unsharded safetensors files (LoRA
    adapters, optimizer moments under their parameter's name), read once per node. Collective; the
    files are opened on rank 0 (headers) and by the readers only."""
    specs = safetensors_specs(files, plan, dtype) if dist.get_rank() == 0 else None
    return load_sharded(specs, layout, replica_groups, device, **deliver)


def broadcast_from_replica_root(state: Mapping[str, torch.Tensor] | None, layout: Layout,
                                replica_groups: list, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """State a dp_rank-0 rank holds (e.g. its TP shard of the optimizer state, loaded by it alone from
    a per-tp-rank file) sent to the other replicas of its tp index; returns it on every rank.

    Collective over every rank. Only the replica roots pass `state` (others pass None); the names,
    shapes and dtypes travel first as an object so the receivers can allocate."""
    rank = dist.get_rank()
    tp_rank = layout.tp_rank(rank)
    group = replica_groups[tp_rank]
    root = layout.rank_of(0, tp_rank)
    if group is None:  # dp == 1: nothing to send
        return {k: v.to(device) for k, v in (state or {}).items()}
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in state.items()] if rank == root else None]
    dist.broadcast_object_list(meta, src=root, group=group)
    comm = _comm_device(group)
    out = {}
    for name, shape, dtype in meta[0]:
        buffer = state[name].to(comm).contiguous() if rank == root else torch.empty(shape, dtype=dtype, device=comm)
        dist.broadcast(buffer, src=root, group=group)
        out[name] = buffer.to(device)
    return out


# --- a runtime rank of a tensor-parallel master (`cluster.master_tp`) --------------------------------------------

def _tp_dims(plan, prefix: str) -> dict[str, int]:
    """Checkpoint (model) tensor name -> the dim this rank's shard splits, from what `parallelize_backbone` did:
    column-parallel weights and biases on dim 0, row-parallel weights on dim 1, vocab-parallel embedding and LM head
    on dim 0. `prefix`: the module paths' prefix before the model's own names (peft's "base_model.model.")."""
    dims: dict[str, int] = {}
    for path, style in plan.styles.items():
        name = path[len(prefix):] if path.startswith(prefix) else path
        dims[f"{name}.weight"] = 0 if style == "colwise" else 1
        if style == "colwise":
            dims[f"{name}.bias"] = 0
    for path in plan.vocab_parallel:
        dims[f"{path[len(prefix):] if path.startswith(prefix) else path}.weight"] = 0
    return dims


def read_tp_shards(model: torch.nn.Module, plan, model_dir: str | Path, dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False) -> ReadStats:
    """Fill a tensor-parallel rank's backbone (a `loading.backbone_skeleton`, peft-wrapped and sharded by
    `tensor_parallel.parallelize_backbone` with `plan`) from the checkpoint: each sharded tensor's own shard read by
    slice, each replicated one whole; nothing else is read and no full copy of a sharded tensor is made. What a
    rank holds is then what `load_backbone` + `parallelize_backbone` give it, read at 1/T of the sharded bytes.
    A row-parallel bias stays on rank 0 only (zero elsewhere), as `parallelize_backbone` leaves it."""
    from vela_ray.model import loading

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = "base_model.model." if inner is not model else ""
    dims = _tp_dims(plan, prefix)
    key = loading.model_key(model_dir, trust_remote_code)
    specs = backbone_specs(key, dims.get, dtype, trust_remote_code)
    targets: dict[str, list[torch.Tensor]] = {}  # checkpoint name -> the model's tensors holding it
    for name, tensor in [*inner.named_parameters(), *inner.named_buffers()]:
        if tensor.device.type != "meta" and ".lora_" not in name:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a vocab-parallel DTensor
            # peft's wrappers: a LoRA layer's base, a module trained in full (its frozen original and its copy)
            targets.setdefault(re.sub(r"\.(base_layer|original_module|modules_to_save\.[^.]+)\.", ".", name),
                               []).append(local)
    stats, start = ReadStats(), time.perf_counter()
    converted = _Converted(key, stats)
    with ShardReader(stats) as reader, torch.no_grad():
        for spec in specs:
            if spec.name not in targets:  # tied to a tensor read under another name
                continue
            value = _read_spec(reader, converted, spec, plan.size, plan.rank)
            for target in targets[spec.name]:
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"{spec.name}: this rank's shard is {tuple(value.shape)} but the sharded model "
                                     f"holds {tuple(target.shape)}")
                target.copy_(value)
        for path, style in plan.styles.items():
            bias = model.get_submodule(path)
            bias = getattr(bias.get_base_layer() if hasattr(bias, "get_base_layer") else bias, "bias", None)
            if style == "rowwise" and bias is not None and plan.rank != 0:
                bias.zero_()  # added once, by rank 0's partial sum
    if getattr(inner.config, "tie_word_embeddings", False):
        inner.tie_weights()
    stats.seconds = time.perf_counter() - start
    return stats
