"""Zero-redundancy TP master loading (issue 37; thesis §3.3, §4.4) against every rank reading the full checkpoint.

A debug-width, full-depth Mixtral (32 layers, hidden 512, real 32000 vocabulary) is saved as a
multi-file safetensors checkpoint in a temporary directory. For each dp in {1, 2, 4} and tp in
{1, 2}, dp × tp processes (forked, gloo on 127.0.0.1) load the master's tensors (the backbone: every
tensor but the experts) two ways:

- thesis: `vela_ray.model.sharded_loading.load_sharded` — only the dp_rank-0 ranks read, each its own
  TP shard by slice, and broadcast it to their replicas; replicated tensors are read once per node;
- full: every rank reads the whole backbone into host memory (what `loading.load_backbone` /
  `from_pretrained` does per process), then keeps its TP shard.

and two destinations for the shards a rank ends with:

- device: each shard is read in full (a checksum) and dropped as it is produced (it stands in for the
  copy to the rank's GPU, which this CPU-only machine does not have), so host memory is what loading
  itself needs; the thesis loader delivers it in pieces (`on_chunk`, --chunk-mib), as a gloo-fed GPU
  master would take it;
- host: the shards stay in host memory (a CPU-resident master): dp copies of the model must then be
  resident on the node whatever the loader, and are reported as `resident`.

Measured per process: bytes requested through the reader (what the slices return: the logical disk
volume, what a node without a shared page cache — or a network file system — would read), /proc io
read_bytes (physical reads; the page cache is dropped before every run, and within one run a page read
by one process is a cache hit for the others on the node, which is why the full method's physical reads
stay near one model here), VmHWM and the RSS before loading, load time (barrier to barrier). The parent
also polls every child's /proc/<pid>/status during the run, so the per-node peak is the peak of the sum
(not the sum of peaks): anonymous memory above each child's pre-load baseline ("model-attributable") and
file-backed resident pages (the memory-mapped checkpoint: page cache, shared between processes).

Run: .venv/bin/python benchmarks/master_loading.py  (writes benchmarks/results/master_loading.json)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vela_ray.model.sharded_loading import (Layout, ReadStats, ShardReader, load_sharded,  # noqa: E402
                                            make_replica_groups, shard_range)

# tiny experts (not loaded by the master) so the checkpoint files are mostly the master's tensors: this
# VM's disk has an 8 MiB readahead, so any read pulls in its neighbourhood, experts included
CONFIG = dict(hidden_size=512, intermediate_size=16, num_hidden_layers=32, num_attention_heads=8,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=32000,
              max_position_embeddings=512, tie_word_embeddings=False)


def make_checkpoint(out: Path, max_shard_size: str) -> None:
    """Save the model and its backbone specs (built in this separate process, so the benchmark's parent
    and its forked ranks never import transformers nor hold the model)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from vela_ray.model.sharded_loading import backbone_specs

    torch.manual_seed(0)
    config = MixtralConfig(**CONFIG)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    del model
    (out / "specs.pkl").write_bytes(pickle.dumps(backbone_specs(out)))


def _status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/<pid>/status we use, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _full_then_shard(specs, layout: Layout, rank: int, on_tensor) -> tuple[dict, ReadStats]:
    """The baseline: this rank reads the whole backbone into host memory (copied out of the map, as
    `load_backbone`'s load_state_dict copies it into the module), then keeps its TP shard."""
    stats = ReadStats()
    tp, tp_rank = layout.tp, layout.tp_rank(rank)
    with ShardReader(stats) as reader:
        full = {s.name: reader.read(s.file, s.source, copy=True).to(s.dtype) for s in specs}
    out = {}
    for s in specs:
        tensor = full[s.name]
        if s.dim is not None:
            start, stop = shard_range(tensor.shape[s.dim], tp, tp_rank)
            tensor = tensor.narrow(s.dim, start, stop - start).clone()
        if on_tensor is not None:
            on_tensor(s.name, tensor)
        else:
            out[s.name] = tensor
    del full
    return out, stats


class _DeviceSink:
    """Stands in for copying each shard to the rank's GPU: reads every byte (a checksum), keeps nothing."""

    def __init__(self):
        self.checksum = 0.0

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self.checksum += float(tensor.float().sum()) if tensor.dtype != torch.float32 else float(tensor.sum())

    def chunk(self, name: str, offset: int, piece: torch.Tensor) -> None:
        self(name, piece)


