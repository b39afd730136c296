"""One run per output dir, and a resume that continues the same run.

A run has an identity (`RunIdentity`): an id, and the part of its config that decides the math
(`MATH_FIELDS`: the model, the data, LoRA, the optimizer, the seed, lossy options). It is written
to `output.dir/run.json` when the run starts and into every checkpoint's `trainer.json`.

- A new run into an `output.dir` that holds another run is refused in one line naming both and
  the fixes (`--resume`, another `output.dir`, or `--overwrite`, which moves the old run aside to
  `<dir>.old-<id>`: nothing is deleted). `check_output_dir` is preflight's check, before Ray.
- A resume continues the checkpoint's run: its id, and the same math. A checkpoint whose math
  differs from the job's is refused naming the fields (`check_same_math`); raising
  `training.steps`, eval, logging and checkpoint cadence, and the cluster's shape stay free.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
# What a run leaves in output.dir: any of them (without run.json: a run of an older vela-ray) means a run is there.
RUN_ARTEFACTS = (RUN_FILE, "summary.json", "config.json", "adapter", "checkpoints", "workers.json")
MATH_FIELDS = (  # dotted paths into the config; a section name takes all of it
    "model.path", "model.dtype", "data", "lora", "training.batch_size", "training.seed",
    "training.eval_fraction", "training.method", "training.optimizer", "training.zo", "training.condensation",
    "data_plane.row_format",
)


class RunIdentity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    math: dict[str, Any]
    """`MATH_FIELDS` of its config, flattened to dotted names."""
    started: str
    """When the run first started (a resume keeps it)."""

    @classmethod
    def new(cls, config: dict[str, Any]) -> RunIdentity:
        """A new run of `config` (a `JobConfig.model_dump(mode="json")`)."""
        return cls(run_id=time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], math=math_of(config),
                   started=time.strftime("%Y-%m-%d %H:%M:%S"))

    def write(self, out_dir: Path) -> None:
        (out_dir / RUN_FILE).write_text(self.model_dump_json(indent=1))


def math_of(config: dict[str, Any]) -> dict[str, Any]:
    """The values of `config` (a `JobConfig.model_dump(mode="json")`: this module reads configs as data, below
    `vela_ray.config`) that decide a run's numbers, as {dotted field: value}."""
    flat: dict[str, Any] = {}
    for field in MATH_FIELDS:
        value: Any = config
        for part in field.split("."):
            value = value[part]
        flat.update(_flatten(field, value))
    for path in ("model.path", "data.path"):  # the same files however the job names them
        if flat.get(path):
            flat[path] = str(Path(flat[path]).expanduser().resolve())
    return flat


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flatten(f"{prefix}.{key}", sub).items()}
    return {prefix: value}


def check_same_math(saved: dict[str, Any], config: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to continue checkpoint `checkpoint` (of a run whose math was `saved`) with another config."""
    now = math_of(config)
    # a field the checkpoint does not name is newer than it: that run had the field's default behaviour
    differ = [f"{k}: checkpoint {saved.get(k)!r} vs this job {now.get(k)!r}" for k in sorted(saved)
              if saved.get(k) != now.get(k)]
    if differ:
        raise ValueError(f"checkpoint.resume (--resume) {checkpoint} is of a run with other settings ("
                         f"{'; '.join(differ)}); a resume continues the same run: set them back, or start a new "
                         "run in another output.dir (raising training.steps is allowed)")


def read_identity(out_dir: Path) -> RunIdentity | None:
    path = out_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        return RunIdentity.model_validate_json(path.read_text())
    except ValueError:
        return None


def holds_a_run(out_dir: Path) -> bool:
    return out_dir.is_dir() and any((out_dir / name).exists() for name in RUN_ARTEFACTS)


def check_output_dir(out: Path, overwrite: bool, resuming: bool, resumed_run: str | None = None) -> None:
    """`output.dir` `out` is free for this run: empty, or `overwrite`, or it is the run being resumed (run
    `resumed_run`; None: a checkpoint from before runs had ids, which cannot be told apart)."""
    if overwrite or not holds_a_run(out):
        return
    there = read_identity(out)
    which = other_run(there, resuming, resumed_run)
    if which is None:
        return
    raise ValueError(f"output.dir {out} holds {which}; this job would mix with it: resume it with "
                     f"`--resume latest`, choose another output.dir, or pass --overwrite (output.overwrite) to "
                     f"move it aside to {aside_path(out, there)}")


def other_run(there: RunIdentity | None, resuming: bool, resumed_run: str | None) -> str | None:
    """What an output dir that holds a run's files holds, when that is not the run being resumed (`there`: its
    `run.json`, if any); None when this job may go on there."""
    if resuming and (there is None or resumed_run is None or there.run_id == resumed_run):
        return None
    return f"run {there.run_id} (started {there.started})" if there else "the output of an earlier run"


def aside_path(out_dir: Path, there: RunIdentity | None) -> Path:
    tag = there.run_id if there else time.strftime("%Y%m%d-%H%M%S")
    return out_dir.with_name(f"{out_dir.name}.old-{tag}")


def move_aside(out_dir: Path) -> Path | None:
    """With `output.overwrite`: the run in `out_dir` renamed to `<dir>.old-<id>` (nothing deleted)."""
    if not holds_a_run(out_dir):
        return None
    target = aside_path(out_dir, read_identity(out_dir))
    os.rename(out_dir, target)
    logger.warning("output.overwrite: moved the earlier run in %s aside to %s", out_dir, target)
    return target
