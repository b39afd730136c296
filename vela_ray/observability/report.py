"""The run report: one self-contained HTML page (and a terminal summary) of a finished `vela train` run.

    from vela_ray.observability.report import write_report, summary_text
    print(summary_text("runs/demo"))     # or summary_text(summary) with the RunSummary a run returned
    write_report("runs/demo")            # -> runs/demo/report.html  (or `vela report runs/demo`)

It reads what a run writes into `output.dir`: `summary.json` as a typed `RunSummary`
(required; both modes, vela and the expert-parallel baseline, write it) and
`config.json` (the job config; optional). The access profile P [L, E] is the one
the placement was solved for (`summary.placement.problem.probs`), else the run's
`profile.json` / `profile.npy` read by `placement.io.load_profile`. Charts are
inline SVG from matplotlib, so the page needs no network and no scripts beyond a
tiny self-check; where matplotlib is not installed (a bare GPU node) each chart's place says so and
the tables are all there (`window.onerror` and a count of rendered charts, written into
`<body data-rendered=...>` for the browser test).

Sections: the run at a glance (the training method, first-order or zeroth-order, and whether
token condensation made training lossy); the data (examples read, kept, truncated and dropped
by reason, supervised tokens lost, rows and padding, and the warning when much was lost); the
placement map (layers x workers: which experts each worker holds, shaded by the routing mass it
serves); the access heatmap P [L, E] with each expert's
worker; traffic by link tier per step; predicted vs measured communication per worker; APTMoE's
expert tiers per worker (with `expert_tiers`: rows on CPU vs device, uploads, predictor
accuracy, measured speeds); loss (+ eval loss); samples (with `samples.json`: greedy generations
of the base and the fine-tuned model side by side, `vela_ray.generate`); the config.

Predicted bytes per worker and step are the cost model's (`PlacementRecord.predicted_bytes_per_worker`,
i.e. `placement.cost.worker_bytes` of the problem the placement was solved for); a run that solved
none (the expert-parallel baseline, a resumed run that kept its placement) has no prediction.
Measured bytes per step are the per-worker history when steps record `bytes_by_worker`, else the
run's mean training bytes per step split by each worker's share of all its expert traffic.

Shape legend: L = MoE layers, E = experts per layer, N = workers.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import yaml

from placement.cost import experts_per_worker, routing_mass
from placement.io import load_profile
from vela_ray.observability.samples import SamplesRecord
from vela_ray.training.summary import DataRecord, PlacementRecord, RunSummary, StepRecord
from vela_ray.training.tiers import TierCounters

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MiB = 2**20
TIER_COLOURS = {"same_process": "#9e9e9e", "same_node": "#1f77b4", "cross_node": "#d62728"}
SOLVED_PROFILE = "the placement problem in summary.json"
# `RunSummary.method`: its name, and what one step does
METHODS = {"first_order": ("first-order", "backward + AdamW"),
           "zo": ("zeroth-order (ZO-SGD)", "two forwards per step, no backward traffic")}


# --- reading a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A finished run: its summary, and the config and access profile when known."""

    summary: RunSummary
    dir: Path | None  # None: a summary given without its run directory (no config.json, no profile files)
    config: dict | None
    probs_LE: np.ndarray | None  # [L, E] access probability of the placement's profile
    profile_source: str | None  # where P came from (SOLVED_PROFILE or a file name)

    @property
    def table_LE(self) -> np.ndarray:
        return self.summary.placement.table

    @property
    def num_workers(self) -> int:
        return self.summary.num_workers


def load_run(source: RunSummary | str | Path, run_dir: str | Path | None = None) -> Run:
    """A run from its directory (ValueError without summary.json: it did not finish) or its summary.

    With a RunSummary, `run_dir` (optional) is where its config.json and profile files are;
    the runner passes both to report on a run before its summary.json is written.
    """
    if isinstance(source, RunSummary):
        summary, run_dir = source, None if run_dir is None else Path(run_dir)
    else:
        run_dir = Path(source)
        summary = RunSummary.load(run_dir)
    config = _read_config(run_dir)
    return Run(summary, run_dir, config, *_find_profile(summary, _profile_files(run_dir, config)))


def _read_config(run_dir: Path | None) -> dict | None:
    path = None if run_dir is None else run_dir / "config.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _profile_files(run_dir: Path | None, config: dict | None) -> list[Path]:
    """Where a run keeps its measured profile, then the profile file its config named."""
    candidates = [] if run_dir is None else [run_dir / "profile.json", run_dir / "profile.npy"]
    given = ((config or {}).get("placement") or {}).get("profile")
    if given not in (None, "measure", "uniform"):
        candidates.append(Path(given))
    return [path for path in candidates if path.is_file()]


