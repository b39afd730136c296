"""The run report: one self-contained HTML page (and a terminal summary) of a finished `vela train` run.

    from vela_ray.observability.report import write_report, summary_text
    print(summary_text("runs/demo"))
    write_report("runs/demo")            # -> runs/demo/report.html  (or `vela report runs/demo`)

It reads what the master writes into `output.dir`: `summary.json` (required),
`profile.json` / `profile.npy` (P [L, E], when the profile was measured),
`placement.json` and `config.json` (the job config; optional). Charts are
inline SVG from matplotlib, so the page needs no network and no scripts
beyond a tiny self-check (`window.onerror` and a count of rendered charts,
written into `<body data-rendered=...>` for the browser test).

Sections: the run at a glance; the placement map (layers x workers: which
experts each worker holds, shaded by the routing mass it serves); the access
heatmap P [L, E] with each expert's worker; traffic by link tier per step;
predicted vs measured communication per worker; loss (+ eval loss); the config.

Predicted vs measured communication: the cost model's constant bytes_per_row x
tokens_per_step is recovered from the plan itself, c = expected_step_time_s /
sum_l max_n (mass[n,l] / B_n) with mass[n,l] = sum of P over worker n's experts
of layer l and B_n the probed bandwidth in `links`; a worker's predicted bytes
per step are c x sum_l mass[n,l]. Measured bytes per step are the run's mean
training bytes per step (history) split by each worker's share of all the run's
expert traffic (`traffic_bytes_by_worker`, which also counts eval passes), or
the per-worker history when steps record `bytes_by_worker`.

Shape legend: L = MoE layers, E = experts per layer, N = workers.
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from vela_ray.observability.metrics import predicted_row_share  # noqa: E402

MiB = 2**20
TIER_COLOURS = {"same_process": "#9e9e9e", "same_node": "#1f77b4", "cross_node": "#d62728"}


# --- reading a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What a run directory holds: the summary, and the config and access profile when present."""

    dir: Path
    summary: dict
    config: dict | None
    probs_LE: np.ndarray | None  # [L, E] access probability the placement was solved for
    profile_source: str | None  # the file P came from

    @property
    def expert_to_worker_LE(self) -> np.ndarray:
        return np.asarray(self.summary["placement"]["expert_to_worker"], dtype=np.int64)

    @property
    def num_workers(self) -> int:
        return len(self.summary.get("worker_tiers") or self.summary["traffic_bytes_by_worker"])

    @property
    def history(self) -> list[dict]:
        return self.summary.get("history", [])


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory; ValueError if it has no summary.json (the run did not finish)."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"{run_dir} has no summary.json: give the output.dir of a finished `vela train` run")
    summary = json.loads(summary_path.read_text())
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else None
    probs, source = _find_profile(run_dir, config)
    if probs is not None and probs.shape != np.shape(summary["placement"]["expert_to_worker"]):
        probs, source = None, None  # a profile of another model: better none than a wrong one
    return Run(run_dir, summary, config, probs, source)


def _find_profile(run_dir: Path, config: dict | None) -> tuple[np.ndarray | None, str | None]:
    candidates = [run_dir / "profile.json", run_dir / "profile.npy"]
    given = ((config or {}).get("placement") or {}).get("profile")
    if given not in (None, "measure", "uniform"):
        candidates.append(Path(given))
    for path in candidates:
        if path.is_file():
            return _read_probs(path), str(path)
    return None, None


def _read_probs(path: Path) -> np.ndarray:
    """P [L, E] from an AccessProfile JSON (its `probs` field) or a .npy (read here without torch)."""
    if path.suffix == ".npy":
        return np.asarray(np.load(path), dtype=np.float64)
    data = json.loads(path.read_text())
    if "probs" in data:
        return np.asarray(data["probs"], dtype=np.float64)
    return np.asarray(data["counts"], dtype=np.float64) / data["tokens"]


