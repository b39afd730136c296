"""Online re-placement under routing drift: the locality study's fine-tuning, re-placement off against on.

Both runs are on the emulated 3-node cluster, one with `placement.replan` off and one with it on.

The locality study (benchmarks/locality_study.py, results in benchmarks/results/locality/) saw the tiny
pre-trained Mixtral's routing drift while LoRA fine-tuning on Tiny Shakespeare: the mean over layers of the
TV distance between a 20-step window of training routing and the pre-fine-tuning profile is 0.06 at step 25,
0.12 at step 50, 0.14 at step 100 and 0.16 at step 300 (up to 0.2 in layers 1-2), against a sampling-noise
floor of 0.004. A placement solved on the start profile is therefore solved for routing the run leaves
early. This benchmark measures what re-placing while training (vela_ray/runtime/runner.py `_maybe_replan`,
vela_ray/runtime/migration.py) buys on the emulated cluster.

Reads top to bottom:
  1. bring up the emulated cluster exactly as benchmarks/vela_vs_ep.py does (deploy/emulated_cluster.py:
     3 nodes, cross-node links shaped to 1/15.6 of what Ray moves inside a node), and probe the links;
  2. inside node 0, fine-tune twice, back to back, with the same job: vela_vs_ep's cluster and placement
     sections (`vela_vs_ep.job_dict`: 6 ExpertManagers, 2 per node, capacity 8, `solver: improved`,
     `profile: measure`, cost model communication+compute) with the locality study's data and schedule
     (all of Tiny Shakespeare in 128-token rows, batch 8, peak lr 1e-3, 20 warmup steps then cosine,
     seed 0), `--steps` steps:
       off: `placement.replan.every: 0` (the start placement all run long);
       on:  `placement.replan` with `--every`, `--drift-threshold`, `--horizon-steps`;
  3. per step the cross-node bytes (`history[i].bytes_by_tier["cross_node"]`, the brokers' counters);
     totals and on/off ratios of cross-node bytes, of median step time and of training wall time
     (which, unlike step times, includes the re-solves and migrations); every re-solve (drift, expected
     saving vs cost, adopted) and migration (moved, seconds); the cost model's predicted cross-node bytes
     and step-time saving against the measured ones; final losses (re-placement does not change the
     math: they must agree up to float noise);
  4. write results.json, results.md and cross_node_bytes.png to benchmarks/results/replacement_drift/.

The re-placement settings (defaults) and why:
  every 25:  drift is measured on the routing of the last `every` steps (25 x 8 x 128 = 25.6k tokens, top-2,
             per layer), so this is both the check period and the window. 25 steps keep the window's
             sampling noise far below the drift (the locality study's 20-step noise floor is 0.004) while
             checking 11 times in 300 steps, early enough to catch the fast drift of the first 100 steps.
  drift_threshold 0.05:  the threshold only gates a re-solve; whether the new placement is adopted is the
             cost model's call (saving over the horizon vs the migration's cost). The placed profile is
             measured on 4 batches (4k tokens), whose own noise is about 0.01 mean TV, so 0.05 is 3-5x the
             noise of the comparison and is crossed around step 25 in the locality study (the config
             default, 0.1, would first fire around step 50, after half the drift has happened).
  horizon_steps None (= the steps left):  the locality study shows the drift is one-way and saturating
             (held-out TV vs step 0: 0.19 at step 100, 0.19 at 200, 0.21 at 300; TV between consecutive
             checkpoints shrinks), not oscillating, so a placement fitted to the recent routing stays about
             as good for the rest of the run; a re-solve at step 25, while routing still moves, overstates
             its saving, but the next checks correct it for the price of one more migration.

The off run and the on run see the same batches and compute the same losses, so their routing is the same
step by step and every per-step difference in cross-node bytes is the placement's. Their start placements
are solved independently (the compute-aware cost model measures each worker's compute, which is noisy on a
shared machine), so results.md also compares the steps before the first adoption.

Run (as root, ~10 minutes on 2 cores):  python benchmarks/replacement_drift.py
With `cost_model: communication+compute` (the default, vela_vs_ep's `improved`) each run's placements also
follow the workers' compute as measured once at its start, which on a shared 2-core machine is mostly noise,
so the two runs start from different placements. `--cost-model communication` gives both runs the same start
placement and isolates what re-placement does to the traffic:
    python benchmarks/replacement_drift.py --cost-model communication \
        --out benchmarks/results/replacement_drift/communication_only
Without network namespaces: `--no-emulate` (as in vela_vs_ep.py) runs on an unshaped ray.cluster_utils
cluster (3 Ray nodes on one loopback; cross-node bytes are still counted, cross-node links are not slower).
The cluster options (--nodes, --workers-per-node, --capacity, --transport, --calibrate, --ratio,
--cross-mbit, --no-emulate, --max-load, --max-wait-s, --warmup-steps, --batch-size, --seq-len) are
vela_vs_ep.py's and keep its defaults: see `python benchmarks/vela_vs_ep.py --help`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/replacement_drift.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import vela_vs_ep  # noqa: E402
from benchmarks import vela_vs_ep_report as ep_report  # noqa: E402
from benchmarks._harness import SHAKESPEARE, command, parser, run, write_results  # noqa: E402
from deploy.emulated_cluster import ClusterSpec  # noqa: E402
from vela_ray.model.traffic import LINK_TIERS  # noqa: E402

logger = logging.getLogger("replacement_drift")
RESULTS = ROOT / "benchmarks" / "results" / "replacement_drift"
RUNS = ("off", "on")


def parse_args(argv=None) -> argparse.Namespace:
    """This benchmark's options; everything else goes to vela_vs_ep's parser (the cluster options, one place)."""
    p = parser(__doc__, RESULTS, what="output directory",
               epilog="Any other option is benchmarks/vela_vs_ep.py's (cluster, links, load waiting, --no-emulate): "
                      "see its --help.")
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps per run (the locality study: 300)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (the locality study's)")
    p.add_argument("--lr-warmup", type=int, default=20, help="linear warmup steps before the cosine decay "
                                                              "(the locality study's)")
    p.add_argument("--limit", type=int, default=None, help="128-token rows of Tiny Shakespeare (default: all)")
    p.add_argument("--every", type=int, default=25, help="placement.replan.every of the `on` run")
    p.add_argument("--drift-threshold", type=float, default=0.05, help="placement.replan.drift_threshold")
    p.add_argument("--horizon-steps", type=int, default=None,
                   help="placement.replan.horizon_steps (default: None, the steps left)")
    p.add_argument("--cost-model", choices=["communication", "communication+compute"], default=None,
                   help="placement.cost_model of both runs (default: vela_vs_ep's for `improved`, "
                        "communication+compute)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the driver inside node 0
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)
    own, rest = p.parse_known_args(argv)
    cluster = vela_vs_ep.parse_args(rest)
    return argparse.Namespace(**{**vars(cluster), **vars(own)})


# --- 2. one run --------------------------------------------------------------------------------------


def job_dict(args, replan_on: bool, out_dir: Path) -> dict:
    """vela_vs_ep's `improved` job (cluster, placement) with the locality study's data and schedule."""
    job = vela_vs_ep.job_dict(args, "wikitext", "improved", args.steps, out_dir)
    job["data"] = {"kind": "text", "path": str(SHAKESPEARE), "seq_len": args.seq_len, "limit": args.limit}
    job["training"]["optimizer"] = {"lr": args.lr, "warmup_steps": args.lr_warmup, "schedule": "cosine"}
    if args.cost_model:
        job["placement"]["cost_model"] = args.cost_model
    job["placement"]["replan"] = ({"every": args.every, "drift_threshold": args.drift_threshold,
                                   "horizon_steps": args.horizon_steps} if replan_on else {"every": 0})
    return job


def run_job(args, label: str, spec: ClusterSpec | None) -> dict:
    """One fine-tuning run (`vela_vs_ep.run_job`)."""
    run = vela_vs_ep.run_job(args, job_dict(args, label == "on", Path(".")), f"replacement-drift {label}", spec)
    summary = run["summary"]
    logger.info("%s: median step %.3f s, loss %.4f, %d re-solves, %d adopted, %.0f s wall", label,
                summary["median_step_time_s"], summary["losses"][-1], len(summary["replans"]),
                sum(r["adopted"] for r in summary["replans"]), run["wall_s"])
    return run


def run_both(args, spec: ClusterSpec | None, cross_mbit: float | None = None) -> dict:
    """This benchmark's work on the cluster (`vela_vs_ep.Work`): the off run, then the on run."""
    return {label: run_job(args, label, spec) for label in RUNS}