def _find_profile(summary: RunSummary, files: list[Path]) -> tuple[np.ndarray | None, str | None]:
    """P the placement was solved for; else the first profile file of the placement's shape."""
    if summary.placement.problem is not None:
        return np.asarray(summary.placement.problem.probs, dtype=np.float64), SOLVED_PROFILE
    for path in files:
        probs = np.asarray(load_profile(path)[0], dtype=np.float64)
        if probs.shape == summary.placement.table.shape:  # a profile of another model: better none
            return probs, path.name
    return None, None


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
    """Per worker (including any that holds no expert): predicted and measured bytes per training step."""
    summary, n = run.summary, run.num_workers
    predicted = summary.placement.predicted_bytes_per_worker()
    bandwidths = _bandwidths(summary)
    measured = _measured_bytes(summary)
    experts = experts_per_worker(n, run.table_LE)
    return [WorkerComm(w, summary.worker_tiers[w], int(experts[w]), bandwidths[w],
                       None if predicted is None else float(predicted[w]), float(measured[w])) for w in range(n)]


def _bandwidths(summary: RunSummary) -> list[float | None]:
    """[N] bytes/s to each worker: the probed links, else the problem's, else unknown."""
    if summary.links:
        return [link.bandwidth_bytes_per_s for link in summary.links]
    if summary.placement.problem is not None:
        return list(summary.placement.problem.bandwidths)
    return [None] * summary.num_workers


def _measured_bytes(summary: RunSummary) -> np.ndarray:
    """[N] mean training bytes per step and worker (of the steps run on N workers: a run resumed with another
    worker count holds the earlier steps' records too)."""
    per_step = [h.bytes_by_worker for h in summary.history if len(h.bytes_by_worker) == summary.num_workers]
    if per_step:
        return np.mean(np.asarray(per_step, dtype=np.float64), axis=0)
    by_worker = np.asarray(summary.traffic_bytes_by_worker, dtype=np.float64)
    step_bytes = [sum(h.bytes_by_tier.values()) for h in summary.history]
    if not step_bytes or by_worker.sum() == 0:
        return np.zeros(summary.num_workers)
    return by_worker / by_worker.sum() * float(np.mean(step_bytes))


# --- what the cost model expected ------------------------------------------------------------------------


def expected_times(plan: PlacementRecord) -> dict[str, float]:
    """Seconds per step the cost model expected, by label.

    Communication alone is always "expected comm"; under `communication+compute` the solver's
    objective also counts expert compute, so it is shown apart as the expected step, never
    as communication. The "predicted step" is the training step the cost model predicts (the master's
    compute and its waits on the experts: `placement.cost.predict_step`), where the run measured both.
    """
    objective = plan.objective_s
    comm = plan.expected_comm_time_s
    if comm is None and plan.cost_model == "communication":
        comm = objective  # the objective is communication alone
    times = {} if comm is None else {"expected comm": comm}
    if plan.cost_model == "communication+compute" and objective is not None:
        times[OBJECTIVE_WITH_COMPUTE] = objective
    if plan.predicts_step:
        times["predicted step"] = plan.expected_step_time_s
    return times


OBJECTIVE_WITH_COMPUTE = "expected step (comm + compute)"


def _expected_texts(plan: PlacementRecord) -> dict[str, str]:
    """`expected_times` as text; the LP bound goes with the solver's objective."""
    texts = {label: f"{seconds * 1e3:.3f} ms/step" for label, seconds in expected_times(plan).items()}
    objective = OBJECTIVE_WITH_COMPUTE if OBJECTIVE_WITH_COMPUTE in texts else "expected comm"
    if objective in texts and plan.lower_bound_s and plan.objective_s:
        gap = plan.objective_s / plan.lower_bound_s - 1
        texts[objective] += f" (LP bound {plan.lower_bound_s * 1e3:.3f} ms, gap {gap:.1%})"
    return texts


# --- terminal summary ------------------------------------------------------------------------------------


def summary_text(source: RunSummary | str | Path) -> str:
    """A few lines for the terminal: loss (and the method when zeroth-order), step time, placement, traffic by
    tier, the expert tiers (when on), the data (`data_lines`), predicted vs measured, the trackers
    (`trackers_lines`), and where the adapter, report and last checkpoint went. `source`: a run directory or its
    RunSummary."""
    run = load_run(source)
    s = run.summary
    expected = ", ".join(f"{label} {text}" for label, text in _expected_texts(s.placement).items())
    startup = s.timings_s.get("startup_s")
    lines = [
        _headline(run),
        f"median step time {s.median_step_time_s:.3f} s"
        + (f" (first step {startup:.1f} s after the start)" if isinstance(startup, float) else "")
        + f"; placement {s.placement.solver}"
        + (f": {expected}" if expected else ""),
        "expert traffic by link tier: " + ", ".join(
            f"{tier} {nbytes / MiB:.1f} MiB" for tier, nbytes in s.traffic_bytes_by_tier.items())
        + (f", over {s.data_plane}" if s.data_plane else ""),
        condensation_text(s),
        *([row_format_text(s)] if s.row_format != "exact" else []),
        *([memory_text(s)] if s.bytes_per_expert else []),
        *([tiers_text(s)] if s.expert_tiers else []),
        *([streaming_text(s)] if s.streaming else []),
        *([masters_text(s)] if len(s.master_nodes) > 1 or s.master_tp > 1 or s.pipeline_stages > 1 else []),
        *([f"family {s.family_check}"] if s.family_check else []),
        *data_lines(s.data),
    ]
    for c in compare_comm(run):
        predicted = "n/a" if c.predicted_bytes is None else f"{c.predicted_bytes / MiB:.2f}"
        lines.append(f"  worker {c.worker} ({c.tier}, {c.experts} experts): {predicted} MiB/step predicted, "
                     f"{c.measured_bytes / MiB:.2f} measured")
    lines += [f"re-placement at step {r.step}: drift {r.drift:.3f}, would move {r.moved} experts to save "
              f"{r.expected_saving_s:.3g} s for {r.expected_cost_s:.3g} s: {'adopted' if r.adopted else 'kept'}"
              for r in s.replans]
    lines += [f"worker(s) {r.workers} lost in step {r.step}: replaced and rolled back to step {r.checkpoint_step} "
              f"in {r.seconds:.2f} s" for r in s.recoveries]
    lines += [f"resumed after step {r.step} from {r.checkpoint}" for r in s.resumes]
    lines += samples_lines(SamplesRecord.read(run.dir))
    lines += trackers_lines(s)
    lines += [f"{name}: {path}" for name, path in
              (("adapter", s.adapter_dir), ("report", s.report), ("checkpoint", s.checkpoint)) if path]
    return "\n".join(lines)


