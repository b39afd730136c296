"""Reading placement inputs: routing profiles, bandwidth and capacity lists, problem files.

    probs, top_k = load_profile("profile.npy")        # or .json
    fields = read_problem_fields("problem.yaml")      # or .json; then PlacementProblem(**fields)

It turns files and command-line strings into `PlacementProblem` fields and
knows nothing of the problem class itself (`PlacementProblem.from_file` and
`build_problem` in `placement.problem` use it).

Profiles:
- `.npy`: a [num_layers, num_experts] matrix of probabilities (rows sum to top_k).
- `.json`: a plain [L][E] list of probabilities; or {"probs": [[...]], "top_k": k};
  or {"counts": [[...]], "top_k": k} with per-layer token counts per expert
  (each token counted once per expert it uses), normalised to
  P[l, e] = counts[l, e] * top_k / sum_e counts[l, e].

Problem files (YAML or JSON) hold the `PlacementProblem` fields, with three
conveniences: `profile: path` (relative to the problem file) instead of
`probs`, `bandwidths_gb_s` (GB/s, 1 GB = 1e9 bytes) instead of `bandwidths`
(bytes/s), and a single integer `capacities` meaning the same for every
worker. `top_k` may be left out when the profile gives or implies it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

GB = 1e9


def load_profile(path: str | Path) -> tuple[np.ndarray, int | None]:
    """Read a routing profile; return (probs [num_layers, num_experts], top_k or None)."""
    path = _existing(path, "profile")
    if path.suffix == ".npy":
        return np.load(path), None
    if path.suffix != ".json":
        raise ValueError(f"profile {path} must be a .npy or .json file, got {path.suffix!r}")
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return np.asarray(data, dtype=np.float64), None
    if "probs" in data:
        return np.asarray(data["probs"], dtype=np.float64), data.get("top_k")
    if "counts" in data and "top_k" in data:
        return probs_from_counts(np.asarray(data["counts"], dtype=np.float64), data["top_k"]), data["top_k"]
    raise ValueError(
        f"profile {path} must be a [layers][experts] list, or an object with \"probs\", "
        f"or with \"counts\" and \"top_k\"; got keys {sorted(data)}"
    )


def probs_from_counts(counts: np.ndarray, top_k: int) -> np.ndarray:
    """[L, E] probabilities from per-layer routing counts: counts * top_k / row sum."""
    row_sums = counts.sum(axis=1, keepdims=True)
    if counts.ndim != 2 or np.any(row_sums <= 0):
        raise ValueError("counts must be a [num_layers, num_experts] matrix with tokens in every layer")
    return counts * top_k / row_sums


def infer_top_k(probs: np.ndarray) -> int:
    """top_k from the row sums of a profile (they must all be the same whole number)."""
    row_sums = np.asarray(probs, dtype=np.float64).sum(axis=1)
    top_k = int(round(float(row_sums.mean())))
    if top_k < 1 or not np.allclose(row_sums, top_k, rtol=1e-6, atol=0):
        raise ValueError(
            f"cannot infer top_k: profile rows sum to {row_sums.min():.6g}..{row_sums.max():.6g}, "
            "not one whole number; give top_k (--top-k) and normalised rows"
        )
    return top_k


def parse_numbers(text: str, what: str) -> list[float]:
    """Numbers from a comma list ("18.3,1.17") or a file (.json list, .npy, or text)."""
    if Path(text).is_file():
        path = Path(text)
        if path.suffix == ".npy":
            return [float(v) for v in np.load(path).ravel()]
        if path.suffix == ".json":
            return [float(v) for v in json.loads(path.read_text())]
        text = path.read_text().replace("\n", ",")
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of numbers or a file, got {text!r}")


def parse_capacities(text: str, num_workers: int) -> list[int]:
    """Capacities from one integer (every worker) or a comma list / file of integers."""
    values = parse_numbers(text, "capacities")
    if any(value != int(value) for value in values):
        raise ValueError(f"capacities must be whole numbers of experts, got {text!r}")
    capacities = [int(value) for value in values]
    return capacities * num_workers if len(capacities) == 1 else capacities


def read_problem_fields(path: str | Path) -> dict[str, Any]:
    """`PlacementProblem` fields from a YAML or JSON file (see the module docstring)."""
    path = _existing(path, "problem file")
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"problem file {path} must be .yaml, .yml or .json, got {path.suffix!r}")
    fields: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    if not isinstance(fields, dict):
        raise ValueError(f"problem file {path} must hold a mapping of PlacementProblem fields")
    if "profile" in fields:
        probs, top_k = load_profile(path.parent / fields.pop("profile"))
        fields.setdefault("probs", probs)
        if top_k is not None:
            fields.setdefault("top_k", top_k)
    if "bandwidths_gb_s" in fields:
        fields["bandwidths"] = [GB * float(value) for value in fields.pop("bandwidths_gb_s")]
    if "top_k" not in fields and "probs" in fields:
        fields["top_k"] = infer_top_k(fields["probs"])
    if isinstance(fields.get("capacities"), int):
        fields["capacities"] = [fields["capacities"]] * len(fields.get("bandwidths", []))
    return fields


def fields_from_options(
    *,
    profile: str,
    bandwidths_gb_s: str,
    capacities: str,
    tokens_per_step: int | None,
    hidden_size: int | None,
    bits_per_element: int = 16,
    top_k: int | None = None,
    nodes: str | None = None,
    master_node: str | None = None,
    include_backward: bool = True,
) -> dict[str, Any]:
    """`PlacementProblem` fields from command-line style inputs (`vela place --profile ...`).

    bandwidths_gb_s: comma list or file, GB/s per worker; capacities: one integer
    or a comma list; nodes: comma list of node ids, one per worker.
    """
    for flag, value in (("--tokens", tokens_per_step), ("--hidden", hidden_size)):
        if value is None:
            raise ValueError(f"{flag} is required with --profile (or describe everything in --problem)")
    probs, profile_top_k = load_profile(profile)
    bandwidths = [GB * value for value in parse_numbers(bandwidths_gb_s, "bandwidths")]
    return dict(
        probs=probs,
        top_k=top_k or profile_top_k or infer_top_k(probs),
        tokens_per_step=tokens_per_step,
        hidden_size=hidden_size,
        bits_per_element=bits_per_element,
        bandwidths=bandwidths,
        capacities=parse_capacities(capacities, len(bandwidths)),
        worker_nodes=[node.strip() for node in nodes.split(",")] if nodes else None,
        master_node=master_node,
        include_backward=include_backward,
    )


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist or is not a file")
    return path
