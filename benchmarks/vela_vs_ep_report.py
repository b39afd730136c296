"""Tables, plots and JSON for benchmarks/vela_vs_ep.py (raw run summaries in, results out).

`build_results(args, grid, links)` turns the raw runs of every (data set, method)
(`vela_vs_ep.run_one`: a `RunSummary` as JSON data plus wall time, load and wire
bytes) into the numbers the paper reports: cross-node bytes per node per
step (mean, and per step as Fig. 5), median step time and its ratio to expert
parallelism (Fig. 6), predicted (cost model) vs measured communication time,
final loss; `write_all` saves results.json, results.md, traffic_over_steps.png
and step_time.png; `markdown` renders the tables.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from benchmarks import paper_scale  # noqa: E402
from benchmarks._harness import write_results  # noqa: E402
from placement import cost  # noqa: E402
from vela_ray.observability.report import expected_times  # noqa: E402
from vela_ray.training.summary import RunSummary  # noqa: E402

LABELS = {"ep": "EP", "sequential": "vela-ray + sequential", "random": "vela-ray + random",
          "vela": "vela-ray + LP (paper)", "improved": "vela-ray + improved",
          "per_node": "vela-ray, a master per node + replicas", "tp2": "vela-ray + improved, TP-2 master"}


def allreduce_cross_bytes(summary: RunSummary) -> float:
    """Cross-node bytes of one ring all-reduce of the backbone LoRA gradients (ranks in index order):
    EP's ranks, or vela-ray's data-parallel masters; 0 for one master."""
    nodes = summary.worker_nodes if summary.mode == "expert_parallel" else summary.master_nodes
    ranks = len(nodes)
    if ranks < 2:
        return 0.0
    crossings = sum(nodes[r] != nodes[(r + 1) % ranks] for r in range(ranks))
    return crossings * 2 * (ranks - 1) / ranks * (summary.allreduce_bytes_per_step or 0)


def cross_per_node_by_step(summary: RunSummary) -> list[float]:
    """Cross-node bytes per node of every step: broker counts (+ the backbone all-reduce estimate) / nodes."""
    nodes = len(set(summary.worker_nodes) | {summary.master_node} | set(summary.master_nodes))
    extra = allreduce_cross_bytes(summary)
    return [(h.bytes_by_tier.get("cross_node", 0) + extra) / nodes for h in summary.history]


def steady_step_times(summary: RunSummary, warmup: int) -> list[float]:
    """Step times without the first `warmup` steps (all of them if that would leave none)."""
    times = [h.step_time_s for h in summary.history]
    return times[warmup:] or times


def median_step(summary: RunSummary, warmup: int) -> float:
    return float(np.median(steady_step_times(summary, warmup)))


def link_view(summary: RunSummary) -> dict | None:
    """Mean bandwidth the placement service measured to same-node and cross-node workers (bytes/s)."""
    if not summary.links:
        return None
    pairs = list(zip(summary.links, summary.worker_tiers))
    by = {t: [link.bandwidth_bytes_per_s for link, tier in pairs if tier == t] for t in ("same_node", "cross_node")}
    view = {t: float(np.mean(v)) for t, v in by.items() if v}
    if len(view) == 2:
        view["ratio"] = view["same_node"] / view["cross_node"]
    return view


def predicted_comm_delta(shaped: RunSummary, unshaped: RunSummary, compute_s_per_row: list[float] | None,
                         full_duplex: bool = False) -> float | None:
    """The cost model's step time on the shaped run's probed links minus on the unshaped run's, for the
    placement trained with: the same quantity as the measured communication (shaped minus unshaped
    step time), unlike the solver's absolute communication estimate. With the workers' measured
    compute a layer waits for its slowest worker's link plus compute, so communication that overlaps
    a busier worker's compute costs nothing, as it does in the measurement.

    The model counts a NIC's two directions against one bandwidth (half duplex: an upper bound).
    `full_duplex` gives each direction the whole bandwidth (the emulated NICs shape egress and ingress
    apart), the lower bound: a worker's gather can overlap another's dispatch only in part, as each
    worker's rows go out before its results come back."""
    problems = shaped.placement.problem, unshaped.placement.problem
    if None in problems:
        return None
    table = shaped.placement.table if shaped.placement.routes is None else np.asarray(shaped.placement.routes)
    scale = 2.0 if full_duplex else 1.0  # the traffic is even both ways: dispatch rows = gathered results
    with_compute = [p.model_copy(update={
        "compute_seconds_per_row": compute_s_per_row,
        "shared_links": [link.model_copy(update={"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s * scale})
                         for link in p.shared_links]}) for p in problems]
    return cost.step_time(with_compute[0], table) - cost.step_time(with_compute[1], table)


def measured_compute(runs: dict) -> list[float] | None:
    """Seconds per row of each worker as the placement service measured them in any of the runs."""
    for run in runs.values():
        problem = RunSummary.model_validate(run["summary"]).placement.problem
        if problem is not None and problem.compute_seconds_per_row is not None:
            return problem.compute_seconds_per_row
    return None


def method_row(run: dict, unshaped: dict | None, warmup: int, compute_s_per_row: list[float] | None = None) -> dict:
    """One method's numbers from a raw run (`vela_vs_ep.run_one`) and, if any, its unshaped rerun."""
    summary = RunSummary.model_validate(run["summary"])
    per_step = cross_per_node_by_step(summary)
    step = median_step(summary, warmup)
    row = {
        "cross_bytes_per_node_per_step": float(np.mean(per_step)),
        "cross_bytes_per_node_by_step": per_step,
        "step_times_s": [h.step_time_s for h in summary.history],
        "median_step_time_s": step,
        "p25_step_time_s": float(np.percentile(steady_step_times(summary, warmup), 25)),
        "predicted_comm_s": expected_times(summary.placement).get("expected comm"),
        "final_loss": summary.losses[-1],
        "eval_loss": summary.eval_loss,
        "losses": summary.losses,
        "placement_link_view": link_view(summary),
        "wall_s": run.get("wall_s"),
        "loadavg_1m": run.get("loadavg_1m"),
        "wire_bytes_by_node": run.get("wire_bytes_by_node"),
        # vela-ray only: master vs expert round trips
        "step_breakdown_s": summary.step_breakdown_s.model_dump() if summary.step_breakdown_s else None,
        "cost_model": summary.placement.cost_model,
        "allreduce_cross_bytes_per_step": allreduce_cross_bytes(summary) if summary.mode == "expert_parallel" else 0.0,
    }
    if unshaped:
        again = RunSummary.model_validate(unshaped["summary"])
        row["unshaped_median_step_time_s"] = median_step(again, min(warmup, len(again.history) - 1))
        row["measured_comm_s"] = step - row["unshaped_median_step_time_s"]
        row["predicted_comm_delta_s"] = predicted_comm_delta(summary, again, compute_s_per_row)
        row["predicted_comm_delta_full_duplex_s"] = predicted_comm_delta(summary, again, compute_s_per_row,
                                                                         full_duplex=True)
    return row


def build_results(args, grid: dict, links: dict) -> dict:
    """{"datasets": {name: {method: row}}, "links": ..., "paper_scale": ..., "settings": ...}."""
    datasets = {}
    for name, runs in grid["runs"].items():
        unshaped = grid.get("unshaped", {}).get(name, {})
        compute = measured_compute(runs)
        rows = {m: method_row(s, unshaped.get(m), args.warmup_steps, compute) for m, s in runs.items()}
        if "ep" in rows:
            ep = rows["ep"]
            for row in rows.values():
                row["bytes_vs_ep"] = row["cross_bytes_per_node_per_step"] / ep["cross_bytes_per_node_per_step"] - 1
                row["step_time_vs_ep"] = row["median_step_time_s"] / ep["median_step_time_s"]
        datasets[name] = rows
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("inner", "spec")}
    return {"datasets": datasets, "links": links, "paper_scale": paper_scale.simulate(), "settings": settings,
            "shaped": not args.no_emulate, "serial_compute": grid.get("serial_compute", {}), "raw": grid}


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def markdown(results: dict) -> str:
    lines = []
    if not results["shaped"]:
        lines += ["**Unshaped cluster** (`--no-emulate`): 3 Ray nodes on one loopback; cross-node bytes are "
                  "counted, but cross-node links are no slower than intra-node ones.", ""]
    lines += [_links_line(results["links"]), ""]
    lines += ["| data set | method | cross-node MB/node/step | vs EP | median step s | / EP | predicted comm s | "
              "measured comm s | final loss |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results["datasets"].items():
        for method, r in rows.items():
            lines.append(
                f"| {name} | {LABELS[method]} | {r['cross_bytes_per_node_per_step'] / 1e6:.3f} | "
                f"{_fmt(r.get('bytes_vs_ep'), '+.1%')} | {r['median_step_time_s']:.3f} | "
                f"{_fmt(r.get('step_time_vs_ep'), '.2f')} | {_fmt(r['predicted_comm_s'], '.3f')} | "
                f"{_fmt(r.get('measured_comm_s'), '.3f')} | {r['final_loss']:.4f} |")
    lines += ["", _placement_view_line(results["datasets"]), "", *_breakdown_lines(results)]
    lines += ["", "Paper-scale simulation (cost model, Mixtral-8x7B on the paper's cluster, our profiles):", "",
              paper_scale.markdown(results["paper_scale"])]
    return "\n".join(lines)


def _breakdown_lines(results: dict) -> list[str]:
    """Where the step time goes: communication (shaped - unshaped) and the rest, against the arithmetic alone."""
    lines = ["Where a vela-ray step goes (median s over steps; the master waits on expert round trips, which "
             "hold the workers' compute; worker compute is wall time per step, max and sum over workers):", "",
             "| data set | method | step | master | expert round trips | worker compute max | sum |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, rows in results["datasets"].items():
        for method, r in rows.items():
            split = r.get("step_breakdown_s")
            if split:
                lines.append(f"| {name} | {LABELS[method]} | {split['step']:.3f} | {split['master']:.3f} | "
                             f"{split['expert_round_trip']:.3f} | {split['worker_compute_max']:.3f} | "
                             f"{split['worker_compute_sum']:.3f} |")
    lines += ["", "Step time breakdown (median s; comm = shaped - unshaped, rest = unshaped):", ""]
    for name, rows in results["datasets"].items():
        for method, r in rows.items():
            if r.get("measured_comm_s") is not None:
                lines.append(f"- {name} / {LABELS[method]}: step {r['median_step_time_s']:.3f} = comm "
                             f"{r['measured_comm_s']:.3f} ({r['measured_comm_s'] / r['median_step_time_s']:.0%}) + "
                             f"rest {r['unshaped_median_step_time_s']:.3f}"
                             + _delta_text(r.get("predicted_comm_delta_s"), r["measured_comm_s"],
                                           r.get("predicted_comm_delta_full_duplex_s")))
        serial = results["serial_compute"].get(name)
        if serial:
            lines.append(f"- {name}: the step's arithmetic alone (single process, one thread, no transport): "
                         f"{serial['median_step_time_s']:.3f}")
    loads = [load for rows in results["datasets"].values() for r in rows.values() for load in r.get("loadavg_1m") or []]
    if loads:
        lines += ["", f"Machine load (1-minute average) at run starts and ends: {min(loads):.1f} to {max(loads):.1f} "
                      "(2 cores, shared with other work)."]
    return lines


def _delta_text(predicted: float | None, measured: float, full_duplex: float | None = None) -> str:
    if predicted is None:
        return ""

    def off(value: float) -> str:
        return f" ({value / measured - 1:+.0%})" if measured > 0 else ""

    text = f"; the cost model (links + compute) predicts comm {predicted:.3f}{off(predicted)}"
    if full_duplex is not None and full_duplex != predicted:
        text += f", {full_duplex:.3f}{off(full_duplex)} with full-duplex NICs"
    return text


def _placement_view_line(datasets: dict) -> str:
    """What the PlacementService's probe (over Ray object refs) measured, per data set's vela-ray runs."""
    parts = []
    for name, rows in datasets.items():
        views = [r["placement_link_view"] for r in rows.values() if r.get("placement_link_view")]
        views = [v for v in views if "ratio" in v]
        if views:
            same = np.median([v["same_node"] for v in views]) / 1e6
            cross = np.median([v["cross_node"] for v in views]) / 1e6
            parts.append(f"{name}: same-node workers {same:.0f} MB/s, cross-node {cross:.1f} MB/s "
                         f"(ratio {same / cross:.1f}, median over {len(views)} runs)")
    return "Placement service probe (summary['links'], each worker alone): " + ("; ".join(parts) or "no vela-ray run")


def _links_line(links: dict) -> str:
    if "tcp" not in links:
        return links.get("note", "")
    tcp, ray_links = links["tcp"], links["ray"]
    return (f"Links: cross-node shaped to {links['cross_mbit']:.0f} Mbit/s (calibrated on {links['calibrate']}). "
            f"TCP: intra {tcp['intra_bytes_per_s'] / 1e9:.2f} GB/s, cross {tcp['cross_bytes_per_s'] / 1e6:.0f} MB/s "
            f"(ratio {tcp['ratio']:.1f}). Ray objects: same node {ray_links['same_node_bytes_per_s'] / 1e6:.0f} MB/s, "
            f"cross {ray_links['cross_node_bytes_per_s'] / 1e6:.0f} MB/s (ratio {ray_links['ratio']:.1f}).")


def plot_traffic(results: dict, path: Path) -> None:
    names = list(results["datasets"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for method, r in results["datasets"][name].items():
            per_step = np.asarray(r["cross_bytes_per_node_by_step"]) / 1e6
            ax.plot(np.arange(1, len(per_step) + 1), per_step, marker="o", ms=3, label=LABELS[method])
        ax.set(title=f"{name}: cross-node traffic per node", xlabel="step", ylabel="MB per node per step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_step_time(results: dict, path: Path) -> None:
    names = list(results["datasets"])
    methods = list(next(iter(results["datasets"].values())))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, method in enumerate(methods):
        x = np.arange(len(names)) + i * width
        steps = [results["datasets"][n][method]["median_step_time_s"] for n in names]
        comm = [max(0.0, results["datasets"][n][method].get("measured_comm_s") or 0.0) for n in names]
        ax.bar(x, steps, width, label=LABELS[method])
        ax.bar(x, comm, width, color="none", edgecolor="black", hatch="//", linewidth=0.5)
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set(ylabel="median step time (s)", title="Step time (hatched: measured communication time)")
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_all(results: dict, out: Path) -> None:
    write_results(out / "results.json", results, markdown=markdown(results))
    plot_traffic(results, out / "traffic_over_steps.png")
    plot_step_time(results, out / "step_time.png")


# --- --paper: the paper's Figs. 5-6 and its numbers beside ours ---------------------------------------

PAPER_LABELS = {"ep": "EP", "sequential": "Seq", "random": "Random",
                "vela": "VELA (paper's method)", "improved": "vela-ray defaults"}
# Sec. V-B: VELA against EP, ranges over the two models (Mixtral-8x7B, GritLM-8x7B). Traffic is given per
# data set; step time only as one range, "from 20.6% in Fig. 6(b) to 28.2% in Fig. 6(a)", so the same
# range stands beside both data sets. Baselines: "roughly the same" traffic as EP, EP "slightly higher".
PAPER_TRAFFIC_VS_EP = {"wikitext": (-0.253, -0.181), "alpaca": (-0.201, -0.173)}
PAPER_STEP_VS_EP = (-0.282, -0.206)
PAPER_BASELINE_MB = 866.0  # ~ cross-node MB per node per step of the baselines (16.4 MB x 4 x 32 / 3)
PAPER_SETUP = ("3 nodes x 2 V100, 18.3 GB/s intra-node, 1.17 GB/s cross-node (15.6x), Mixtral-8x7B / GritLM-8x7B "
               "(32 layers, 8 experts, hidden 4096, fp16), batch 8, 500 steps, WikiText and Alpaca")


def paper_key(dataset: str) -> str:
    return "alpaca" if "alpaca" in dataset else dataset


def paper_rows(results: dict) -> list[dict]:
    """One row per (data set, method): ours (bytes, step time, both vs EP) and the paper's ranges."""
    rows = []
    for name, methods in results["datasets"].items():
        traffic = PAPER_TRAFFIC_VS_EP.get(paper_key(name))
        for method, r in methods.items():
            is_vela = method in ("vela", "improved")
            rows.append({
                "dataset": name, "method": method, "label": PAPER_LABELS.get(method, LABELS[method]),
                "cross_mb_per_node_per_step": r["cross_bytes_per_node_per_step"] / 1e6,
                "bytes_vs_ep": r.get("bytes_vs_ep"), "median_step_time_s": r["median_step_time_s"],
                "step_vs_ep": None if r.get("step_time_vs_ep") is None else r["step_time_vs_ep"] - 1,
                "paper_bytes_vs_ep": traffic if is_vela else None,
                "paper_step_vs_ep": PAPER_STEP_VS_EP if is_vela else None,
                "steps": len(r["step_times_s"]), "final_loss": r["final_loss"]})
    return rows


def _range(pair) -> str:
    return "n/a" if pair is None else f"{pair[0]:+.1%} … {pair[1]:+.1%}"


def paper_markdown(results: dict) -> str:
    s = results["settings"]
    links = results["links"]
    tcp = links.get("tcp", {})
    rows = paper_rows(results)
    steps = sorted({r["steps"] for r in rows})
    lines = [
        "# VELA's evaluation at its conditions (benchmarks/vela_vs_ep.py --paper)", "",
        f"Paper (Sec. V): {PAPER_SETUP}.", "",
        f"Ours: 3 emulated nodes x 2 ExpertManagers (network namespaces on one 2-core machine), both tiers shaped "
        f"with tbf: intra-node (each node's loopback) {s.get('intra_mbit') or 0:.0f} Mbit/s, cross-node (each "
        f"node's veth) {links.get('cross_mbit', 0):.0f} Mbit/s (configured ratio {s['ratio']:.1f}). Measured TCP: "
        f"intra {tcp.get('intra_bytes_per_s', 0) / 1e6:.0f} MB/s, cross {tcp.get('cross_bytes_per_s', 0) / 1e6:.1f} "
        f"MB/s, **ratio {tcp.get('ratio', float('nan')):.1f}** (paper 15.6). Tiny pre-trained Mixtral (4 layers, "
        f"8 experts, top-2, debug width), LoRA, batch {s['batch_size']}, seq {s['seq_len']}, lr {s['lr']}, "
        f"**{', '.join(map(str, steps))} steps** per method and data set (paper 500), medians without the first "
        f"{s['warmup_steps']}. Alpaca stands as the 175 Alpaca seed tasks + GSM8K in Alpaca format "
        f"(`alpaca`, {s['limit']} records, shuffled); WikiText is WikiText-2.", "",
        "Methods: EP (all-to-all over gloo, sequential layout e % N), Seq and Random (vela-ray's master-worker "
        "framework, sequential / random placement), **VELA (paper's method)**: the paper's LP (`solver: vela`), "
        "independent master-worker links (`shared_links: none`), the whole training set profiled "
        f"(`profile_batches: {max(1, s['limit'] // s['batch_size'])}`), and **vela-ray defaults**: "
        "`solver: improved` (LP + local search), `shared_links: measure` (rows for the NICs master traffic "
        "shares), a 4-batch profile, forward and backward traffic both counted by the cost model.", "",
        "| data set | method | cross-node MB/node/step | vs EP (ours) | vs EP (paper) | median step s | "
        "vs EP (ours) | vs EP (paper) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        paper_traffic = _range(r["paper_bytes_vs_ep"]) if r["paper_bytes_vs_ep"] else (
            "+0% (ref., ~866 MB)" if r["method"] == "ep" else "≈ EP (\"roughly the same\")")
        paper_step = _range(r["paper_step_vs_ep"]) if r["paper_step_vs_ep"] else (
            "+0% (ref.)" if r["method"] == "ep" else "n/a (Fig. 6 only)")
        lines.append(f"| {r['dataset']} | {r['label']} | {r['cross_mb_per_node_per_step']:.3f} | "
                     f"{_fmt(r['bytes_vs_ep'], '+.1%')} | {paper_traffic} | {r['median_step_time_s']:.3f} | "
                     f"{_fmt(r['step_vs_ep'], '+.1%')} | {paper_step} |")
    lines += ["", "The paper's step-time range (-20.6 … -28.2%) is one range over its Fig. 6(a)/(b); it stands "
              "beside both data sets. Its traffic ranges span its two models.", "",
              "Figures: `fig5_traffic.png` (cross-node MB per node per step: bars per method, and change against EP "
              "with the paper's range beside), `fig6_step_time.png` (median step time, same layout), "
              "`traffic_over_steps.png` (per step, as the paper's Fig. 5 curves).", ""]
    return "\n".join(lines)


def _paper_figure(results: dict, path: Path, value: str, change: str, paper: dict, ylabel: str,
                  title: str) -> None:
    names = list(results["datasets"])
    rows = paper_rows(results)
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 9), squeeze=False)
    fig.subplots_adjust(hspace=0.55)
    for col, name in enumerate(names):
        mine = [r for r in rows if r["dataset"] == name]
        labels = [r["label"] for r in mine]
        x = np.arange(len(mine))
        colors = [f"C{i}" for i in range(len(mine))]
        ax = axes[0][col]
        ax.bar(x, [r[value] for r in mine], color=colors)
        ax.set_xticks(x, labels, rotation=25, ha="right", fontsize=8)
        ax.set(title=f"{name}: {title}", ylabel=ylabel)
        ax = axes[1][col]
        changes = [100 * (r[change] or 0.0) for r in mine]
        ax.bar(x, changes, color=colors, label="ours")
        lo, hi = paper(name)
        px = len(mine) + 0.2
        ax.bar([px], [100 * (hi - lo)], bottom=[100 * lo], width=0.6, color="none", edgecolor="black",
               hatch="//", label="paper: VELA vs EP (range)")
        ax.set_xticks(list(x) + [px], labels + ["paper VELA"], rotation=25, ha="right", fontsize=8)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set(ylabel="% vs EP", title=f"{name}: change against EP, ours vs the paper's")
        ax.legend(fontsize=8)
    _save(fig, path)


def write_paper(results: dict, out: Path) -> None:
    """--paper's outputs: paper.md (table beside the paper's numbers), paper.json, fig5/fig6 PNGs."""
    text = paper_markdown(results)
    (out / "paper.md").write_text(text)
    write_results(out / "paper.json", {"rows": paper_rows(results), "paper": {
        "traffic_vs_ep": PAPER_TRAFFIC_VS_EP, "step_vs_ep": PAPER_STEP_VS_EP, "baseline_mb": PAPER_BASELINE_MB,
        "setup": PAPER_SETUP}, "links": results["links"], "settings": results["settings"]})
    _paper_figure(results, out / "fig5_traffic.png", "cross_mb_per_node_per_step", "bytes_vs_ep",
                  lambda n: PAPER_TRAFFIC_VS_EP.get(paper_key(n), (0.0, 0.0)),
                  "MB per node per step", "cross-node traffic (Fig. 5)")
    _paper_figure(results, out / "fig6_step_time.png", "median_step_time_s", "step_vs_ep",
                  lambda n: PAPER_STEP_VS_EP, "median step time (s)", "step time (Fig. 6)")
    print(text)