# --- predicted vs measured communication -------------------------------------------------------------


@dataclass(frozen=True)
class WorkerComm:
    """One worker's communication per training step, predicted by the placement and measured."""

    worker: int
    tier: str
    experts: int
    bandwidth_bytes_per_s: float | None
    predicted_bytes: float | None
    measured_bytes: float

    @property
    def predicted_link_s(self) -> float | None:
        if self.predicted_bytes is None or not self.bandwidth_bytes_per_s:
            return None
        return self.predicted_bytes / self.bandwidth_bytes_per_s

    @property
    def measured_link_s(self) -> float | None:
        return self.measured_bytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else None


def compare_comm(run: Run) -> list[WorkerComm]:
    """Per worker: predicted and measured bytes per training step (see the module docstring)."""
    table_LE = run.expert_to_worker_LE
    n = run.num_workers
    bandwidths = [link.get("bandwidth_bytes_per_s") for link in run.summary.get("links", [])] or [None] * n
    predicted = _predicted_bytes(run, bandwidths)
    measured = _measured_bytes(run)
    tiers = run.summary.get("worker_tiers") or ["?"] * n
    experts = np.bincount(table_LE.ravel(), minlength=n)
    return [WorkerComm(w, tiers[w], int(experts[w]), bandwidths[w],
                       None if predicted is None else float(predicted[w]), float(measured[w])) for w in range(n)]


def _predicted_bytes(run: Run, bandwidths: list) -> np.ndarray | None:
    expected = run.summary["placement"].get("expected_step_time_s")
    if run.probs_LE is None or not expected or None in bandwidths:
        return None
    table_LE, n = run.expert_to_worker_LE, run.num_workers
    mass_NL = np.stack([np.where(table_LE == w, run.probs_LE, 0.0).sum(axis=1) for w in range(n)])
    per_byte_s = float((mass_NL / np.asarray(bandwidths, dtype=np.float64)[:, None]).max(axis=0).sum())
    if per_byte_s <= 0:
        return None
    return expected / per_byte_s * predicted_row_share(table_LE, run.probs_LE)[:n]


def _measured_bytes(run: Run) -> np.ndarray:
    """[N] mean training bytes per step and worker."""
    per_step = [h["bytes_by_worker"] for h in run.history if "bytes_by_worker" in h]
    if per_step:
        return np.mean(np.asarray(per_step, dtype=np.float64), axis=0)
    by_worker = np.asarray(run.summary["traffic_bytes_by_worker"], dtype=np.float64)
    step_bytes = [sum(h.get("bytes_by_tier", {}).values()) for h in run.history]
    if not step_bytes or by_worker.sum() == 0:
        return np.zeros_like(by_worker)
    return by_worker / by_worker.sum() * float(np.mean(step_bytes))


# --- terminal summary ------------------------------------------------------------------------------------


def summary_text(run_dir: str | Path) -> str:
    """A few lines for the terminal: loss, step time, placement, traffic by tier, predicted vs measured."""
    run = load_run(run_dir)
    s, plan = run.summary, run.summary["placement"]
    losses = s["losses"]
    lines = [
        f"run {run.dir}: {s['steps']} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, eval loss {s['eval_loss']:.4f}",
        f"median step time {s['median_step_time_s']:.3f} s; placement {plan['solver']}: expected comm "
        f"{plan['expected_step_time_s'] * 1e3:.3f} ms/step" + _bound_text(plan),
        "expert traffic by link tier: " + ", ".join(
            f"{tier} {nbytes / MiB:.1f} MiB" for tier, nbytes in s["traffic_bytes_by_tier"].items()),
    ]
    for c in compare_comm(run):
        predicted = "n/a" if c.predicted_bytes is None else f"{c.predicted_bytes / MiB:.2f}"
        lines.append(f"  worker {c.worker} ({c.tier}, {c.experts} experts): {predicted} MiB/step predicted, "
                     f"{c.measured_bytes / MiB:.2f} measured")
    return "\n".join(lines)


