"""Backbone bytes read and host memory per node when a job's masters load, DP 1-4 x TP 1-2, through the runtime.

Each setting is a real job (`VelaJob.run`, one optimizer step) on one local Ray node: `masters.count` = DP
data-parallel masters of `cluster.master_tp` = TP ranks each, DP x TP master processes (master 0 in the driver,
the others `actors.masters.MasterReplica` actors), all on this node: the worst case for "per node", since with
enough nodes `runtime.masters.peer_nodes` puts one master on each. The masters load as the runtime loads them
(`vela_ray.model.sharded_loading`: the node's first master process reads each backbone tensor once, the others
receive their shards over the node group; master 0 without TP reads the whole backbone in `Backbone.load` and
sends it on). With `--fsdp`, the DP >= 2 settings also run with `masters.shard_frozen_backbone` (FSDP2 after
loading).

Every master process records each backbone load it makes (`sharded_loading.load_record`, switched on by
$VELA_LOAD_RECORD): the bytes it read from the checkpoint (`loading.BACKBONE_READS`, the counter every backbone
read adds to), its resident set before and after (VmRSS, and its parts RssAnon, RssFile, RssShmem), its peak during
the load (VmHWM, reset as the load starts), the host bytes its load staged beyond the model
(`ReadStats.staged_bytes`) and the backbone bytes it then holds. Per node, summed over its processes:

- read / model: checkpoint bytes read over the backbone's bytes (one model: 1.00);
- peak / model: the sum of each process's peak resident growth during its load (an upper bound of the node's
  peak: the processes' peaks need not coincide), which includes the backbone each keeps, any checkpoint pages a
  reader maps (none since the reader reads with pread(2): the page cache holds them, charged to no process) and
  the code pages a process touches for the first time;
- resident / model: the bytes the node's processes keep of what their loads brought about (`loaded_bytes`: the
  backbone or its TP shards, and the LoRA shards TP sharding re-cuts; without FSDP2 each data-parallel master
  keeps its copy on the host: CPU masters; a GPU master keeps it on its GPU);
- transient / model: peak minus resident, what loading needs beyond what it leaves, in three parts: freed_by_end
  (the peak above the load's end: memory it held and freed), file_backed (RssFile and RssShmem growth: code and
  shared-library pages paged in, e.g. torch's DTensor and gloo code, shared by every process on the node) and
  anon_beyond_model (the process's own memory kept beyond the backbone: Python objects of the TP setup and the
  checkpoint's cached layout); staged / model is what the load itself held beyond the model (its chunk buffers).

The bound (issue 51): a node's peak ≤ what its masters hold + 0.1 model. With one master process per model that is
≤ 1.1 x one model; with DP masters on one node their DP copies are what they hold (each its own, FSDP2 sharding the
decoder layers only after loading). `bound` in each run says whether it holds, raw and without the code pages.

The model is a debug-width Mixtral (hidden 512, 24 layers, vocabulary 4096, untied, so the embedding and LM head
are vocabulary-parallel under TP) with small experts, saved in files of at most 4 MB (the embedding and LM head,
8 MiB each, one file apiece) with the cached tiny model's tokenizer. 24 layers, not 4 as before issue 51's memory
fix: at 4 the embedding and LM head were 28.5 % of the backbone each, so one tensor, and per-process costs that do
not grow with the model, set the ratios; at 24 the largest tensor is 9.1 % (`--layers 4` measures the old model).

Run: python benchmarks/master_loading.py --fsdp  (writes benchmarks/results/master_loading.json; ~15 min on 2 cores)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import MEASURED_ENV, command, parser, run, tiny_job, write_results  # noqa: E402
from vela_ray.model.sharded_loading import LOAD_RECORD_ENV  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "master_loading.json"
MAX_SHARD_SIZE = "4MB"  # checkpoint files: the reader opens one at a time (a real checkpoint's are ~5 GB of 100s)
CONFIG = dict(hidden_size=512, intermediate_size=64, num_hidden_layers=24, num_attention_heads=8,
              num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=4096,
              max_position_embeddings=256, tie_word_embeddings=False)


def make_model(out: Path, layers: int) -> int:
    """Save the debug Mixtral (float32, `layers` decoder layers) with the tiny model's tokenizer; returns its
    backbone bytes (every tensor the master loads: all but the experts)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from vela_ray.model.sharded_loading import backbone_specs
    from vela_ray.training.tiny_model import tiny_model_path

    torch.manual_seed(0)
    config = MixtralConfig(**{**CONFIG, "num_hidden_layers": layers})
    AutoModelForCausalLM.from_config(config).save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path() / name, out / name)
    return sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in backbone_specs(out, lambda name: None))