# --- 3. numbers --------------------------------------------------------------------------------------


def run_view(run: dict, warmup: int) -> dict:
    """One run's numbers from its raw record."""
    from vela_ray.training.summary import RunSummary

    s = RunSummary.model_validate(run["summary"])
    cross = [h.bytes_by_tier.get("cross_node", 0) for h in s.history]
    times = [h.step_time_s for h in s.history]
    return {
        "steps": s.steps,
        "cross_node_bytes_by_step": cross,
        "cross_node_bytes_total": int(sum(cross)),
        "bytes_total_by_tier": {t: int(sum(h.bytes_by_tier.get(t, 0) for h in s.history)) for t in LINK_TIERS},
        "step_times_s": times,
        "median_step_time_s": ep_report.median_step(s, warmup),
        "sum_step_time_s": float(sum(times)),
        "train_s": s.timings_s.get("train_s"),
        "placement_s": s.timings_s.get("placement_s"),
        "losses": s.losses,
        "final_loss": s.losses[-1],
        "eval_loss": s.eval_loss,
        "replans": [r.model_dump() for r in s.replans],
        "migrations": [m.model_dump() for m in s.migrations],
        "final_placement": s.placement.expert_to_worker,
        "final_expected_step_time_s": s.placement.expected_step_time_s,
        "worker_nodes": s.worker_nodes,
        "master_node": s.master_node,
        "links": ep_report.link_view(s),
        "wall_s": run["wall_s"],
        "loadavg_1m": run["loadavg_1m"],
        "wire_bytes_by_node": run["wire_bytes_by_node"],
    }