def _rank(rank: int, dp: int, tp: int, port: int, method: str, sink: str, specs_file: str, out_dir: str,
          chunk_bytes: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=dp * tp)
    layout = Layout(dp, tp)
    groups = make_replica_groups(layout)
    specs = pickle.loads(Path(specs_file).read_bytes())
    on_tensor = _DeviceSink() if sink == "device" else None
    dist.barrier()
    before, io_before = _status(), _io()
    started = time.perf_counter()
    if method == "thesis":
        shards, stats = load_sharded(specs if rank == 0 else None, layout, groups, chunk_bytes=chunk_bytes,
                                     on_chunk=on_tensor.chunk if on_tensor is not None else None)
    else:
        shards, stats = _full_then_shard(specs, layout, rank, on_tensor)
    dist.barrier()
    seconds = time.perf_counter() - started
    after, io_after = _status(), _io()
    resident = sum(t.numel() * t.element_size() for t in shards.values())
    record = dict(rank=rank, dp_rank=layout.dp_rank(rank), tp_rank=layout.tp_rank(rank), seconds=seconds,
                  bytes_requested=stats.bytes_read, bytes_received=stats.bytes_received,
                  read_bytes=io_after["read_bytes"] - io_before["read_bytes"],
                  rchar=io_after["rchar"] - io_before["rchar"], rss_before=before["VmRSS"],
                  anon_before=before["RssAnon"], vm_hwm=after["VmHWM"], resident_shards=resident)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _page_cache_bytes(files: list[Path]) -> int | None:
    """Bytes of the checkpoint files in the page cache (util-linux fincore). Caches are dropped before
    each run, so this is what the node read from disk for the checkpoint (readahead included)."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(line) for line in out.split())


def run_one(dp: int, tp: int, method: str, sink: str, specs_file: Path, model_bytes: int,
            checkpoint_files: list[Path], chunk_bytes: int) -> dict:
    dropped = _drop_caches()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank, args=(dp, tp, _free_port(), method, sink, str(specs_file), out_dir,
                                                      chunk_bytes),
                                 nprocs=dp * tp, join=False, start_method="fork")
        pids = [p.pid for p in ctx.processes]
        baseline = {pid: _status(pid) for pid in pids}
        peak_anon = peak_file = peak_total = 0
        while not ctx.join(timeout=0.002):  # the node's peak is the peak of the sum over its processes
            anon = file = 0
            for pid in pids:
                try:
                    s = _status(pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if "RssAnon" not in s:  # exited (a zombie has no memory left)
                    continue
                anon += max(0, s["RssAnon"] - baseline[pid]["RssAnon"])
                file += max(0, s["RssFile"] - baseline[pid]["RssFile"])
            peak_anon, peak_file, peak_total = max(peak_anon, anon), max(peak_file, file), max(peak_total, anon + file)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(dp * tp)]
    cached = _page_cache_bytes(checkpoint_files)
    node = dict(bytes_requested=sum(r["bytes_requested"] for r in ranks),
                read_bytes=sum(r["read_bytes"] for r in ranks),
                checkpoint_page_cache=cached,
                peak_model_anon_polled=peak_anon, peak_model_file_polled=peak_file,
                peak_model_rss_polled=peak_total,
                sum_vm_hwm=sum(r["vm_hwm"] for r in ranks),
                sum_hwm_minus_baseline=sum(r["vm_hwm"] - r["rss_before"] for r in ranks),
                resident_shards=sum(r["resident_shards"] for r in ranks),
                load_seconds=max(r["seconds"] for r in ranks))
    node["peak_model_anon_beyond_resident"] = max(0, peak_anon - node["resident_shards"])
    node["anon_plus_checkpoint_page_cache"] = peak_anon + (cached or 0)
    keys = ("bytes_requested", "read_bytes", "checkpoint_page_cache", "peak_model_anon_polled",
            "peak_model_file_polled", "peak_model_rss_polled", "peak_model_anon_beyond_resident",
            "anon_plus_checkpoint_page_cache", "sum_hwm_minus_baseline", "resident_shards")
    ratios = {k: None if node[k] is None else round(node[k] / model_bytes, 3) for k in keys}
    return dict(dp=dp, tp=tp, method=method, sink=sink, caches_dropped=dropped, node=node,
                node_over_model=ratios, ranks=ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sinks", nargs="+", default=["device", "host"], choices=["device", "host"])
    parser.add_argument("--max-shard-size", default="50MB")
    parser.add_argument("--chunk-mib", type=float, default=1,
                        help="thesis, device sink: broadcast piece size (MiB; smaller: less host memory, slower)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "master_loading.json")
    parser.add_argument("--make-checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.max_shard_size)
        return
    with tempfile.TemporaryDirectory(prefix="master_loading_") as tmp:
        ckpt = Path(tmp)
        subprocess.run([sys.executable, __file__, "--make-checkpoint", str(ckpt), "--max-shard-size",
                        args.max_shard_size], check=True)
        specs_file = ckpt / "specs.pkl"
        specs = pickle.loads(specs_file.read_bytes())
        model_bytes = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in specs)
        files = sorted(p.name for p in ckpt.glob("*.safetensors"))
        checkpoint_bytes = sum((ckpt / f).stat().st_size for f in files)
        runs = []
        print(f"master tensors: {model_bytes / 2**20:.1f} MiB in {len(specs)} tensors; checkpoint "
              f"{checkpoint_bytes / 2**20:.1f} MiB in {len(files)} files; node totals over the master's bytes:")
        for sink in args.sinks:
            for tp in args.tp:
                for dp in args.dp:
                    for method in ("thesis", "full"):
                        run = run_one(dp, tp, method, sink, specs_file, model_bytes,
                                      [ckpt / f for f in files], int(args.chunk_mib * 2**20))
                        runs.append(run)
                        r = run["node_over_model"]
                        print(f"sink={sink:6} tp={tp} dp={dp} {method:6} requested {r['bytes_requested']:5.2f}x  "
                              f"page-cache {r['checkpoint_page_cache'] or float('nan'):5.2f}x  "
                              f"io {r['read_bytes']:5.2f}x  anon {r['peak_model_anon_polled']:5.2f}x  "
                              f"anon+cache {r['anon_plus_checkpoint_page_cache']:5.2f}x  "
                              f"anon-resident {r['peak_model_anon_beyond_resident']:5.2f}x  "
                              f"rss {r['peak_model_rss_polled']:5.2f}x  {run['node']['load_seconds']:6.2f}s", flush=True)
    result = dict(
        command=" ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/master_loading.py", *sys.argv[1:]]),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__,
                     load_average=os.getloadavg()),
        model=dict(family="mixtral", **CONFIG, dtype="float32", checkpoint_files=files,
                   checkpoint_bytes=checkpoint_bytes, master_tensors=len(specs), model_bytes=model_bytes,
                   model_bytes_note="the master's tensors (backbone: every tensor but the experts), what both "
                                    "methods load; the ratios are node totals over this"),
        methods=dict(thesis="dp_rank-0 ranks read their TP shard by slice (replicated tensors once per node, "
                            "round-robin) and broadcast to their replicas (vela_ray.model.sharded_loading)",
                     full="every rank reads the whole backbone into host memory, then keeps its TP shard"),
        chunk_bytes=int(args.chunk_mib * 2**20),
        sinks=dict(device="each shard is read in full (a checksum, standing in for the copy to the rank's GPU) "
                          "and dropped; thesis: delivered through load_sharded(on_chunk=...) in pieces of "
                          "chunk_bytes (gloo feeding a GPU: receivers stage one piece on the host, not a tensor); "
                          "full: whole tensors",
                   host="shards kept in host memory (CPU-resident master): `resident` counts them"),
        metrics=dict(bytes_requested="bytes the reader's slices returned, summed over ranks",
                     read_bytes="/proc/self/io read_bytes summed over ranks; caches dropped before each run; a "
                                "page one rank reads is a page-cache hit for the others on this one node; it "
                                "also counts library pages faulted back in after the drop",
                     checkpoint_page_cache="bytes of the checkpoint files in the page cache after the run "
                                           "(fincore; dropped before): the node's physical checkpoint reads, "
                                           "readahead included",
                     peak_model_anon_polled="peak over time of the node's summed anonymous RSS above each "
                                            "process's pre-load value (polled every ~2 ms by the parent)",
                     peak_model_file_polled="peak over time of the summed file-backed RSS above each process's "
                                            "pre-load value (mapped checkpoint pages, page cache shared between "
                                            "processes but counted once per process that maps them)",
                     peak_model_rss_polled="peak over time of the sum of both (anon + file-backed above baseline): "
                                           "the per-node host memory figure (an overcount where processes map the "
                                           "same pages: the full method)",
                     peak_model_anon_beyond_resident="peak_model_anon_polled minus the shards the ranks end "
                                                     "with on the host (host sink): what loading needs beyond "
                                                     "its result",
                     anon_plus_checkpoint_page_cache="peak_model_anon_polled plus checkpoint_page_cache: the "
                                                     "node's distinct host memory (the page cache counted once)",
                     sum_hwm_minus_baseline="sum over ranks of VmHWM minus RSS before loading (includes mapped "
                                            "checkpoint pages each process touched)",
                     load_seconds="slowest rank, barrier to barrier"),
        runs=runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