def trackers_lines(s: RunSummary) -> list[str]:
    """The experiment trackers (`training.report_to`) in one line: where each logged the run, or why it did not;
    none for a run without trackers."""
    if not s.trackers:
        return []
    return ["trackers: " + "; ".join(f"{name} {text}" for name, text in s.trackers.items())]


def samples_lines(record: SamplesRecord | None) -> list[str]:
    """The report's Samples in one line: how many, and how long they took; or why there are none."""
    if record is None:
        return []
    if record.skipped:
        return [f"samples: none ({record.skipped})"]
    return [f"samples: {len(record.samples)} prompts, base and fine-tuned side by side in the report "
            f"({record.seconds:.1f} s)"]


def data_lines(d: DataRecord | None) -> list[str]:
    """The data's line (examples read, kept, truncated, dropped; rows and padding), and its warning when more
    than 10% of the examples were dropped or truncated; none for a run that recorded no data."""
    if d is None:
        return []
    rows = f"{d.rows} training rows of {d.seq_len} tokens ({d.padding_fraction:.1%} padding)"
    if d.examples is None:
        return [f"data: {d.kind}, {rows}"]
    dropped = sum(d.examples_dropped.values())
    reasons = "; ".join(f"{count} {reason}" for reason, count in d.examples_dropped.items())
    lost = d.supervised_tokens_lost / max(1, d.supervised_tokens or 0)
    per_row = f", {d.examples_per_row:.2f} examples per row" if d.packing and d.examples_per_row else ""
    line = (f"data: {d.examples} examples read, {d.examples_kept} kept ({d.examples_truncated} truncated, "
            f"{d.truncation}), {dropped} dropped" + (f" ({reasons})" if reasons else "")
            + f"; {lost:.1%} of the supervised tokens cut; {rows}{per_row}")
    return [line] + ([f"WARNING: {d.warning}"] if d.warning else [])


def masters_text(s: RunSummary) -> str:
    """One line on data-parallel masters (each one's tensor-parallel ranks or pipeline stages) and the expert copies
    they use."""
    nodes = len(set(s.master_nodes))
    ranks = f", each over {s.master_tp} tensor-parallel ranks of its node" if s.master_tp > 1 else ""
    if s.pipeline_stages > 1:
        ranks += (f", each cut into {s.pipeline_stages} pipeline stages on its node (frozen backbone by stage: "
                  + ", ".join(f"{b / 1e6:.2f}" for b in s.stage_bytes or []) + " MB; expert traffic by stage: "
                  + ", ".join(f"{b / 1e6:.2f}" for b in s.traffic_bytes_by_master) + " MB)")
    copies = 0
    if s.placement.routes is not None:
        copies = int(experts_per_worker(len(s.worker_nodes), np.asarray(s.placement.routes)).sum()
                     - np.asarray(s.placement.routes[0]).size)
    moves = s.sequence_moves
    migration = ("; sequence migration off" if moves is None else
                 f"; sequence migration moved {moves['moves']} sequences ({moves['cross_node_bytes'] / 1e6:.2f} MB of "
                 f"hidden states across nodes, forward and backward; {moves.get('relayed_rows', 0)} expert rows "
                 f"combined on the master their sequence moved to; {moves['skipped']} of {moves['micro_batches']} "
                 "masters' micro-batches stayed: packed rows)")
    count = len(s.master_nodes)
    return (f"{count} data-parallel master{'s' if count > 1 else ''} on {nodes} node(s){ranks}; "
            + (f"{copies} expert copies (replicas), each master using its nearest" if copies else "no expert copies")
            + migration)


def condensation_text(s: RunSummary) -> str:
    """One line: whether token condensation was on, which makes training lossy, and what it saved."""
    c = s.condensation
    if c is None or not c.enabled:
        return "token condensation: off (exact)"
    return (f"token condensation: on (LOSSY): {c.condensed_fraction:.1%} of rows condensed, "
            f"{c.bytes_saved_total / 1e6:.1f} MB saved")