def segments(off: dict, on: dict, adopted: list[int], warmup: int) -> list[dict]:
    """The on run's placement versions as step ranges, each compared with the off run over the same steps."""
    bounds = [0, *adopted, on["steps"]]
    expected = {r["step"]: r["current_step_s"] - r["candidate_step_s"] for r in on["replans"] if r["adopted"]}
    rows = []
    for version, (a, b) in enumerate(zip(bounds, bounds[1:]), start=1):
        if b <= a:
            continue
        lo = max(a, warmup) if b - max(a, warmup) >= 3 else a  # the first steps of the run are warm-up
        on_t, off_t = on["step_times_s"][lo:b], off["step_times_s"][lo:b]
        on_x, off_x = sum(on["cross_node_bytes_by_step"][a:b]), sum(off["cross_node_bytes_by_step"][a:b])
        rows.append({"version": version, "steps": [a + 1, b],
                     "cross_node_mb_per_step_on": on_x / (b - a) / 1e6,
                     "cross_node_mb_per_step_off": off_x / (b - a) / 1e6,
                     "cross_node_ratio": on_x / off_x if off_x else None,
                     "median_step_s_on": float(np.median(on_t)), "median_step_s_off": float(np.median(off_t)),
                     "median_step_saving_s": float(np.median(np.asarray(off_t) - np.asarray(on_t))),
                     "expected_saving_s_per_step": expected.get(a)})
    return rows


def predictions(raw: dict, off: dict, on: dict) -> dict:
    """The cost model's cross-node bytes per step against the measured ones.

    off: its placement on the start profile, against the first `every` steps and the last 100.
    on (if it re-placed): its last placement and the off run's, on the routing that last re-placement was
    solved for, against the measured bytes per step after it.
    """
    from placement import cost
    from vela_ray.training.summary import RunSummary

    out: dict = {}
    s_off, s_on = (RunSummary.model_validate(raw[k]["summary"]) for k in RUNS)
    window = raw["on"]["job"]["placement"]["replan"]["every"] or 25
    if s_off.placement.problem is not None:
        predicted = cost.cross_node_bytes(s_off.placement.problem, s_off.placement.table)[0]
        x = off["cross_node_bytes_by_step"]
        out["off_start_placement"] = {
            "predicted_mb_per_step": predicted / 1e6,
            f"measured_mb_per_step_steps_1_{window}": float(np.mean(x[:window])) / 1e6,
            "measured_mb_per_step_last_100": float(np.mean(x[-100:])) / 1e6}
    adopted = [r for r in on["replans"] if r["adopted"]]
    if adopted and s_on.placement.problem is not None and on["worker_nodes"] == off["worker_nodes"]:
        problem, last = s_on.placement.problem, adopted[-1]["step"]
        x_on, x_off = on["cross_node_bytes_by_step"][last:], off["cross_node_bytes_by_step"][last:]
        out["on_last_placement"] = {
            "solved_at_step": last,
            "predicted_mb_per_step_on": cost.cross_node_bytes(problem, s_on.placement.table)[0] / 1e6,
            "predicted_mb_per_step_off": cost.cross_node_bytes(problem, s_off.placement.table)[0] / 1e6,
            "measured_mb_per_step_on": float(np.mean(x_on)) / 1e6 if x_on else None,
            "measured_mb_per_step_off": float(np.mean(x_off)) / 1e6 if x_off else None,
            "predicted_step_s_on": cost.step_time(problem, s_on.placement.table),
            "predicted_step_s_off": cost.step_time(problem, s_off.placement.table)}
    return out


