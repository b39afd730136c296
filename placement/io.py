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
  P[l, e] = counts[l, e] * top_k / sum_e counts[l, e]. The JSON that
  `vela_ray.data.locality.AccessProfile.save` writes (`vela profile`, a run's
  profile.json) has "probs" and "top_k" (and counts, tokens), so it is read as such.
Every profile must be a 2-D matrix of finite probabilities in [0, 1]; any
mistake is one ValueError that starts with "profile <file>:" and says the fix.

Problem files (YAML or JSON) hold the `PlacementProblem` fields, with three
conveniences: `profile: path` (relative to the problem file) instead of
`probs`, `bandwidths_gb_s` (GB/s, 1 GB = 1e9 bytes) instead of `bandwidths`
(bytes/s), and a single integer `capacities` meaning the same for every
worker. `top_k` may be left out when the profile gives or implies it.
`shared_links` (NICs several workers share) is a list of mappings with
`name`, `bandwidth_bytes_per_s` and `workers` (worker indices), as
`PlacementProblem.model_dump` writes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

GB = 1e9
DEFAULT_TOKENS_PER_STEP = 4096
"""Tokens per step `vela place` assumes without --tokens: times and bytes scale with it, the placement does not."""
DEFAULT_HIDDEN_SIZE = 4096
"""Hidden size `vela place` assumes without --hidden (Mixtral 8x7B's), for the same reason."""
COUNTS_HINT = 'counts go in a JSON profile as {"counts": [[...]], "top_k": k}'


# --- routing profiles: the one reader -------------------------------------------------


def load_profile(path: str | Path) -> tuple[np.ndarray, int | None]:
    """Read a routing profile; return (probs [num_layers, num_experts], top_k or None).

    The one reader of profile files (`vela place`, problem files, the runtime's
    `placement.profile` and the report all use it), so every format is accepted
    everywhere and every mistake is one ValueError that names the file.
    """
    path = _existing(path, "profile")
    try:
        if path.suffix == ".npy":
            return as_probs_matrix(_read_npy(path)), None
        if path.suffix != ".json":
            raise ValueError(f"must be a .npy or .json file, got {path.suffix!r}")
        return _profile_from_json(read_json(path))
    except ValueError as err:
        raise ValueError(f"profile {path}: {err}") from None


def _profile_from_json(data: Any) -> tuple[np.ndarray, int | None]:
    """(probs, top_k) from a parsed JSON profile, in any of the formats of the module docstring."""
    if isinstance(data, list):
        return as_probs_matrix(data), None
    if isinstance(data, dict) and "probs" in data:  # also an `AccessProfile.save` file
        top_k = _top_k_field(data) if "top_k" in data else None
        return as_probs_matrix(data["probs"]), top_k
    if isinstance(data, dict) and "counts" in data and "top_k" in data:
        top_k = _top_k_field(data)
        return as_probs_matrix(probs_from_counts(data["counts"], top_k)), top_k
    got = f"keys {sorted(data)}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
    raise ValueError(
        'must be a [layers][experts] list, or an object with "probs", or with "counts" and "top_k"; '
        f"got {got}"
    )


def _top_k_field(data: dict[str, Any]) -> int:
    top_k = data["top_k"]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f'"top_k" must be a positive integer, got {top_k!r}')
    return top_k


def as_probs_matrix(value: Any) -> np.ndarray:
    """`value` as a float64 [num_layers, num_experts] matrix of probabilities, or a ValueError saying why not.

    The one check of a routing matrix: profile files and `PlacementProblem.probs` both use it.
    """
    probs = _numeric_matrix(value, "probs")
    bad = np.argwhere(~np.isfinite(probs) | (probs < 0) | (probs > 1))
    if len(bad):
        layer, expert = bad[0]
        value = float(probs[layer, expert])
        hint = f"; {COUNTS_HINT}" if value > 1 else ""
        raise ValueError(
            f"probs[{layer}, {expert}] = {value!r}: every probability must be a finite number in [0, 1] "
            f"(fix or re-profile that layer{hint})"
        )
    return probs


def _numeric_matrix(value: Any, name: str) -> np.ndarray:
    """`value` as a non-empty 2-D float64 [num_layers, num_experts] array; ValueError naming `name` otherwise."""
    if isinstance(value, list):
        lengths = [len(row) if isinstance(row, list) else None for row in value]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"{name} rows have different lengths ({_lengths(lengths)}): "
                "every layer needs one entry per expert"
            )
    try:
        matrix = np.array(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric [num_layers, num_experts] matrix; it holds non-numbers") from None
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 2-D [num_layers, num_experts] matrix (one row per MoE layer), "
            f"got shape {matrix.shape}"
        )
    return matrix


def _lengths(lengths: list[int | None]) -> str:
    shown = ", ".join("not a list" if n is None else str(n) for n in lengths[:8])
    return shown + (", ..." if len(lengths) > 8 else "")