def _bound_text(plan: dict) -> str:
    bound = plan.get("lower_bound_s")
    return "" if not bound else f" (LP bound {bound * 1e3:.3f} ms, gap {plan['expected_step_time_s'] / bound - 1:.1%})"


# --- charts: matplotlib figures -> inline SVG ---------------------------------------------------------------


def _svg(fig: plt.Figure) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, selectable
        fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def loss_chart(history: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], color="#1f77b4", label="train loss")
    evals = [(h["step"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals), "o--", color="#ff7f0e", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


def traffic_chart(history: list[dict], predicted_bytes: float | None = None) -> str:
    """Stacked MiB per step by link tier (tiers with no traffic are left out); dashed: the placement's prediction."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    steps = np.asarray([h["step"] for h in history])
    tiers = [t for t in TIER_COLOURS if any(h.get("bytes_by_tier", {}).get(t, 0) for h in history)]
    series = [np.asarray([h["bytes_by_tier"].get(t, 0) for h in history]) / MiB for t in tiers]
    if series:
        ax.stackplot(steps, *series, labels=tiers, colors=[TIER_COLOURS[t] for t in tiers], alpha=0.85)
    if predicted_bytes is not None:
        ax.axhline(predicted_bytes / MiB, color="black", linestyle="--", linewidth=1, label="predicted (placement)")
    if series or predicted_bytes is not None:
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("step")
    ax.set_ylabel("expert traffic per step (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _svg(fig)


def comm_chart(comms: list[WorkerComm]) -> str:
    """Grouped bars per worker: predicted and measured MiB per step."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    x = np.arange(len(comms))
    measured = [c.measured_bytes / MiB for c in comms]
    if all(c.predicted_bytes is not None for c in comms):
        ax.bar(x - 0.2, [c.predicted_bytes / MiB for c in comms], 0.4, label="predicted (placement)",
               color="#bbbbbb", edgecolor="#555555")
        ax.bar(x + 0.2, measured, 0.4, label="measured (colour: link tier)",
               color=[TIER_COLOURS.get(c.tier, "#1f77b4") for c in comms])
    else:
        ax.bar(x, measured, 0.5, label="measured (colour: link tier)",
               color=[TIER_COLOURS.get(c.tier, "#1f77b4") for c in comms])
    ax.set_xticks(x, [f"w{c.worker}\n{c.tier}" for c in comms], fontsize=8)
    ax.set_ylabel("MiB per training step")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def heatmap_chart(probs_LE: np.ndarray, expert_to_worker_LE: np.ndarray) -> str:
    """P [L, E] as a heatmap; each cell names the worker that holds the expert (when cells are large enough)."""
    num_layers, num_experts = probs_LE.shape
    width = min(12.0, max(4.0, 0.5 * num_experts + 1.5))
    height = min(14.0, max(2.2, 0.4 * num_layers + 1.2))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(probs_LE, cmap="Blues", vmin=0.0, aspect="auto", interpolation="nearest")
    if num_experts <= 32 and num_layers <= 64:
        vmax = float(probs_LE.max()) or 1.0
        for (layer, expert), value in np.ndenumerate(probs_LE):
            ax.text(expert, layer, f"w{expert_to_worker_LE[layer, expert]}", ha="center", va="center",
                    fontsize=7, color="white" if value > 0.6 * vmax else "black")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=ax, shrink=0.9).set_label("access probability P")
    return _svg(fig)


# --- HTML ------------------------------------------------------------------------------------------------


def placement_table(run: Run) -> str:
    """Layers down, workers across; a cell lists the worker's experts, shaded by the routing mass it serves."""
    table_LE, n = run.expert_to_worker_LE, run.num_workers
    tiers = run.summary.get("worker_tiers") or ["?"] * n
    head = "".join(f"<th>w{w}<br><small>{html.escape(tiers[w])}</small></th>" for w in range(n))
    rows = []
    for layer, owners_E in enumerate(table_LE):
        total = float(run.probs_LE[layer].sum()) if run.probs_LE is not None else 0.0
        cells = []
        for w in range(n):
            experts = np.flatnonzero(owners_E == w)
            share = float(run.probs_LE[layer, experts].sum()) / total if total else 0.0
            label = " ".join(map(str, experts)) if len(experts) <= 12 else f"{len(experts)} experts"
            title = f"layer {layer}, worker {w}: {share:.0%} of the layer's routed rows"
            cells.append(f'<td style="background: rgba(31,119,180,{0.08 + 0.6 * share:.2f})" '
                         f'title="{title}">{label or "&ndash;"}</td>')
        rows.append(f"<tr><th>layer {layer}</th>{''.join(cells)}</tr>")
    return f'<table class="placement"><tr><th></th>{head}</tr>{"".join(rows)}</table>'


def comm_table(comms: list[WorkerComm]) -> str:
    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x / MiB:.2f}"

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1e3:.2f}"

    rows = "".join(
        f"<tr><td>w{c.worker}</td><td>{html.escape(c.tier)}</td><td>{c.experts}</td>"
        f"<td>{'n/a' if not c.bandwidth_bytes_per_s else f'{c.bandwidth_bytes_per_s / 1e9:.2f}'}</td>"
        f"<td>{mib(c.predicted_bytes)}</td><td>{mib(c.measured_bytes)}</td>"
        f"<td>{ms(c.predicted_link_s)}</td><td>{ms(c.measured_link_s)}</td></tr>" for c in comms)
    head = ("<tr><th>worker</th><th>link tier</th><th>experts</th><th>probed GB/s</th><th>predicted MiB/step</th>"
            "<th>measured MiB/step</th><th>predicted link ms/step</th><th>measured link ms/step</th></tr>")
    return f'<table class="comm">{head}{rows}</table>'