def build_results(args, raw: dict, links: dict, command: str) -> dict:
    warmup = args.warmup_steps
    off, on = (run_view(raw[k], warmup) for k in RUNS)
    adopted = [r["step"] for r in on["replans"] if r["adopted"]]
    loss_off, loss_on = np.asarray(off["losses"]), np.asarray(on["losses"])
    rel = np.abs(loss_on - loss_off) / np.abs(loss_off)
    drift_migrations = [m for m in on["migrations"] if m["reason"] == "drift"]
    return {
        "command": command,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                     if k not in ("inner", "spec", "raw", "methods", "datasets", "unshaped_steps",
                                  "unshaped_methods")},
        "job_on": raw["on"]["job"],
        "links": links,
        "runs": {"off": off, "on": on},
        "comparison": {
            "cross_node_bytes_total_off": off["cross_node_bytes_total"],
            "cross_node_bytes_total_on": on["cross_node_bytes_total"],
            "cross_node_bytes_ratio_on_off": on["cross_node_bytes_total"] / off["cross_node_bytes_total"]
            if off["cross_node_bytes_total"] else None,
            "median_step_time_s_off": off["median_step_time_s"],
            "median_step_time_s_on": on["median_step_time_s"],
            "median_step_time_ratio_on_off": on["median_step_time_s"] / off["median_step_time_s"],
            "train_s_off": off["train_s"], "train_s_on": on["train_s"],
            "train_s_ratio_on_off": on["train_s"] / off["train_s"] if off["train_s"] else None,
            "replans": len(on["replans"]), "adopted_steps": adopted,
            "drift_migration_seconds": sum(m["seconds"] for m in drift_migrations),
            "drift_migration_moved": sum(m["moved"] for m in drift_migrations),
            "final_loss_off": off["final_loss"], "final_loss_on": on["final_loss"],
            "final_loss_rel_diff": float(rel[-1]),
            "max_rel_loss_diff_any_step": float(rel.max()),
            "eval_loss_off": off["eval_loss"], "eval_loss_on": on["eval_loss"],
            "same_start_placement": on["cross_node_bytes_by_step"][:adopted[0] if adopted else on["steps"]]
            == off["cross_node_bytes_by_step"][:adopted[0] if adopted else off["steps"]],
        },
        "segments": segments(off, on, adopted, warmup),
        "predictions": predictions(raw, off, on),
    }


# --- 4. files ----------------------------------------------------------------------------------------


def _rolling(x: np.ndarray, n: int) -> np.ndarray:
    n = max(1, min(n, len(x)))
    return np.convolve(x, np.ones(n) / n, mode="valid")