def probs_from_counts(counts: Any, top_k: int) -> np.ndarray:
    """[L, E] probabilities from per-layer routing counts: counts * top_k / row sum.

    Each token is counted once per expert it uses, so a row sums to top_k * tokens;
    normalising per row keeps layers with different token counts comparable.
    """
    counts = _numeric_matrix(counts, "counts")
    if not np.all(np.isfinite(counts)) or counts.min() < 0:
        raise ValueError("counts must be finite numbers >= 0 (tokens routed to each expert)")
    row_sums = counts.sum(axis=1, keepdims=True)
    empty = np.flatnonzero(row_sums.ravel() == 0)
    if len(empty):
        raise ValueError(
            f"counts of layer {int(empty[0])} are all zero: need tokens in every layer"
        )
    return counts * top_k / row_sums


def infer_top_k(probs: np.ndarray, source: str | None = None) -> int:
    """top_k from the row sums of a profile (they must all be the same whole number).

    `source` (a file) is named in the error, so a user knows which profile to fix.
    """
    row_sums = np.asarray(probs, dtype=np.float64).sum(axis=1)
    top_k = int(round(float(row_sums.mean()))) if np.all(np.isfinite(row_sums)) else 0
    if top_k < 1 or not np.allclose(row_sums, top_k, rtol=1e-6, atol=0):
        where = f"profile {source}: " if source else ""
        raise ValueError(
            f"{where}cannot infer top_k: rows sum to {row_sums.min():.6g}..{row_sums.max():.6g}, "
            "not one whole number; give top_k (--top-k) and normalised rows"
        )
    return top_k


def _read_npy(path: Path) -> np.ndarray:
    """The array in a .npy file; a ValueError (not numpy's) when it is not one."""
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError):
        array = None
    if not isinstance(array, np.ndarray):
        raise ValueError(
            "not a readable .npy array: write the [num_layers, num_experts] matrix with numpy.save(path, probs)"
        )
    return array


def read_json(path: Path) -> Any:
    """Parsed JSON; a ValueError with the line and column when it is not JSON (callers prefix the file)."""
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError("not a UTF-8 text file, so not JSON") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"not valid JSON: {err.msg} at line {err.lineno}, column {err.colno} (fix it, or write it with json.dump)"
        ) from None


# --- numbers, problem files and command-line options ------------------------------------


def parse_numbers(text: str, what: str) -> list[float]:
    """Numbers from a comma list ("18.3,1.17") or a file (.json list, .npy, or text)."""
    path = Path(text)
    if path.is_file():
        try:
            return _numbers_in_file(path)
        except ValueError as err:
            raise ValueError(f"{what} file {path}: {err}") from None
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of numbers or a file, got {text!r}") from None


def _numbers_in_file(path: Path) -> list[float]:
    if path.suffix == ".npy":
        values = _read_npy(path).ravel()
    elif path.suffix == ".json":
        values = read_json(path)
    else:
        values = [item for item in path.read_text().replace("\n", ",").split(",") if item.strip()]
    try:
        return [float(value) for value in values]
    except (TypeError, ValueError):
        raise ValueError("must hold a flat list of numbers, one per worker") from None


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
    fields = _read_yaml(path) or {}
    if not isinstance(fields, dict):
        raise ValueError(f"problem file {path} must hold a mapping of PlacementProblem fields")
    profile = None
    if "profile" in fields:
        profile = path.parent / fields.pop("profile")
        probs, top_k = load_profile(profile)
        fields.setdefault("probs", probs)
        if top_k is not None:
            fields.setdefault("top_k", top_k)
    if "bandwidths_gb_s" in fields:
        fields["bandwidths"] = [GB * float(value) for value in fields.pop("bandwidths_gb_s")]
    if "top_k" not in fields and "probs" in fields:
        fields["top_k"] = infer_top_k(fields["probs"], source=str(profile or path))
    if isinstance(fields.get("capacities"), int):
        fields["capacities"] = [fields["capacities"]] * len(fields.get("bandwidths", []))
    return fields


def _read_yaml(path: Path) -> Any:
    """Parsed YAML (JSON is YAML); a ValueError naming the file and line when it does not parse."""
    try:
        return yaml.safe_load(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"problem file {path} is not a UTF-8 text file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "syntax error"
        raise ValueError(f"problem file {path} is not valid YAML: {problem}{where}") from None


def check_writable(path: str | Path, flag: str = "--out") -> Path:
    """`path` if a file can be written there; a ValueError naming `flag` and the fix otherwise.

    Called before solving, so that a mistyped output path costs no solver time
    and no solution is printed that then cannot be saved.
    """
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        reason = "is a directory; give a file name such as placement.json"
    elif parent.exists() and not parent.is_dir():
        reason = f"is inside {str(parent)!r}, which is a file, not a directory; choose another {flag}"
    elif not parent.is_dir():
        reason = f"is in a directory that does not exist ({str(parent)!r}); create it first or choose another {flag}"
    elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        reason = f"cannot be written (no write permission); choose another {flag}"
    elif (failure := _probe_write(parent)) is not None:  # what os.access cannot see: root, read-only mounts
        reason = f"cannot be written ({failure}); choose another {flag}"
    else:
        return path
    raise ValueError(f"{flag} {str(path)!r} {reason}")


def _probe_write(directory: Path) -> str | None:
    """Why a file cannot be created in `directory` (None if it can): one created and removed at once."""
    probe = directory / f".vela-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist or is not a file")
    return path