def overview(run: Run) -> str:
    s, plan = run.summary, run.summary["placement"]
    facts = {
        "steps": s["steps"],
        "loss": f"{s['losses'][0]:.4f} &rarr; {s['losses'][-1]:.4f}",
        "eval loss": f"{s['eval_loss']:.4f}",
        "median step time": f"{s['median_step_time_s']:.3f} s",
        "placement": html.escape(plan["solver"]),
        "expected comm": f"{plan['expected_step_time_s'] * 1e3:.3f} ms/step" + html.escape(_bound_text(plan)),
        "workers": f"{run.num_workers} on {len(set(s.get('worker_nodes', []))) or '?'} node(s)",
    }
    facts.update({f"{tier} traffic": f"{nbytes / MiB:.1f} MiB" for tier, nbytes in s["traffic_bytes_by_tier"].items()})
    cards = "".join(f'<div class="card"><div class="k">{k}</div><div class="v">{v}</div></div>'
                    for k, v in facts.items())
    return f'<div class="cards">{cards}</div>'


def config_block(run: Run) -> str:
    if run.config is None:
        return ('<p class="note">No <code>config.json</code> in this run directory '
                "(runs written before the master saved its config).</p>")
    return f"<pre>{html.escape(yaml.safe_dump(run.config, sort_keys=False))}</pre>"


def _section(anchor: str, title: str, body: str, note: str = "") -> str:
    note_html = f'<p class="note">{note}</p>' if note else ""
    return f'<section id="{anchor}"><h2>{title}</h2>{note_html}{body}</section>'


def _chart(name: str, svg: str) -> str:
    return f'<div class="chart" data-chart="{name}">{svg}</div>'


