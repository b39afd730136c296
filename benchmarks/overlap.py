"""The step in parallel (issue 46): serial against overlapped steps on the emulated 3-node cluster.

Reads top to bottom:
  1. bring up the emulated cluster as benchmarks/vela_vs_ep.py --paper does (deploy/emulated_cluster.py: 3 nodes
     of 2 ExpertManagers, each node's loopback shaped to `--intra-mbit` (1600) and cross-node links to 1/15.6 of
     it, the paper's tier ratio), and probe the links;
  2. inside node 0, fine-tune each model twice per repeat, back to back and in alternating order: `serial`
     (`training.overlap.micro_batches_in_flight: 1`, today's step) and `overlapped` (`--in-flight` micro-batches
     at once; the shared experts computed while the routed rows are away where the model has them). Both runs
     split each batch of `--batch-size` rows into the same micro-batches (`--micro-batch-size`) and train with the
     same placement (the first run of a model solves it, vela-ray's defaults; the others read it from a file), so
     they move the same bytes and compute the same losses;
     the models: the tiny pre-trained Mixtral (`vela build-tiny-model`) and a shared-expert model of the same
     size (DeepSeek-V3's architecture, random weights, the tiny Mixtral's tokenizer: built here once);
  3. per run: median step time, the master's idle fraction (the seconds of a step in which every micro-batch
     waited on the experts, `StepRecord.master_idle_s`, over the step time), each worker's busy fraction (its
     expert compute over the training time), bytes per step by link tier, the losses, and the cost model's
     predicted step (`placement.cost.predict_step`, from what the job measured before training) against the
     measured one; per model the overlapped/serial step-time ratio (the goal: <= 0.75 at equal bytes); and the
     machine's cores while each run trained (`vela_vs_ep.CpuSampler`: their busy share, the CPU seconds a step
     takes over every process, the cores master 0's process kept busy);
  4. write results.json, results.md and step_time.png to benchmarks/results/overlap/.

Run (as root, ~10 minutes on 2 cores):  python benchmarks/overlap.py
Options beyond its own are vela_vs_ep.py's (cluster, links, `--micro-batch-size` 2 and `--in-flight` 2 here).
What the figures leave out: on 2 cores the master, its micro-batch threads and the 6 workers share the same
cores, so an overlapped master competes with the workers for CPU time; `--no-emulate` (no root) runs on an
unshaped ray.cluster_utils cluster, where nothing waits on a link and overlap can only hide worker compute.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/overlap.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks import vela_vs_ep  # noqa: E402
from benchmarks._harness import command, parser, run, write_results  # noqa: E402
from deploy.emulated_cluster import ClusterSpec  # noqa: E402

logger = logging.getLogger("overlap")
RESULTS = ROOT / "benchmarks" / "results" / "overlap"
SETTINGS = ("serial", "overlapped")
MODELS = ("mixtral", "shared_experts")
LINK_TIERS = ("same_worker", "same_node", "cross_node")
DEFAULTS = {
    "--intra-mbit": str(vela_vs_ep.PAPER_INTRA_MBIT),  # both tiers shaped, as --paper shapes them
    "--micro-batch-size": "2",  # both settings: 4 micro-batches of the batch of 8
    "--in-flight": "2",  # the overlapped runs' micro-batches at once
}


def parse_args(argv=None) -> argparse.Namespace:
    """This benchmark's options; the cluster's are vela_vs_ep's (one place), with --paper's link shaping."""
    p = parser(__doc__, RESULTS, what="output directory",
               epilog="Any other option is benchmarks/vela_vs_ep.py's (cluster, links, load waiting, --no-emulate): "
                      "see its --help.")
    p.add_argument("--steps", type=int, default=40, help="fine-tuning steps per run")
    p.add_argument("--repeats", type=int, default=1, help="serial/overlapped pairs per model, alternating order")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the driver inside node 0
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)
    own, rest = p.parse_known_args(argv)
    for option, default in DEFAULTS.items():  # vela_vs_ep's options, with this benchmark's defaults
        if option not in rest:
            rest = [*rest, option, default]
    cluster = vela_vs_ep.parse_args(rest)
    return argparse.Namespace(**{**vars(cluster), **vars(own)})


# --- the shared-expert model ----------------------------------------------------------------------------


def shared_expert_model(mixtral_dir: Path) -> Path:
    """A DeepSeek-V3-architecture model the size of the tiny Mixtral (its tokenizer, 4 MoE layers of 8 routed
    experts, top-2, one shared expert computed after the routed ones), random weights, cached beside it.
    Random routing is fine here: the benchmark compares two schedules of the same work, not placements."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    mixtral = json.loads((mixtral_dir / "config.json").read_text())
    target = mixtral_dir.parent / f"{mixtral_dir.name}-deepseek-v3-shared"
    if (target / "config.json").is_file():
        return target
    config = DeepseekV3Config(
        vocab_size=mixtral["vocab_size"], hidden_size=mixtral["hidden_size"],
        intermediate_size=mixtral["intermediate_size"], moe_intermediate_size=mixtral["intermediate_size"],
        num_hidden_layers=mixtral["num_hidden_layers"], num_attention_heads=mixtral["num_attention_heads"],
        num_key_value_heads=mixtral["num_attention_heads"], n_routed_experts=mixtral["num_local_experts"],
        num_experts_per_tok=mixtral["num_experts_per_tok"], n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=32, rope_scaling=None, max_position_embeddings=mixtral["max_position_embeddings"],
        pad_token_id=mixtral.get("pad_token_id"), bos_token_id=mixtral.get("bos_token_id"),
        eos_token_id=mixtral.get("eos_token_id"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(mixtral_dir).save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp made it private
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def model_dirs(models: list[str]) -> dict[str, Path]:
    from vela_ray.training.tiny_model import tiny_model_path

    mixtral = tiny_model_path()
    return {"mixtral": mixtral, "shared_experts": shared_expert_model(mixtral)}


# --- 2. one run --------------------------------------------------------------------------------------


def job_dict(args, model_dir: Path, setting: str, out_dir: Path, placement: Path | None) -> dict:
    """vela_vs_ep's job on WikiText-2 with the model at `model_dir`, micro-batched; `setting` its overlap;
    `placement`: a placement file to train with (None: solve one, vela-ray's default solver)."""
    job = vela_vs_ep.job_dict(args, "wikitext", "improved", args.steps, out_dir)
    job["model"] = {"path": str(model_dir)}
    job["placement"] = {"solver": "improved", "profile": "measure", "profile_batches": 4, "capacity": args.capacity,
                        **({"solver": "file", "file": str(placement)} if placement else {})}
    overlapped = setting == "overlapped"
    job["training"]["overlap"] = {"micro_batches_in_flight": args.in_flight if overlapped else 1,
                                  "shared_experts": overlapped}
    return job


def run_job(args, model: str, model_dir: Path, setting: str, spec: ClusterSpec | None,
            placement: Path | None) -> dict:
    """One fine-tuning run (`vela_vs_ep.run_job`)."""
    run = vela_vs_ep.run_job(args, job_dict(args, model_dir, setting, Path("."), placement), f"overlap {model} "
                             f"{setting}", spec)
    summary = run["summary"]
    logger.info("%s / %s: median step %.3f s, loss %.4f, %.0f s wall", model, setting, summary["median_step_time_s"],
                summary["losses"][-1], run["wall_s"])
    return run


def run_all(args, spec: ClusterSpec | None, cross_mbit: float | None = None) -> dict:
    """This benchmark's work on the cluster (`vela_vs_ep.Work`): per model, `--repeats` serial/overlapped pairs,
    every other pair in the other order (so a drift in the machine's load lands on both settings). The first run of
    a model solves its placement and the others train with it (a file), so all of them move the same bytes (a
    placement solved on each run's own link probes could differ)."""
    dirs = model_dirs(args.models)
    runs: dict[str, dict[str, list[dict]]] = {}
    for model in args.models:
        runs[model] = {setting: [] for setting in SETTINGS}
        placement = None
        for repeat in range(args.repeats):
            for setting in SETTINGS if repeat % 2 == 0 else reversed(SETTINGS):
                run = run_job(args, model, dirs[model], setting, spec, placement)
                runs[model][setting].append(run)
                placement = placement or placement_file(run, model)
    return runs


def placement_file(run: dict, model: str) -> Path:
    """A run's placement as a file jobs train with (`placement.solver: file`)."""
    placed = run["summary"]["placement"]
    table = placed["expert_to_worker"]
    workers = run["job"]["cluster"]["num_workers"]
    path = Path(tempfile.gettempdir()) / f"overlap-{model}-placement.json"
    path.write_text(json.dumps({"expert_to_worker": table, "num_workers": workers,
                                "capacities": [run["job"]["placement"]["capacity"]] * workers,
                                "solver": placed["solver"], "expected_step_time": placed["expected_step_time_s"] or 0.0}))
    return path


# --- 3. numbers --------------------------------------------------------------------------------------


def run_view(run: dict, warmup: int) -> dict:
    """One run's numbers from its raw record."""
    from vela_ray.training.summary import RunSummary

    s = RunSummary.model_validate(run["summary"])
    steps = s.history[warmup:] if len(s.history) > warmup + 2 else s.history
    step_s = np.asarray([h.step_time_s for h in steps])
    idle_s = np.asarray([h.master_idle_s for h in steps])
    train_s = s.timings_s.get("train_s") or float(sum(h.step_time_s for h in s.history))
    compute = s.timings_s.get("worker_compute_s", [])
    return {
        **machine_cpu(run, s.timings_s, float(np.mean(step_s))),
        "median_step_time_s": float(np.median(step_s)),
        "master_idle_fraction": float(np.median(idle_s / step_s)),
        "master_idle_s_median": float(np.median(idle_s)),
        "expert_round_trip_s_median": float(np.median([h.expert_round_trip_s for h in steps])),
        "worker_busy_fraction": [c / train_s for c in compute],
        "worker_busy_fraction_mean": float(np.mean(compute)) / train_s if compute else None,
        "bytes_per_step_by_tier": {t: float(np.mean([h.bytes_by_tier.get(t, 0) for h in s.history]))
                                   for t in LINK_TIERS},
        "losses": s.losses,
        "predicted_step_s": s.placement.expected_step_time_s,
        "train_s": train_s,
        "wall_s": run["wall_s"],
        "loadavg_1m": run["loadavg_1m"],
    }


def machine_cpu(run: dict, timings_s: dict, mean_step_s: float) -> dict:
    """The machine's cores while the run trained (`vela_vs_ep.CpuSampler`, from the run's start-up to its end, less
    the first fifth, where warm-up steps fall): their busy share, the CPU seconds a step takes over every process
    (master, workers, Ray), the step this machine could reach at best with that work spread over all its cores
    (`cpu_floor_step_s`: no schedule beats it here), and the cores master 0's process kept busy."""
    cpu = run.get("cpu")
    busy = None
    if cpu and "startup_s" in timings_s and "train_s" in timings_s:
        start, train = timings_s["startup_s"], timings_s["train_s"]
        busy = vela_vs_ep.busy_fraction(cpu, start + train / 5, start + train)
    if busy is None:
        return {"machine_cpu_busy_fraction": None, "cpu_seconds_per_step": None, "cpu_floor_step_s": None,
                "master_process_cores": None}
    return {"machine_cpu_busy_fraction": busy["machine"], "cpu_seconds_per_step": busy["machine"] * cpu["cores"] *
            mean_step_s, "cpu_floor_step_s": busy["machine"] * mean_step_s, "master_process_cores": busy["master"],
            "cores": cpu["cores"]}


def compare(serial: dict, overlapped: dict) -> dict:
    """One model's serial and overlapped runs side by side (their medians over repeats)."""
    def median(views: list[dict], key: str) -> float:
        return float(np.median([v[key] for v in views]))

    s_step, o_step = median(serial, "median_step_time_s"), median(overlapped, "median_step_time_s")
    losses_s, losses_o = np.asarray(serial[0]["losses"]), np.asarray(overlapped[0]["losses"])
    bytes_s, bytes_o = serial[0]["bytes_per_step_by_tier"], overlapped[0]["bytes_per_step_by_tier"]
    return {
        "median_step_time_s_serial": s_step, "median_step_time_s_overlapped": o_step,
        "step_time_ratio_overlapped_serial": o_step / s_step,
        "master_idle_fraction_serial": median(serial, "master_idle_fraction"),
        "master_idle_fraction_overlapped": median(overlapped, "master_idle_fraction"),
        "worker_busy_fraction_serial": median(serial, "worker_busy_fraction_mean"),
        "worker_busy_fraction_overlapped": median(overlapped, "worker_busy_fraction_mean"),
        **({f"{key}_{name}": median(views, key) for key in ("machine_cpu_busy_fraction", "cpu_seconds_per_step",
                                                             "master_process_cores")
            for name, views in (("serial", serial), ("overlapped", overlapped))}
           if serial[0].get("machine_cpu_busy_fraction") is not None else {}),
        "same_bytes": bytes_s == bytes_o, "bytes_per_step_by_tier": bytes_s,
        "max_rel_loss_diff": float(np.max(np.abs(losses_o - losses_s) / np.abs(losses_s))),
        **{f"predicted_step_s_{name}": median(views, "predicted_step_s") for name, views in
           (("serial", serial), ("overlapped", overlapped))},
        **{f"predicted_step_error_{name}": median(views, "predicted_step_s") / step - 1 for name, views, step in
           (("serial", serial, s_step), ("overlapped", overlapped, o_step))},
    }


def build_results(args, raw: dict, links: dict, argv) -> dict:
    views = {model: {setting: [run_view(r, args.warmup_steps) for r in runs] for setting, runs in by.items()}
             for model, by in raw.items()}
    return {
        "command": command(__file__, argv),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                     if k not in ("inner", "spec", "raw", "methods", "datasets", "unshaped_steps", "unshaped_methods",
                                  "out")},
        "shaped": not args.no_emulate,
        "links": links,
        "runs": views,
        "comparison": {model: compare(by["serial"], by["overlapped"]) for model, by in views.items()},
        "raw": raw,
    }


# --- 4. files ----------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [f"# Serial vs overlapped steps ({'emulated' if results['shaped'] else 'unshaped'} "
             f"{s['nodes']}-node cluster, {s['nodes'] * s['workers_per_node']} ExpertManagers)", "",
             f"`{results['command']}`", "",
             f"{s['steps']} steps per run, batch {s['batch_size']} in micro-batches of {s['micro_batch_size']}, "
             f"{s['in_flight']} in flight when overlapped; medians after {s['warmup_steps']} warm-up steps.", "",
             "| model | serial step s | overlapped step s | ratio | master idle serial / overlapped | "
             "worker busy serial / overlapped | same bytes | max rel loss diff | predicted step s serial / "
             "overlapped (error) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, c in results["comparison"].items():
        lines.append(
            f"| {model} | {c['median_step_time_s_serial']:.3f} | {c['median_step_time_s_overlapped']:.3f} | "
            f"{c['step_time_ratio_overlapped_serial']:.2f} | {c['master_idle_fraction_serial']:.2f} / "
            f"{c['master_idle_fraction_overlapped']:.2f} | {c['worker_busy_fraction_serial']:.2f} / "
            f"{c['worker_busy_fraction_overlapped']:.2f} | {c['same_bytes']} | {c['max_rel_loss_diff']:.1e} | "
            f"{c['predicted_step_s_serial']:.3f} ({c['predicted_step_error_serial']:+.0%}) / "
            f"{c['predicted_step_s_overlapped']:.3f} ({c['predicted_step_error_overlapped']:+.0%}) |")
    lines += _cpu_lines(results)
    lines += ["", "Master idle: the share of a step in which every micro-batch in flight waited on the experts. "
              "Worker busy: a worker's expert compute over the training time (mean over workers). Predicted step: "
              "the cost model's (`placement.cost.predict_step`: the master's compute timed before training, each "
              "layer's slowest round trip from the probed links and the workers' measured compute, overlapped as a "
              "two-machine flow shop), its error against the measured median step.", "",
              "![step time](step_time.png)"]
    return "\n".join(lines)


def _cpu_lines(results: dict) -> list[str]:
    """The machine's cores while the runs trained (`machine_cpu`), where they were sampled."""
    rows = {m: c for m, c in results["comparison"].items() if "cpu_seconds_per_step_serial" in c}
    if not rows:
        return []
    lines = ["", "| model | cores busy serial / overlapped | CPU s per step serial / overlapped | "
             "master 0's process, cores serial / overlapped | serial's CPU s over the cores / serial step |",
             "|---|---|---|---|---|"]
    for model, c in rows.items():
        cores = results["runs"][model]["serial"][0]["cores"]
        floor = c["cpu_seconds_per_step_serial"] / cores / c["median_step_time_s_serial"]
        lines.append(f"| {model} | {c['machine_cpu_busy_fraction_serial']:.2f} / "
                     f"{c['machine_cpu_busy_fraction_overlapped']:.2f} | {c['cpu_seconds_per_step_serial']:.3f} / "
                     f"{c['cpu_seconds_per_step_overlapped']:.3f} | {c['master_process_cores_serial']:.2f} / "
                     f"{c['master_process_cores_overlapped']:.2f} | {floor:.2f} |")
    lines += ["", "Cores busy: the machine's busy share of its cores over the training steps (every process: the "
              "master, the workers, Ray; /proc/stat). CPU s per step: the CPU seconds a step took over all of them. "
              "Master 0's process: the cores it kept busy (its micro-batch threads, its broker's planes, Ray's "
              "threads). "
              "The last column is the shortest step any schedule could reach on this machine with the serial step's "
              "CPU work spread over all its cores, as a share of the serial step: overlap cannot go below it here."]
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["comparison"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, setting in enumerate(SETTINGS):
        step = [results["comparison"][m][f"median_step_time_s_{setting}"] for m in models]
        idle = [step[j] * results["comparison"][m][f"master_idle_fraction_{setting}"] for j, m in enumerate(models)]
        x = np.arange(len(models)) + (i - 0.5) * 0.38
        ax.bar(x, np.subtract(step, idle), 0.36, label=f"{setting}: master computing")
        ax.bar(x, idle, 0.36, bottom=np.subtract(step, idle), label=f"{setting}: master idle", alpha=0.5)
    ax.set_xticks(np.arange(len(models)), models)
    ax.set_ylabel("median step time (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.inner:
        vela_vs_ep.inner_main(args, run_all)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model_dirs(args.models)  # built before the cluster starts: every node reads them
    if args.no_emulate:
        raw, links = (vela_vs_ep.run_unshaped_cluster(args, run_all),
                      {"note": "unshaped ray.cluster_utils cluster, one loopback"})
    else:
        raw, links = vela_vs_ep.emulated(args, Path(__file__))
    results = build_results(args, raw, links, argv)
    results["benchmark_wall_s"] = time.perf_counter() - start
    write_results(args.out / "results.json", results, markdown=markdown(results))
    plot(results, args.out / "step_time.png")
    print(markdown(results))


if __name__ == "__main__":
    run(main)
