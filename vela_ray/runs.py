"""One run per output dir, and a resume that continues the same run.

A run has an identity (`RunIdentity`): an id, and the part of its config that decides the math
(`MATH_FIELDS`: the model, the data, LoRA, the optimizer, the seed, lossy options). It is written
to `output.dir/run.json` when the run starts and into every checkpoint's `trainer.json`.

- A new run into an `output.dir` that holds another run is refused in one line naming both and
  the fixes (`--resume`, another `output.dir`, or `--overwrite`, which moves the old run aside to
  `<dir>.old-<id>`: nothing is deleted). `check_output_dir` is preflight's check, before Ray.
- Two runs at once into one `output.dir` cannot both pass that check: the process that drives a run holds
  the dir (`hold_output_dir`, an OS lock that dies with its holder) from before its first write to its
  last, and checks the dir again under it; a second run meanwhile is refused in one line naming the holder.
- A resume continues the checkpoint's run: its id, and the same math. A checkpoint whose math
  differs from the job's is refused naming the fields (`check_same_math`); raising
  `training.steps`, eval, logging and checkpoint cadence, and the cluster's shape stay free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

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


# --- one run at a time -----------------------------------------------------------------------

LOCK_SUFFIX = ".vela-lock"


def lock_path(out_dir: Path) -> Path:
    """The lock file of output dir `out_dir`: beside it, not in it, so that `--overwrite`'s move-aside (a rename
    of the dir) leaves it where the next run looks; named by the resolved path, so two spellings of one dir
    share it."""
    out = Path(out_dir).resolve()
    return out.with_name(f".{out.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def hold_output_dir(out_dir: Path, named: str | Path | None = None) -> Iterator[None]:
    """Hold output dir `out_dir` for this process while the block runs: one run per dir under concurrency too.

    While another process holds it (a run in progress on this machine), this refuses at once in one line
    naming the dir (`named`: as the job names it, e.g. the URI whose local mirror `out_dir` is), the holder's
    pid and the fixes. The lock is `flock` on `lock_path(out_dir)`: the OS drops it when its holder dies, even
    by SIGKILL, so there is never a stale lock to clear. When the block ends the file is deleted (while still
    held: see `_acquire`), and the directories made for it with it, when empty. Not re-entrant: hold it once,
    in the process that drives the run (`VelaJob.run`, an in-process `JobRunner`) and around preflight.
    """
    lock = lock_path(out_dir)
    made = [d for d in (lock.parent, *lock.parent.parents) if not d.exists()]  # deepest first
    fd = _acquire(lock, named or out_dir)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
        for directory in made:
            with contextlib.suppress(OSError):  # not empty: a run or another lock is there
                directory.rmdir()


def _acquire(lock: Path, named: str | Path) -> int:
    """An open descriptor of `lock`, flocked. A holder deletes the file before it lets go, so a lock taken on
    a file no longer at `lock` is one that holder dropped: taken again on the file there now."""
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # its directory, made by a holder, removed as that holder let go
            continue
        except OSError as err:
            raise ValueError(f"output.dir {named} cannot be created or written (its lock file {lock}: "
                             f"{err.strerror or err}); choose a writable directory for output.dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ValueError(f"output.dir {named} is in use by another run ({holder}); one run per dir: wait for "
                             "that run to end or stop it, or choose another output.dir") from None
        if _is_at(fd, lock):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
            return fd
        os.close(fd)


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the file at `path` now."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock file `fd`, as its holder wrote it (not yet, if it has only just taken it)."""
    try:
        held = json.loads(os.pread(fd, 4096, 0))
        return f"pid {held['pid']} on {held['host']}, since {held['since']}"
    except (ValueError, KeyError, TypeError):
        return "pid unknown: it has only just started"