def render_html(run: Run) -> str:
    """The whole page as one string (inline SVG and CSS, no external resources)."""
    comms = compare_comm(run)
    sections = [
        _section("overview", "Run at a glance", overview(run)),
        _section("placement", "Placement map", placement_table(run),
                 "Rows: MoE layers; columns: workers (ExpertManagers) with their link tier from the master. "
                 "A cell lists the experts the worker holds in that layer; the shade is the share of the layer's "
                 "routed rows it serves (from the access profile)."),
        _heatmap_section(run),
        _section("traffic", "Traffic by link tier", _chart("traffic", traffic_chart(run.history, _total(comms))),
                 "Bytes the broker moved per training step (dispatch, gather and their gradients), by the "
                 "link tier between the master and the worker."),
        _section("comm", "Predicted vs measured communication",
                 _chart("comm", comm_chart(comms)) + comm_table(comms), html.escape(_COMM_NOTE)),
        _section("loss", "Loss", _chart("loss", loss_chart(run.history))),
        _section("config", "Configuration", config_block(run)),
    ]
    title = f"vela-ray run {html.escape(run.dir.name or str(run.dir))}"
    return _PAGE.format(title=title, css=_CSS, body="".join(sections), script=_SCRIPT)


def _total(comms: list[WorkerComm]) -> float | None:
    """Predicted bytes per step over all workers (None without a prediction)."""
    predicted = [c.predicted_bytes for c in comms]
    return None if not predicted or None in predicted else float(sum(predicted))


def _heatmap_section(run: Run) -> str:
    if run.probs_LE is None:
        return _section("access", "Expert access heatmap",
                        '<p class="note">No access profile in this run (placement.profile was uniform).</p>')
    return _section("access", "Expert access heatmap",
                    _chart("heatmap", heatmap_chart(run.probs_LE, run.expert_to_worker_LE)),
                    f"P[layer, expert]: the share of a layer's tokens routed to the expert (rows sum to top-k), "
                    f"from {html.escape(Path(run.profile_source).name)}; each cell names the expert's worker.")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `run_dir/report.html` (or `out`) and return its path."""
    run = load_run(run_dir)
    path = Path(out) if out else run.dir / "report.html"
    path.write_text(render_html(run), encoding="utf-8")
    return path



_COMM_NOTE = (
    "Predicted: the placement's cost model (bytes per row x tokens per step, recovered from its expected "
    "communication time, the access profile and the probed link bandwidths) times the routing mass of each "
    "worker's experts. Measured: the mean training bytes per step, split by each worker's share of all expert "
    "traffic of the run. Link ms/step = bytes / probed bandwidth. Measured step time includes compute."
)

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1180px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.cards { display: flex; flex-wrap: wrap; gap: 8px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 6px 10px; min-width: 140px; }
.card .k { color: #666; font-size: 12px; } .card .v { font-weight: 600; }
table { border-collapse: collapse; margin: 8px 0; font-size: 12px; }
td, th { border: 1px solid #ddd; padding: 3px 7px; text-align: center; }
.note { color: #555; font-size: 12px; max-width: 900px; }
.chart svg { max-width: 100%; height: auto; }
pre { background: #f6f6f6; padding: 10px; font-size: 12px; overflow-x: auto; }
#js-error { color: #b00; font-weight: bold; }
"""

# Self-check for the browser test: any script error shows up in the DOM, and the body records how many
# charts were laid out with a non-zero size.
_SCRIPT = """
window.onerror = function (message) {
  var div = document.createElement("div"); div.id = "js-error"; div.textContent = "error: " + message;
  document.body.prepend(div);
};
window.addEventListener("load", function () {
  var charts = document.querySelectorAll(".chart svg"), rendered = 0;
  charts.forEach(function (svg) { var r = svg.getBoundingClientRect(); if (r.width > 0 && r.height > 0) rendered++; });
  document.body.setAttribute("data-rendered", rendered + "/" + charts.length);
});
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{css}</style><script>{script}</script></head>
<body><h1>{title}</h1>{body}</body></html>
"""