def row_format_text(s: RunSummary) -> str:
    """One line when rows travelled in a low-bit format (LOSSY, `data_plane.row_format`); "" when exact."""
    if s.row_format == "exact":
        return ""
    return (f"rows travelled in {s.row_format} (LOSSY, data_plane.row_format): results differ from "
            "transformers + peft by the rounding")


def memory_text(s: RunSummary) -> str:
    """One line on what a hosted expert took on its worker, and the format its frozen weights were held in."""
    held = (f"frozen weights held in {s.quantization} (LOSSY against the full-width model, model.quantization)"
            if s.quantization else "frozen weights at the checkpoint's width")
    return f"{s.bytes_per_expert / MiB:.2f} MiB per hosted expert with its LoRA state; {held}"


def streaming_text(s: RunSummary) -> str:
    """One line on master 0's streamed backbone (`masters.streaming`)."""
    st = s.streaming
    return (f"backbone streamed (masters.streaming): {st.layers} layers' {st.frozen_bytes / MiB:.2f} MiB of frozen "
            f"weights in host memory, through {st.buffer_blocks} device slots that held at most "
            f"{st.peak_bytes / MiB:.2f} MiB; {st.uploads} uploads, {st.upload_bytes / MiB:.1f} MiB"
            + ("" if st.upload_format == "exact" else f" in {st.upload_format} (LOSSY: the layers computed with "
                                                      "rounded weights)")
            + ("" if st.activation_budget is None else f"; saved activations on the device peaked at "
               f"{st.peak_activation_bytes / MiB:.2f} MiB (budget {st.activation_budget / MiB:.2f} MiB), "
               f"{st.offloaded_bytes / MiB:.2f} MiB offloaded to host memory"))


def tiers_text(s: RunSummary) -> str:
    """One line on APTMoE's expert tiers over all tiered workers ("" when the tiers were off)."""
    if not s.expert_tiers:
        return ""
    total = tier_total(s.expert_tiers)
    share = device_share(total)
    parts = ["no expert rows computed" if share is None else f"{share:.0%} of expert rows on device",
             f"{total.uploads} uploads ({human_bytes(total.upload_bytes)})"]
    if total.copies_dropped or total.demand_jumps:  # the host queue re-ordered (CUDA)
        parts.append(f"{total.copies_dropped} queued copies dropped by a later plan, "
                     f"{total.demand_jumps} demands ahead of the queue")
    if total.predicted_overlap is not None:
        parts.append(f"predictor accuracy {total.predicted_overlap:.2f}")
    return "expert tiers: " + ", ".join(parts)


def tier_total(tiers: list[TierCounters]) -> TierCounters:
    """The workers' counters summed (speeds dropped: they are each worker's own)."""
    summed = [name for name, field in TierCounters.model_fields.items() if field.annotation in (int, float)
              and name != "worker"]
    return TierCounters(worker=-1, **{name: sum(getattr(t, name) for t in tiers) for name in summed})


def device_share(c: TierCounters) -> float | None:
    """Share of the expert rows computed on the device (None: no rows)."""
    rows = c.rows_cpu + c.rows_device
    return c.rows_device / rows if rows else None