def run_job(model_dir: Path, out: Path, records: Path, dp: int, tp: int, fsdp: bool) -> list[dict]:
    """One job of `dp` masters x `tp` ranks; every master process's load records."""
    from vela_ray.api import VelaJob
    from vela_ray.config import JobConfig

    job = tiny_job(out, model_dir, cluster={"num_workers": 2, "num_cpus_per_worker": 0.25, "master_tp": tp},
                   masters={"count": dp, "shard_frozen_backbone": fsdp}, data={"seq_len": 32, "limit": 64},
                   training={"steps": 1, "batch_size": 8, "micro_batch_size": 8},
                   data_plane={"transport": "object_ref"})
    for stale in records.glob("*.json"):
        stale.unlink()
    VelaJob(JobConfig.from_dict(job)).run()
    return [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]


def node_figures(loads: list[dict], model_bytes: int) -> dict:
    """The node's sums over its processes' loads (see the module docstring), and their ratios to one model."""
    peak: dict[int, dict] = {}
    for load in loads:  # a process that loads twice (master 0: read, then send) counts its larger peak
        growth = load["memory_after"]["VmHWM"] - load["memory_before"]["VmRSS"]
        if growth >= peak.get(load["pid"], {}).get("growth", -1):
            peak[load["pid"]] = dict(growth=growth, load=load)
    # what the peak's load brought about and keeps: its backbone (or TP shards, and the LoRA shards TP sharding
    # re-cut), not what the process held before (master 0's backbone when it only sends, LoRA peft drew before)
    resident = {pid: p["load"].get("loaded_bytes", p["load"]["resident_bytes"]) for pid, p in peak.items()}

    def grown(field: str) -> int:
        return sum(p["load"]["memory_after"].get(field, 0) - p["load"]["memory_before"].get(field, 0)
                   for p in peak.values())

    node = dict(processes=len(peak), bytes_read=sum(load["bytes_read"] for load in loads),
                bytes_sent=sum(load.get("bytes_sent", 0) for load in loads),
                bytes_received=sum(load.get("bytes_received", 0) for load in loads),
                readers=sum(1 for load in loads if load["bytes_read"] > 0),
                peak_growth=sum(p["growth"] for p in peak.values()), resident=sum(resident.values()))
    node["transient"] = node["peak_growth"] - node["resident"]
    # the transient's parts: memory the load freed before it ended (its peak above its end), pages of code and
    # shared libraries it paged in (RssFile: nothing maps the checkpoint), and its own memory kept beyond the model
    node["freed_by_end"] = sum(p["load"]["memory_after"]["VmHWM"] - p["load"]["memory_after"]["VmRSS"]
                               for p in peak.values())
    node["file_backed"] = grown("RssFile") + grown("RssShmem")
    node["anon_beyond_model"] = node["transient"] - node["freed_by_end"] - node["file_backed"]
    node["staged"] = sum(max(load.get("staged_bytes", 0) for load in loads if load["pid"] == pid) for pid in peak)
    ratios = {k: round(node[k] / model_bytes, 3) for k in ("bytes_read", "peak_growth", "resident", "transient",
                                                            "freed_by_end", "file_backed", "anon_beyond_model",
                                                            "staged")}
    ratios["peak_less_file_backed"] = round((node["peak_growth"] - node["file_backed"]) / model_bytes, 3)
    return dict(node=node, over_model=ratios)


def bound(node: dict, model_bytes: int) -> dict:
    """Whether the node's peak is within what its masters hold + 0.1 model (issue 51), raw and without the code
    pages (`file_backed`), and within 1.1 x one model."""
    limit = node["resident"] + 0.1 * model_bytes
    return {"peak <= resident + 0.1 model": node["peak_growth"] <= limit,
            "peak - file_backed <= resident + 0.1 model": node["peak_growth"] - node["file_backed"] <= limit,
            "peak <= 1.1 model": node["peak_growth"] <= 1.1 * model_bytes}