def plot_cross_node(results: dict, path: Path) -> None:
    """Cross-node MB per step of both runs (thin: per step, thick: 10-step mean), re-placements marked;
    below, the cumulative cross-node GB."""
    runs = results["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[2, 1])
    colors = {"off": "tab:gray", "on": "tab:blue"}
    names = {"off": "re-placement off", "on": f"re-placement on (every {results['settings']['every']})"}
    for label in RUNS:
        x = np.asarray(runs[label]["cross_node_bytes_by_step"], dtype=float) / 1e6
        steps = np.arange(1, len(x) + 1)
        top.plot(steps, x, color=colors[label], alpha=0.3, lw=0.8)
        smooth = _rolling(x, 10)
        top.plot(steps[len(x) - len(smooth):], smooth, color=colors[label], lw=2, label=f"{names[label]}, 10-step mean")
        bottom.plot(steps, np.cumsum(x) / 1e3, color=colors[label], lw=2, label=names[label])
    for r in runs["on"]["replans"]:
        for ax in (top, bottom):
            if r["adopted"]:
                ax.axvline(r["step"], color="tab:red", ls="--", lw=1)
            else:
                ax.axvline(r["step"], color="tab:orange", ls=":", lw=0.8)
        if r["adopted"]:
            top.annotate(f"moved {r['moved']}\ndrift {r['drift']:.2f}", (r["step"], 1),
                         xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points", va="top",
                         fontsize=7, color="tab:red")
    top.plot([], [], color="tab:red", ls="--", lw=1, label="re-placement adopted")
    top.plot([], [], color="tab:orange", ls=":", lw=0.8, label="re-solved, kept")
    top.set(ylabel="cross-node MB per step", ylim=(0, None),
            title="Cross-node expert traffic, LoRA fine-tuning on Tiny Shakespeare ("
                  + ("unshaped ray.cluster_utils cluster)" if results["settings"]["no_emulate"]
                     else f"emulated {results['settings']['nodes']}-node cluster)"))
    top.legend(fontsize=8, loc="lower left")
    bottom.set(xlabel="step", ylabel="cumulative cross-node GB")
    bottom.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _f(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def markdown(results: dict) -> str:
    c, runs, s = results["comparison"], results["runs"], results["settings"]
    links = results["links"]
    link_line = (f"Links: cross-node shaped to {links['cross_mbit']:.0f} Mbit/s (calibrated on {links['calibrate']}); "
                 f"Ray objects: same node {links['ray']['same_node_bytes_per_s'] / 1e6:.0f} MB/s, cross "
                 f"{links['ray']['cross_node_bytes_per_s'] / 1e6:.1f} MB/s." if "ray" in links else
                 f"Links: {links.get('note')}.")
    lines = [
        "# Online re-placement under routing drift", "",
        f"Command: `{results['command']}`", "",
        f"{s['steps']} steps of LoRA fine-tuning of the tiny pre-trained Mixtral on Tiny Shakespeare "
        f"(batch {s['batch_size']} x {s['seq_len']} tokens, peak lr {s['lr']:g}, {s['lr_warmup']} warmup steps, "
        f"cosine), {s['nodes']} nodes x {s['workers_per_node']} ExpertManagers, capacity {s['capacity']}, "
        f"`solver: improved`, `profile: measure`, `cost_model: {results['job_on']['placement']['cost_model']}`. "
        f"Re-placement on: `every: {s['every']}`, "
        f"`drift_threshold: {s['drift_threshold']}`, `horizon_steps: {s['horizon_steps']}`"
        f"{' (steps left)' if s['horizon_steps'] is None else ''}.", "",
        link_line, "",
        "| | re-placement off | re-placement on | on / off |", "|---|---:|---:|---:|",
        f"| cross-node bytes, total (GB) | {c['cross_node_bytes_total_off'] / 1e9:.3f} | "
        f"{c['cross_node_bytes_total_on'] / 1e9:.3f} | {_f(c['cross_node_bytes_ratio_on_off'], '.3f')} |",
        f"| median step time (s, first {s['warmup_steps']} steps left out) | {c['median_step_time_s_off']:.3f} | "
        f"{c['median_step_time_s_on']:.3f} | {c['median_step_time_ratio_on_off']:.3f} |",
        f"| training wall time (s, re-solves and migrations included) | {_f(c['train_s_off'], '.1f')} | "
        f"{_f(c['train_s_on'], '.1f')} | {_f(c['train_s_ratio_on_off'], '.3f')} |",
        f"| final training loss | {c['final_loss_off']:.6f} | {c['final_loss_on']:.6f} | "
        f"rel. diff {c['final_loss_rel_diff']:.2e} |",
        f"| eval loss | {_f(c['eval_loss_off'], '.6f')} | {_f(c['eval_loss_on'], '.6f')} | |",
        "",
        f"Losses: max relative difference over all {len(runs['on']['losses'])} steps "
        f"{c['max_rel_loss_diff_any_step']:.2e} "
        f"(re-placement moves experts, not math). Adopted re-placements at steps {c['adopted_steps'] or 'none'}: "
        f"{c['drift_migration_moved']} experts moved in {c['drift_migration_seconds']:.2f} s in all. "
        f"Same start placement in both runs (identical cross-node bytes before the first adoption): "
        f"{'yes' if c['same_start_placement'] else 'no'}.", "",
        "## Re-solves of the on run", "",
        "| step | drift (mean TV) | moved | expected step s now -> candidate | horizon | expected saving s | "
        "expected cost s | adopted |", "|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in runs["on"]["replans"]:
        lines.append(f"| {r['step']} | {r['drift']:.3f} | {r['moved']} | {r['current_step_s']:.4f} -> "
                     f"{r['candidate_step_s']:.4f} | {r['horizon_steps']} | {r['expected_saving_s']:.3f} | "
                     f"{r['expected_cost_s']:.3f} | {'yes' if r['adopted'] else 'no'} |")
    if not runs["on"]["replans"]:
        lines.append("| (none: the drift never reached the threshold) | | | | | | | |")
    lines += ["", "## Migrations", "",
              "| run | step | reason | version | moved | LoRA+AdamW MB | weights read MB | seconds | "
              "expected saving s | expected cost s |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label in RUNS:
        for m in runs[label]["migrations"]:
            lines.append(f"| {label} | {m['step']} | {m['reason']} | {m['version']} | {m['moved']} | "
                         f"{m['state_bytes'] / 1e6:.2f} | {m['frozen_bytes'] / 1e6:.2f} | {m['seconds']:.2f} | "
                         f"{_f(m['expected_saving_s'], '.3f', '')} | {_f(m['expected_cost_s'], '.3f', '')} |")
    lines += ["", "## Per placement version of the on run, against the off run over the same steps", "",
              "| version | steps | cross-node MB/step on | off | on/off | median step s on | off | "
              "median paired saving s/step | cost model's saving s/step vs the previous placement |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for g in results["segments"]:
        lines.append(f"| {g['version']} | {g['steps'][0]}-{g['steps'][1]} | {g['cross_node_mb_per_step_on']:.3f} | "
                     f"{g['cross_node_mb_per_step_off']:.3f} | {_f(g['cross_node_ratio'], '.3f')} | "
                     f"{g['median_step_s_on']:.3f} | {g['median_step_s_off']:.3f} | {g['median_step_saving_s']:+.4f} | "
                     f"{_f(g['expected_saving_s_per_step'], '+.4f', '')} |")
    p = results["predictions"]
    lines += ["", "## Cost model against measurement", ""]
    if "off_start_placement" in p:
        q = p["off_start_placement"]
        first = next(k for k in q if k.startswith("measured_mb_per_step_steps_1_"))
        lines.append(f"- off run, start placement: predicted {q['predicted_mb_per_step']:.3f} cross-node MB/step on "
                     f"the start profile; measured {q[first]:.3f} over steps {first.rsplit('_', 2)[-2]}-"
                     f"{first.rsplit('_', 1)[-1]} and {q['measured_mb_per_step_last_100']:.3f} over the last 100 "
                     "steps.")
    if "on_last_placement" in p:
        q = p["on_last_placement"]
        on_x, off_x = q["measured_mb_per_step_on"], q["measured_mb_per_step_off"]
        lines.append(f"- on run, last placement (solved at step {q['solved_at_step']} on the routing of the "
                     f"{s['every']} steps before): predicted {q['predicted_mb_per_step_on']:.3f} cross-node MB/step "
                     f"vs {q['predicted_mb_per_step_off']:.3f} for the off run's placement on that routing "
                     f"(ratio {q['predicted_mb_per_step_on'] / q['predicted_mb_per_step_off']:.3f}); measured after "
                     f"step {q['solved_at_step']}: {_f(q['measured_mb_per_step_on'], '.3f')} vs "
                     f"{_f(q['measured_mb_per_step_off'], '.3f')} (ratio "
                     f"{_f(on_x / off_x if on_x is not None and off_x else None, '.3f')}). "
                     f"Expected step time (comm + compute) {q['predicted_step_s_on']:.4f} vs "
                     f"{q['predicted_step_s_off']:.4f} s.")
    lines += ["", "![cross-node bytes per step](cross_node_bytes.png)"]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.inner:
        vela_vs_ep.inner_main(args, run_both)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.no_emulate:
        raw, links = (vela_vs_ep.run_unshaped_cluster(args, run_both),
                      {"note": "unshaped ray.cluster_utils cluster, one loopback"})
    else:
        raw, links = vela_vs_ep.emulated(args, Path(__file__))
    results = build_results(args, raw, links, command(__file__, argv))
    results["benchmark_wall_s"] = time.perf_counter() - start
    write_results(args.out / "results.json", results, markdown=markdown(results))
    plot_cross_node(results, args.out / "cross_node_bytes.png")
    print(markdown(results))


if __name__ == "__main__":
    run(main)