def human_bytes(n: float) -> str:
    """Bytes in binary units: "512 B", "3.0 KiB", "1.2 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _headline(run: Run) -> str:
    s = run.summary
    where = f"run {run.dir}: " if run.dir is not None else ""
    mode = "expert-parallel baseline, " if s.mode == "expert_parallel" else ""
    method = "" if s.method != "zo" else "zeroth-order (ZO-SGD, every weight) " if s.zo_parameters == "full" else \
        "zeroth-order (ZO-SGD) "
    objective = "" if s.objective == "sft" else f"{s.objective} "
    return f"{where}{mode}{s.steps} {method}{objective}steps, {_loss_text(s)}{_preference_text(s)}"


def _preference_text(s: RunSummary) -> str:
    """A preference run's last rewards (TRL's metrics): how often the chosen answer won (DPO), and by how much."""
    last = next((h.preference for h in reversed(s.history) if h.preference), None)
    if last is None:
        return ""
    shown = [f"{name} {last[name]:.4f}" for name in ("rewards/accuracies", "rewards/margins", "kl") if name in last]
    held = next((h.eval_preference for h in reversed(s.history) if h.eval_preference), None)
    name = "rewards/accuracies" if held and "rewards/accuracies" in held else "rewards/margins"
    return ", " + ", ".join(shown) + ("" if not held or name not in held else f" (held out: {name} {held[name]:.4f})")


def _loss_text(s: RunSummary) -> str:
    loss = f"loss {s.losses[0]:.4f} -> {s.losses[-1]:.4f}" if s.losses else "no loss recorded"
    return loss + ("" if s.eval_loss is None else f", eval loss {s.eval_loss:.4f}")


# --- charts: matplotlib figures -> inline SVG ---------------------------------------------------------------


@functools.cache
def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on the first chart: a run writes its report where
    matplotlib is not installed too (`charts_available`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def charts_available() -> bool:
    """Whether matplotlib can be imported here (it is not part of the training core)."""
    return importlib.util.find_spec("matplotlib") is not None


def _svg(fig: "Figure") -> str:
    import matplotlib

    plt = _pyplot()
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, selectable
        fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def loss_chart(history: list[StepRecord]) -> str:
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.2))
    ax.plot([h.step for h in history], [h.loss for h in history], color="#1f77b4", label="train loss")
    evals = [(h.step, h.eval_loss) for h in history if h.eval_loss is not None]
    if evals:
        ax.plot(*zip(*evals), "o--", color="#ff7f0e", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


def traffic_chart(history: list[StepRecord], predicted_bytes: float | None = None,
                  replaced_at: list[int] | None = None) -> str:
    """Stacked MiB per step by link tier (tiers with no traffic are left out); dashed: the placement's prediction;
    dotted verticals: re-placements adopted after those steps."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.2))
    for n, step in enumerate(replaced_at or []):
        ax.axvline(step + 0.5, color="#555555", linestyle=":", linewidth=1, label="re-placement" if n == 0 else None)
    steps = np.asarray([h.step for h in history])
    tiers = [t for t in TIER_COLOURS if any(h.bytes_by_tier.get(t, 0) for h in history)]
    series = [np.asarray([h.bytes_by_tier.get(t, 0) for h in history]) / MiB for t in tiers]
    if series:
        ax.stackplot(steps, *series, labels=tiers, colors=[TIER_COLOURS[t] for t in tiers], alpha=0.85)
    if predicted_bytes is not None:
        ax.axhline(predicted_bytes / MiB, color="black", linestyle="--", linewidth=1, label="predicted (placement)")
    if series or predicted_bytes is not None or replaced_at:
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("step")
    ax.set_ylabel("expert traffic per step (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _svg(fig)


def comm_chart(comms: list[WorkerComm]) -> str:
    """Grouped bars per worker: predicted and measured MiB per step."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.2))
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


def heatmap_chart(probs_LE: np.ndarray, expert_to_worker_LE: np.ndarray, top_k: int | None = None) -> str:
    """P [L, E] as a heatmap, each cell naming the worker that holds the expert (`plots.access_heatmap_figure`)."""
    from vela_ray.observability.plots import access_heatmap_figure

    return _svg(access_heatmap_figure({"": probs_LE}, top_k=top_k, owners_LE=expert_to_worker_LE))


# --- HTML ------------------------------------------------------------------------------------------------


def placement_table(run: Run) -> str:
    """Layers down, workers across; a cell lists the worker's experts, shaded by the routing mass it serves."""
    table_LE, n, tiers = run.table_LE, run.num_workers, run.summary.worker_tiers
    share_NL = _mass_share(run)
    head = "".join(f"<th>w{w}<br><small>{html.escape(tiers[w])}</small></th>" for w in range(n))
    rows = []
    for layer, owners_E in enumerate(table_LE):
        cells = "".join(_placement_cell(layer, w, np.flatnonzero(owners_E == w), share_NL[w, layer])
                        for w in range(n))
        rows.append(f"<tr><th>layer {layer}</th>{cells}</tr>")
    return f'<table class="placement"><tr><th></th>{head}</tr>{"".join(rows)}</table>'


def _mass_share(run: Run) -> np.ndarray:
    """[N, L] share of each layer's routed rows each worker serves (zeros without a profile)."""
    if run.probs_LE is None:
        return np.zeros((run.num_workers, run.table_LE.shape[0]))
    mass_NL = routing_mass(run.probs_LE, run.table_LE, run.num_workers)
    totals_L = run.probs_LE.sum(axis=1)
    return np.divide(mass_NL, totals_L, out=np.zeros_like(mass_NL), where=totals_L > 0)


def _placement_cell(layer: int, worker: int, experts: np.ndarray, share: float) -> str:
    label = " ".join(map(str, experts)) if len(experts) <= 12 else f"{len(experts)} experts"
    title = f"layer {layer}, worker {worker}: {share:.0%} of the layer's routed rows"
    return (f'<td style="background: rgba(31,119,180,{0.08 + 0.6 * share:.2f})" '
            f'title="{title}">{label or "&ndash;"}</td>')


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
    head = ("<tr><th>worker</th><th>link tier</th><th>experts</th><th>link GB/s</th><th>predicted MiB/step</th>"
            "<th>measured MiB/step</th><th>predicted link ms/step</th><th>measured link ms/step</th></tr>")
    return f'<table class="comm">{head}{rows}</table>'


def overview(run: Run) -> str:
    s = run.summary
    facts = {
        "mode": "expert-parallel baseline" if s.mode == "expert_parallel" else "vela",
        "method": "{}<br><small>{}</small>".format(*map(html.escape, METHODS[s.method])),
        "steps": s.steps,
        **({"objective": html.escape(s.objective)} if s.objective != "sft" else {}),
        "loss": f"{s.losses[0]:.4f} &rarr; {s.losses[-1]:.4f}" if s.losses else "n/a",
        "eval loss": "n/a" if s.eval_loss is None else f"{s.eval_loss:.4f}",
        "median step time": f"{s.median_step_time_s:.3f} s",
        "placement": html.escape(f"{s.placement.solver} (cost model: {s.placement.cost_model})"),
        **{label: html.escape(text) for label, text in _expected_texts(s.placement).items()},
        "workers": f"{run.num_workers} on {len(set(s.worker_nodes)) or '?'} node(s)",
        **({"data plane": html.escape(s.data_plane)} if s.data_plane else {}),
        **({"family": html.escape(s.family_check)} if s.family_check else {}),
        **({"per hosted expert": f"{s.bytes_per_expert / MiB:.2f} MiB"} if s.bytes_per_expert else {}),
        **({"frozen weights": html.escape(s.quantization) + " (LOSSY)"} if s.quantization else {}),
    }
    facts.update({f"{tier} traffic": f"{nbytes / MiB:.1f} MiB" for tier, nbytes in s.traffic_bytes_by_tier.items()})
    cards = "".join(f'<div class="card"><div class="k">{k}</div><div class="v">{v}</div></div>'
                    for k, v in facts.items())
    masters = (f'<p class="masters">{html.escape(masters_text(s))}</p>'
               if len(s.master_nodes) > 1 or s.master_tp > 1 or s.pipeline_stages > 1
               else "")
    tiers = f'<p class="tiers">{html.escape(tiers_text(s))}</p>' if s.expert_tiers else ""
    rows = f'<p class="condensation">{html.escape(row_format_text(s))}</p>' if s.row_format != "exact" else ""
    return (f'<div class="cards">{cards}</div><p class="condensation">{html.escape(condensation_text(s))}</p>'
            + rows + tiers + masters)


def tiers_table(summary: RunSummary) -> str:
    """Per tiered worker (and all of them): expert computations and rows per tier, uploads, predictor, speeds."""
    def row(name: str, tier: str, c: TierCounters) -> str:
        speed = lambda field: getattr(c.speeds, field, None)  # noqa: E731  (None: not measured, or a total)
        cells = [name, html.escape(tier), c.experts_cpu, c.experts_device, c.rows_cpu, c.rows_device,
                 _number(device_share(c), "{:.1%}"), c.uploads, human_bytes(c.upload_bytes), c.cache_hits,
                 _number(c.predicted_overlap, "{:.3f}"), _number(speed("cpu_s_per_row"), "{:.3g}", 1e6),
                 _number(speed("device_s_per_row"), "{:.3g}", 1e6),
                 _number(speed("upload_bytes_per_s"), "{:.2f}", 1e-9)]
        return "<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"

    tiers = summary.worker_tiers
    rows = [row(f"w{c.worker}", tiers[c.worker] if 0 <= c.worker < len(tiers) else "?", c)
            for c in summary.expert_tiers]
    if len(summary.expert_tiers) > 1:
        rows.append(row("all", "", tier_total(summary.expert_tiers)))
    head = ('<tr><th rowspan="2">worker</th><th rowspan="2">link tier</th><th colspan="2">expert computations</th>'
            '<th colspan="2">rows</th><th rowspan="2">rows on device</th><th rowspan="2">uploads</th>'
            '<th rowspan="2">upload bytes</th><th rowspan="2">cache hits</th><th rowspan="2">predictor accuracy</th>'
            '<th colspan="2">&micro;s per row</th><th rowspan="2">upload GB/s</th></tr>'
            "<tr><th>CPU</th><th>device</th><th>CPU</th><th>device</th><th>CPU</th><th>device</th></tr>")
    return f'<table class="tiers">{head}{"".join(rows)}</table>'


def _number(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else fmt.format(x * scale)


def _tiers_note(run: Run) -> str:
    """What the tier table counts; the cache size and upload format when the run's config.json is there."""
    config = run.config or {}  # runs before issue 32 kept the tiers under `cluster`
    tiers_cfg = config.get("expert_tiers") or (config.get("cluster") or {}).get("expert_tiers") or {}
    cache = tiers_cfg.get("cache_experts")
    upload_format = tiers_cfg.get("upload_format")
    lossy = (f" Uploads travelled as {upload_format} (LOSSY: device experts computed with rounded weights)."
             if upload_format not in (None, "exact") else "")
    return ("Each tiered worker keeps its experts' frozen weights in host memory and computes each expert of a "
            "request on its CPU or its device, as APTMoE's Eq. 1 decides, uploading weights into a device cache"
            + ("" if cache is None else f" of at most {cache} experts") + ". An expert computation is one expert "
            "with rows in one request. Predictor accuracy: the mean demand overlap of the next-layer popularity "
            "forecast (1 = exact). Seconds per row and upload bandwidth: measured on the worker." + lossy)


def changes_table(summary: RunSummary) -> str:
    """Every migration (the start's and drift's), every re-solve that was not adopted, every recovery."""
    rows = [(m.step, f"moved {m.moved} experts ({m.reason}) &rarr; placement v{m.version}",
             f"{m.seconds:.2f} s; {m.state_bytes / MiB:.2f} MiB of LoRA/AdamW state sent, "
             f"{m.frozen_bytes / MiB:.2f} MiB of weights read"
             + ("" if m.expected_saving_s is None else
                f"; expected saving {m.expected_saving_s:.3g} s vs cost {m.expected_cost_s:.3g} s"))
            for m in summary.migrations]
    rows += [(r.step, f"re-solve kept the placement (drift {r.drift:.3f})",
              f"would move {r.moved} experts to save {r.expected_saving_s:.3g} s over {r.horizon_steps} steps "
              f"for {r.expected_cost_s:.3g} s") for r in summary.replans if not r.adopted]
    rows += [(r.step, f"worker(s) {r.workers} lost: replaced in place",
              f"rolled back to step {r.checkpoint_step} in {r.seconds:.2f} s, steps since replayed")
             for r in summary.recoveries]
    rows += [(r.step, "resumed in a new process", f"from checkpoint {r.checkpoint}") for r in summary.resumes]
    body = "".join(f"<tr><td>{step}</td><td>{what}</td><td>{detail}</td></tr>" for step, what, detail in
                   sorted(rows, key=lambda row: row[0]))
    return f'<table class="comm"><tr><th>after step</th><th>what</th><th>detail</th></tr>{body}</table>'


def data_table(d: DataRecord) -> str:
    """What became of the data file's examples (instruct and chat) and the rows they made."""
    def share(n: int, of: int | None) -> str:
        return f"{n} ({n / max(1, of or 0):.1%})"

    facts: list[tuple[str, object]] = [("kind", d.kind), ("seq_len", d.seq_len),
                                       ("layout", "packed" if d.packing else "padded, one example per row")]
    if d.examples is not None:
        facts += [("examples read", d.examples), ("kept", share(d.examples_kept, d.examples)),
                  (f"truncated ({d.truncation})", share(d.examples_truncated, d.examples))]
        facts += [(f"dropped: {reason}", share(count, d.examples)) for reason, count in d.examples_dropped.items()]
        facts += [("supervised tokens", d.supervised_tokens),
                  ("lost to truncation", share(d.supervised_tokens_lost, d.supervised_tokens)),
                  ("longest example", f"{d.longest_example} tokens"),
                  ("seq_len for 90% whole", d.seq_len_p90), ("rows of the whole file", d.built_rows)]
        if d.packing and d.examples_per_row:
            facts.append(("examples per row", f"{d.examples_per_row:.2f}"))
    facts += [("training rows", d.rows), ("training tokens", d.tokens), ("padding", f"{d.padding_fraction:.1%}")]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
    warning = f'<p class="warning">{html.escape(d.warning)}</p>' if d.warning else ""
    return warning + f'<table class="data">{body}</table>'


def _data_note(d: DataRecord) -> str:
    if d.examples is None:
        return "Text data: the token stream cut into rows of seq_len tokens (the tail that fills no row is left out)."
    return ("Counted over the whole file before the train/eval split; an example is dropped when truncation (or an "
            "empty answer) leaves it no supervised token. Padding: share of the training rows' token slots.")


def samples_section(record: SamplesRecord) -> str:
    """Greedy generations of the base and the fine-tuned model side by side (`samples.json`)."""
    if record.skipped:
        return _section("samples", "Samples", "", html.escape(f"No samples: {record.skipped}."))
    rows = "".join(f"<tr><td><pre>{html.escape(s.prompt)}</pre></td><td><pre>{html.escape(s.base)}</pre></td>"
                   f"<td><pre>{html.escape(s.tuned)}</pre></td></tr>" for s in record.samples)
    table = f'<table class="samples"><tr><th>Prompt</th><th>Base model</th><th>Fine-tuned</th></tr>{rows}</table>'
    penalty = f" with repetition penalty {record.repetition_penalty:g}" if record.repetition_penalty != 1 else ""
    return _section("samples", "Samples", table, html.escape(
        f"Greedy generations{penalty}, at most {record.max_new_tokens} new tokens per prompt and model, made on the "
        f"driver after the run in {record.seconds:.1f} s (report.prompts, else the start of evaluation rows: a text "
        f"row's first whole lines)."))


def drift_table(history: list[StepRecord]) -> str:
    """Each layer's routing drift at the first and last step that has one, and its largest."""
    steps = [r for r in history if r.routing_drift]
    first, last = steps[0], steps[-1]
    rows = "".join(f"<tr><td>{layer}</td><td>{first.routing_drift[layer]:.3f}</td><td>{last.routing_drift[layer]:.3f}"
                   f"</td><td>{max(r.routing_drift[layer] for r in steps):.3f}</td></tr>"
                   for layer in range(len(last.routing_drift)))
    return (f"<table><tr><th>MoE layer</th><th>step {first.step}</th><th>step {last.step}</th><th>largest</th></tr>"
            f"{rows}</table>")


def config_block(run: Run) -> str:
    if run.config is None:
        return '<p class="note">No <code>config.json</code> with this run.</p>'
    return f"<pre>{html.escape(yaml.safe_dump(run.config, sort_keys=False))}</pre>"


def _section(anchor: str, title: str, body: str, note: str = "") -> str:
    note_html = f'<p class="note">{note}</p>' if note else ""
    return f'<section id="{anchor}"><h2>{title}</h2>{note_html}{body}</section>'


def _chart(name: str, draw: Callable[[], str]) -> str:
    """The chart `draw()` returns as SVG; without matplotlib, a line saying so in its place."""
    if not charts_available():
        return (f'<p class="note" data-chart-missing="{name}">Chart left out: matplotlib is not installed here '
                f"(pip install matplotlib, then <code>vela report</code> on this run draws it).</p>")
    return f'<div class="chart" data-chart="{name}">{draw()}</div>'


def render_html(run: Run) -> str:
    """The whole page as one string (inline SVG and CSS, no external resources)."""
    comms = compare_comm(run)
    sections = [
        _section("overview", "Run at a glance", overview(run)),
        *([_section("data", "Data", data_table(run.summary.data), _data_note(run.summary.data))]
          if run.summary.data is not None else []),
        _section("placement", "Placement map", placement_table(run),
                 "Rows: MoE layers; columns: workers (ExpertManagers) with their link tier from the master. "
                 "A cell lists the experts the worker holds in that layer; the shade is the share of the layer's "
                 "routed rows it serves (from the access profile)."),
        _heatmap_section(run),
        _section("traffic", "Traffic by link tier",
                 _chart("traffic", lambda: traffic_chart(run.summary.history, _total(comms), [
                     m.step for m in run.summary.migrations if m.reason == "drift"])),
                 "Bytes the broker moved per training step (dispatch, gather and their gradients), by the "
                 "link tier between the master and the worker."),
        _section("comm", "Predicted vs measured communication",
                 _chart("comm", lambda: comm_chart(comms)) + comm_table(comms), html.escape(_comm_note(run))),
        *([_section("tiers", "Expert tiers (APTMoE)", tiers_table(run.summary), html.escape(_tiers_note(run)))]
          if run.summary.expert_tiers else []),
        _section("loss", "Loss", _chart("loss", lambda: loss_chart(run.summary.history))),
        *([_section("drift", "Routing drift", drift_table(run.summary.history),
                    "Per MoE layer: the total-variation distance of a step's routing from the profile the placement "
                    "was solved for (0: the same distribution, 1: disjoint). It moves when the router trains "
                    "(lora.modules_to_save); placement.replan re-solves when its mean passes drift_threshold.")]
          if any(r.routing_drift for r in run.summary.history) else []),
        *([samples_section(samples)] if (samples := SamplesRecord.read(run.dir)) is not None else []),
        *([_section("changes", "Placement changes and recoveries", changes_table(run.summary),
                    "Experts moved between live workers, re-solves on drifted routing, lost workers replaced.")]
          if run.summary.migrations or run.summary.replans or run.summary.recoveries or run.summary.resumes
          else []),
        _section("config", "Configuration", config_block(run)),
    ]
    name = "" if run.dir is None else run.dir.name or str(run.dir)
    title = f"vela-ray run {html.escape(name)}"
    return _PAGE.format(title=title, css=_CSS, body="".join(sections), script=_SCRIPT)


def _total(comms: list[WorkerComm]) -> float | None:
    """Predicted bytes per step over all workers (None without a prediction)."""
    predicted = [c.predicted_bytes for c in comms]
    return None if not predicted or None in predicted else float(sum(predicted))


def _heatmap_section(run: Run) -> str:
    if run.probs_LE is None:
        return _section("access", "Expert access heatmap",
                        '<p class="note">No access profile in this run (the placement was not solved for a '
                        "measured or given profile).</p>")
    problem = run.summary.placement.problem
    chart = _chart("heatmap", lambda: heatmap_chart(run.probs_LE, run.table_LE,
                                                    None if problem is None else problem.top_k))
    return _section("access", "Expert access heatmap", chart,
                    f"P[layer, expert]: the share of a layer's tokens routed to the expert (rows sum to top-k), "
                    f"from {html.escape(run.profile_source or '?')}; each cell names the expert's worker.")


def write_report(run_dir: str | Path, out: str | Path | None = None, summary: RunSummary | None = None) -> Path:
    """Write `run_dir/report.html` (or `out`) and return its path.

    The run is `summary` when given (a runner reports before writing summary.json, so that the
    summary can name the report), else the summary.json in `run_dir`.
    """
    run = load_run(run_dir if summary is None else summary, run_dir)
    path = Path(out) if out else Path(run_dir) / "report.html"
    path.write_text(render_html(run), encoding="utf-8")
    return path


def _comm_note(run: Run) -> str:
    """How the comparison was made, and why there is no prediction when there is none."""
    if run.summary.placement.problem is None:
        predicted = ("Predicted: none, this run solved no placement problem (the expert-parallel baseline, or a "
                     "resumed run that kept its placement).")
    else:
        predicted = ("Predicted: the cost model's bytes per step (placement.cost.worker_bytes: the routing mass of "
                     "each worker's experts under the profile the placement was solved for, x tokens per step x "
                     "bytes per row).")
    return (f"{predicted} Measured: the mean training bytes per step, split by each worker's share of all expert "
            "traffic of the run. Link ms/step = bytes / bandwidth (probed). Measured step time includes compute.")

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
.warning { color: #b00; font-weight: 600; max-width: 900px; }
table.data th { text-align: left; font-weight: normal; color: #555; }
table.samples { width: 100%; } table.samples td { text-align: left; vertical-align: top; width: 33%; }
table.samples pre { white-space: pre-wrap; margin: 0; padding: 4px; }
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