def resumed(out: Path, header: dict) -> list[dict]:
    """The runs a stopped run left in `out` (`--resume`), if it measured the same model; each keeps its own
    measurements (every setting is a job of its own)."""
    if out is None or not Path(out).is_file():
        return []
    previous = json.loads(Path(out).read_text())
    if previous.get("model") != header["model"] or previous.get("command") != header["command"]:
        return []
    return previous.get("runs", [])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, RESULTS)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 3, 4], help="data-parallel masters")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel ranks per master")
    p.add_argument("--fsdp", action="store_true", help="also run DP >= 2 with masters.shard_frozen_backbone")
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="decoder layers of the model")
    p.add_argument("--resume", action="store_true",
                   help="keep the settings --out holds already (same model and command otherwise) and run the rest")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="master_loading_"))
    records = work / "records"
    records.mkdir()
    os.environ.update({LOAD_RECORD_ENV: str(records), **MEASURED_ENV})  # before Ray starts: its workers inherit it
    import ray

    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {LOAD_RECORD_ENV: str(records), "TOKENIZERS_PARALLELISM": "false",
                                       **MEASURED_ENV}})
    try:
        return measure(args, argv, work, records)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def measure(args, argv: list[str] | None, work: Path, records: Path) -> int:
    """Every setting's job and its figures, written to `args.out` after each (see `main`)."""
    model_bytes = make_model(work / "model", args.layers)
    measuring = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--resume"]
    header = dict(
        command=command(__file__, measuring),  # --resume aside: what the runs measured
        model=dict(family="mixtral", **{**CONFIG, "num_hidden_layers": args.layers}, dtype="float32",
                   backbone_bytes=model_bytes),
        model_note=("24 decoder layers (4 before issue 51's loading fix): at 4 the embedding and LM head (8 MiB each) "
                    "were 28.5% of the backbone each; at 24 the largest tensor is 9.1%. --layers 4 measures the old "
                    "model") if args.layers == 24 else f"{args.layers} decoder layers",
        layout="every master process on this one node (one local Ray node)",
        bound=("a node's peak <= what its masters hold + 0.1 model (= 1.1 x one model with one master process per "
               "model; DP masters on one node each hold their copy); the code pages (file_backed) are no memory "
               "of the loading scheme: torch's code, shared by the node's processes"),
        metrics={"bytes_read": "checkpoint bytes the node's master processes read (loading.BACKBONE_READS)",
                 "readers": "loads that read anything (1: one process read for the node)",
                 "peak_growth": "sum over the node's master processes of VmHWM during the load (reset as it "
                                "starts) minus VmRSS before it: an upper bound of the node's peak growth",
                 "resident": "bytes of the tensors each master process's load (its peak one) brought about and holds "
                             "after it, summed: its backbone or TP shards (host memory here; and the LoRA shards "
                             "TP sharding re-cuts), not LoRA drawn before the load (loaded_bytes of load_record)",
                 "transient": "peak_growth minus resident: host memory loading needs beyond what it leaves",
                 "freed_by_end": "sum of VmHWM minus VmRSS at the load's end: memory held during the load and freed",
                 "file_backed": "sum of RssFile + RssShmem growth during the load: code and shared-library pages "
                                "paged in (nothing maps the checkpoint: it is read with pread(2))",
                 "anon_beyond_model": "transient minus freed_by_end minus file_backed: the processes' own memory kept "
                                      "beyond the backbone (TP setup objects, the checkpoint's cached layout)",
                 "staged": "sum of ReadStats.staged_bytes: host bytes the loads held beyond the model (chunk buffers)",
                 "peak_less_file_backed": "peak_growth minus file_backed"},
    )
    settings = [(dp, tp, False) for tp in args.tp for dp in args.dp]
    settings += [(dp, tp, True) for tp in args.tp for dp in args.dp if args.fsdp and dp > 1]
    runs = resumed(args.out, header) if args.resume else []
    done = {(r["dp"], r["tp"], r["shard_frozen_backbone"]) for r in runs}
    if runs:  # which settings a stopped run of this command measured
        header["resumed"] = dict(kept=[list(s) for s in sorted(done)])
    for dp, tp, fsdp in settings:
        if (dp, tp, fsdp) in done:
            continue
        start = time.perf_counter()
        loads = run_job(work / "model", work / f"dp{dp}-tp{tp}-fsdp{int(fsdp)}", records, dp, tp, fsdp)
        figures = node_figures(loads, model_bytes)
        figures["bound"] = bound(figures["node"], model_bytes)
        runs.append(dict(dp=dp, tp=tp, shard_frozen_backbone=fsdp, job_seconds=time.perf_counter() - start,
                         **figures, loads=loads))
        r = figures["over_model"]
        print(f"dp={dp} tp={tp} fsdp={int(fsdp)}: {figures['node']['processes']} processes, read "
              f"{r['bytes_read']:.2f}x  peak {r['peak_growth']:.3f}x  resident {r['resident']:.3f}x  "
              f"transient {r['transient']:.3f}x (freed {r['freed_by_end']:.3f}x, code pages "
              f"{r['file_backed']:.3f}x, anon beyond model {r['anon_beyond_model']:.3f}x; staged "
              f"{r['staged']:.4f}x)  (one model = {model_bytes / 2**20:.1f} MiB)", flush=True)
        left = [s for s in settings if s not in {(r["dp"], r["tp"], r["shard_frozen_backbone"]) for r in runs}]
        # after every setting: a run stopped midway (an outside `ray stop`) keeps what it measured
        write_results(args.out, dict(header, runs=runs, settings_left=[list(s) for s in left]))
    return 0


if __name__ == "__main__":
    run(main, quiet=("vela_ray", "actors"))
