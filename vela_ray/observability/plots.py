"""Pictures of expert locality (matplotlib, Agg backend; every `plot_*` function writes one PNG).

* `access_heatmap_figure`: MoE layers x experts access probability, one panel per
  data set (the VELA paper's Fig. 3a and Fig. 7); the one heatmap drawing, used by
  `plot_access_heatmaps` (PNG) and by the run report (inline SVG).
* `plot_confidence_cdf`: CDF of the router confidence of one MoE layer, one curve
  per profile (Fig. 3b).
* `plot_layer_drift`: access frequency of one layer's experts over fine-tuning
  steps (Fig. 3c).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

if TYPE_CHECKING:  # a type only: the report imports this module, and it must not pay for torch
    from vela_ray.data.locality import AccessProfile


def _save(fig: plt.Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def access_heatmap_figure(probs_by_name: dict[str, np.ndarray], top_k: int | None = None,
                          owners_LE: np.ndarray | None = None) -> plt.Figure:
    """One heatmap per named P [L, E] (layers down, experts across), on a shared colour scale from 0.

    Cells show the fraction of a layer's tokens that visit the expert (P, rows sum to
    `top_k`), labelled with the value, or with the expert's worker (`w2`) when
    `owners_LE` [L, E] is given; labels and ticks only while cells are large enough
    to read. With `top_k`, a dashed line in the colour bar marks uniform routing, top_k / E.
    """
    if not probs_by_name:
        raise ValueError("nothing to plot: probs_by_name is empty")
    panels = [(name, np.asarray(probs, dtype=np.float64)) for name, probs in probs_by_name.items()]
    num_layers, num_experts = panels[0][1].shape
    width = min(12.0, max(3.0, 0.45 * num_experts + 1.2))
    height = min(14.0, max(2.2, 0.45 * num_layers + 1.6))
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels) + 1.0, height), squeeze=False,
                             constrained_layout=True)
    vmax = max(float(p.max()) for _, p in panels) or 1.0
    readable = num_experts <= 32 and num_layers <= 64
    for ax, (name, probs) in zip(axes[0], panels):
        image = ax.imshow(probs, cmap="Blues", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("expert")
        if readable:
            ax.set_xticks(range(num_experts))
            ax.set_yticks(range(num_layers))
            _label_cells(ax, probs, owners_LE, vmax)
    axes[0][0].set_ylabel("MoE layer")
    bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9)
    bar.set_label("access probability P")
    if top_k is not None:
        bar.ax.axhline(top_k / num_experts, color="red", linestyle="--", linewidth=1)
    return fig


def _label_cells(ax: plt.Axes, probs_LE: np.ndarray, owners_LE: np.ndarray | None, vmax: float) -> None:
    for (layer, expert), value in np.ndenumerate(probs_LE):
        text = f"{value:.2f}" if owners_LE is None else f"w{owners_LE[layer, expert]}"
        ax.text(expert, layer, text, ha="center", va="center", fontsize=6 if owners_LE is None else 7,
                color="white" if value > 0.6 * vmax else "black")


def plot_access_heatmaps(probs_by_name: dict[str, np.ndarray], path: Path, top_k: int) -> Path:
    """`access_heatmap_figure` of each named P [L, E], as a PNG at `path`."""
    return _save(access_heatmap_figure(probs_by_name, top_k=top_k), path)


def plot_confidence_cdf(profiles: dict[str, AccessProfile], layer: int, path: Path) -> Path:
    """CDF of the router confidence (share of routing score on the selected experts) of one MoE layer."""
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    for name, profile in profiles.items():
        edges, cdf = profile.confidence_cdf(layer)
        ax.plot(edges, cdf, label=f"{name} (mean {profile.confidence_mean[layer]:.2f})")
    some = next(iter(profiles.values()))
    ax.axvline(some.top_k / some.num_experts, color="grey", linestyle=":", label="uniform routing")
    ax.set_xlabel(f"router confidence, MoE layer {layer} ({some.scoring} scores)")
    ax.set_ylabel("fraction of tokens ≤ x")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_layer_drift(probs_by_step: np.ndarray, layer: int, path: Path, initial_probs: np.ndarray | None = None,
                     title: str = "") -> Path:
    """Access frequency of each expert of `layer` over fine-tuning steps.

    `probs_by_step`: [steps, L, E] (e.g. `DriftTracker.probs(window)`); `initial_probs`
    [L, E], if given, is drawn as dotted lines in the same colours.
    """
    steps = np.arange(probs_by_step.shape[0])
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    colours = plt.get_cmap("tab10")
    for expert in range(probs_by_step.shape[2]):
        colour = colours(expert % 10)
        ax.plot(steps, probs_by_step[:, layer, expert], color=colour, linewidth=1.2, label=f"expert {expert}")
        if initial_probs is not None:
            ax.axhline(initial_probs[layer, expert], color=colour, linestyle=":", linewidth=1)
    ax.set_xlabel("fine-tuning step (end of window)")
    ax.set_ylabel(f"access frequency, MoE layer {layer}")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)
