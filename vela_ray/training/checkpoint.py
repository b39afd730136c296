"""Checkpoints that survive crashes and reload under any placement.

Layout of one checkpoint (`<root>/step-000120/`):

    manifest.json              written last: step, files with sizes and sha256, expert index, meta
    trainer.json               step, data position, total steps, next lr, placement, config
    backbone.safetensors       backbone LoRA (peft parameter names), its AdamW state ("<name>.exp_avg",
                               ".exp_avg_sq", ".step") and the torch RNG state ("rng.torch"; and
                               "rng.cuda.<i>" per CUDA device when the master used CUDA, absent
                               otherwise and in older checkpoints)
    experts/part-<n>.safetensors   written by ExpertManager n, tensors named by *logical* expert:
                               "l{layer}.e{expert}.{lora_A_gate_up|...}" and ".exp_avg"/".exp_avg_sq"
                               (fp32 in a bf16 model, as they train; older bf16 parts load upcast)

Atomicity: everything goes into `<root>/.step-000120.tmp-<uuid>/`, files are
fsynced, the manifest (with checksums) is written and fsynced last, then the
directory is renamed into place and the parent fsynced. A directory without a
valid manifest is never "the latest checkpoint", and `resolve("latest")` falls
back past corrupt ones to the newest that passes its checksums, setting each one it
skips aside (`set_aside`: renamed `step-000120.corrupt-<id>`, kept, never resumed from
nor counted toward `checkpoint.keep`: a corrupt file of unchanged size passes the size
check `prune` makes, and would otherwise be kept in place of a valid older one). Staging
directories a crash left behind are deleted by the next `prune`. Workers write
their own parts in parallel into the staging directory; the master never holds
expert state.

On object storage (a checkpoint root such as `s3://bucket/run/checkpoints`, `vela_ray.storage`) there is no
rename: every process writes its files straight into `<root>/step-000120/` (a worker uploads its own part
with its sha256 beside it, from its own node), and the manifest, written last, is what publishes the
checkpoint. A directory without a manifest is a checkpoint in progress or a crash's leftover: never
"latest", deleted by the next `prune`. Reading one (`local_copy`) downloads it into a local cache and
verifies it there like a local checkpoint.

Asynchronous (`checkpoint.asynchronous`): between two steps the master and each worker
only copy their state to host memory; a `Background` thread writes the copy while
training goes on, and the master publishes (manifest, rename, prune) once its files and
every worker's part are written. The staging directory, manifest and rename are the same,
so a crash mid-write still leaves only a staging directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Callable, Generic, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vela_ray import storage
from vela_ray.model.experts import ExpertKey
from vela_ray.storage import Remote, is_remote, sha256_of

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STEPPER_FILE = "stepper.json"
"""In a run's output dir: its steps' own state at the end (`runtime.features.Stepper.state`: ZO's trajectory), as
each checkpoint keeps it in `trainer.json`'s "stepper"; full-parameter ZO's merged export replays it."""
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_STAGING_DIR = re.compile(r"^\.step-\d{6,}\.tmp-[0-9a-f]+$")
T = TypeVar("T")


# --- writing ------------------------------------------------------------------------------


def begin(root: str | Path, step: int) -> Path:
    """A fresh staging directory for the checkpoint of `step`: this process's files go there (and, on a local
    root, the workers' parts: `parts_dir`). On object storage it is a local directory, uploaded by `finalize`,
    and whatever an earlier attempt left of `<root>/step-N` is deleted first (its manifest before the rest)."""
    if is_remote(root):
        from vela_ray.paths import cache_dir

        target = Remote(str(root)).child(_step_name(step))
        if target.exists(MANIFEST):
            target.delete(MANIFEST)  # no longer a checkpoint before anything of it changes
        target.delete_tree()
        staging = cache_dir() / "staging" / f".{_step_name(step)}.tmp-{uuid.uuid4().hex[:8]}"
        (staging / "experts").mkdir(parents=True)
        return staging
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".step-{step:06d}.tmp-{uuid.uuid4().hex[:8]}"
    (staging / "experts").mkdir(parents=True)
    return staging


def parts_dir(root: str | Path, staging: Path, step: int) -> str:
    """Where the workers write their parts of the checkpoint `begin` staged: the staging directory itself on
    a local root, the checkpoint's own directory on object storage (uploaded from each worker's node)."""
    return storage.join(str(root), _step_name(step)) if is_remote(root) else str(staging)


def _step_name(step: int) -> str:
    return f"step-{step:06d}"


def write_part(parts: str, worker: int, tensors: dict[str, torch.Tensor]) -> str:
    """Worker `worker`'s part into `parts` (`parts_dir`): a local file, or an upload with its sha256 beside it
    (the manifest's writer cannot hash a file it never reads). Returns where it went."""
    name = f"experts/part-{worker}.safetensors"
    if not is_remote(parts):
        path = Path(parts) / name
        write_tensors(path, tensors)
        return str(path)
    from vela_ray.paths import cache_dir

    local = cache_dir() / "staging" / f"part-{worker}-{uuid.uuid4().hex[:8]}.safetensors"
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_tensors(local, tensors)
        Remote(parts).upload(local, name, with_checksum=True)
    finally:
        local.unlink(missing_ok=True)
    return storage.join(parts, name)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """safetensors file, fsynced."""
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    _fsync(path)


RNG_TORCH = "rng.torch"
RNG_CUDA_PREFIX = "rng.cuda."


def rng_state() -> dict[str, torch.Tensor]:
    """The process's torch RNG states as checkpoint tensors: the CPU's, and each CUDA device's.

    CUDA states are saved only once this process has used CUDA: dropout on a GPU draws from them, so a
    resumed run would otherwise draw other masks; a CPU-only process writes nothing new (and creates no
    CUDA context just to ask).
    """
    tensors = {RNG_TORCH: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{RNG_CUDA_PREFIX}{index}"] = state
    return tensors


def restore_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `rng_state`; each state it lacks (an older checkpoint, a CPU-only writer) stays as is.

    CUDA states for devices this process does not see are skipped with a warning: a resume on fewer
    GPUs still runs, only its random draws there differ from the original run's.
    """
    if RNG_TORCH in tensors:
        torch.set_rng_state(tensors[RNG_TORCH])
    cuda = {int(k[len(RNG_CUDA_PREFIX):]): v for k, v in tensors.items() if k.startswith(RNG_CUDA_PREFIX)}
    if not cuda:
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skipped = sorted(i for i in cuda if i >= visible)
    if skipped:
        logger.warning("checkpoint has CUDA RNG states for devices %s this process does not see (%d visible); "
                       "their random draws will differ from the original run's", skipped, visible)
    for index, state in sorted(cuda.items()):
        if index < visible:
            torch.cuda.set_rng_state(state, index)


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=1))
    _fsync(path)


def expert_part_tensors(states: dict[ExpertKey, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One worker's part: each expert's LoRA and AdamW tensors (`ExpertManager.expert_states`), named by
    logical expert (see the module docstring)."""
    return {f"l{layer}.e{expert}.{name}": value
            for (layer, expert), state in states.items() for name, value in state.items()}


def finalize(staging: Path, step: int, meta: dict, keep: int | None = None, root: str | Path | None = None
             ) -> Path | str:
    """Checksum every file, write the manifest last, rename into place; prune to the last `keep`. On object
    storage (`root` a URI) upload the staged files beside the workers' parts, then the manifest; returns
    the checkpoint's URI."""
    if root is not None and is_remote(root):
        return _finalize_remote(staging, str(root), step, meta, keep)
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    entries = {str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files}
    write_json(staging / MANIFEST, {"step": step, "files": entries, "experts": _expert_index(staging),
                                    "meta": meta})
    _fsync_dir(staging)
    final = staging.parent / f"step-{step:06d}"
    if final.exists():  # a checkpoint of this step already exists (e.g. a resumed run): replace it
        _delete(final)
    os.rename(staging, final)
    _fsync_dir(staging.parent)
    if keep:
        prune(staging.parent, keep, run_id=meta.get("run_id"))
    return final


def _finalize_remote(staging: Path, root: str, step: int, meta: dict, keep: int | None) -> str:
    target = Remote(root).child(_step_name(step))
    entries = {}
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        rel = path.relative_to(staging).as_posix()
        entries[rel] = {"bytes": path.stat().st_size, "sha256": target.upload(path, rel)}
    for rel, size in target.files().items():  # the workers' parts, each with its sha256 beside it
        if rel not in entries and rel != MANIFEST and not rel.endswith(storage.SHA256_SUFFIX):
            entries[rel] = {"bytes": size, "sha256": target.read_bytes(rel + storage.SHA256_SUFFIX).decode()}
    experts = {f"{name.split('.')[0][1:]}.{name.split('.')[1][1:]}": rel for rel in sorted(entries)
               if rel.startswith("experts/") for name in _remote_tensor_names(target, rel)}
    manifest = {"step": step, "files": dict(sorted(entries.items())), "experts": experts, "meta": meta}
    target.write_bytes(MANIFEST, json.dumps(manifest, indent=1).encode())
    shutil.rmtree(staging, ignore_errors=True)
    if keep:
        prune(root, keep, run_id=meta.get("run_id"))
    return target.uri


def _remote_tensor_names(target: Remote, rel: str) -> list[str]:
    """Tensor names of a safetensors file on storage, from its header alone (8-byte length, then JSON)."""
    length = int.from_bytes(target.read_range(rel, 0, 8), "little")
    header = json.loads(target.read_range(rel, 8, length))
    return [name for name in header if name != "__metadata__"]


def prune(root: str | Path, keep: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the newest `keep` valid checkpoints (of run `run_id` only, when given: another run's
    checkpoints in the same root are never touched), and the staging directories crashes left.

    `finalize` calls it right after publishing, when no other staging directory of this
    run can be in progress: any left is from a writer that died (SIGKILL mid-write) and
    would otherwise stay forever.
    """
    ours = [p for p in valid_checkpoints(root)
            if run_id is None or verify(p, checksums=False).get("meta", {}).get("run_id") == run_id]
    if is_remote(root):  # a step directory without a manifest is a crash's leftover (none is in progress now)
        unfinished = [p for p in step_dirs(root) if not Remote(str(p)).exists(MANIFEST)]
        for old in unfinished + ours[:-keep]:
            remote = Remote(str(old))
            if remote.exists(MANIFEST):
                remote.delete(MANIFEST)  # no longer a checkpoint before its files go
            remote.delete_tree()
        return unfinished + ours[:-keep]
    removed = staging_dirs(root) + ours[:-keep]
    for old in removed:
        _delete(old)
    return removed


def _delete(path: Path) -> None:
    """Delete a checkpoint or staging directory. A checkpoint is first renamed to a staging name, so
    that a crash mid-delete leaves a staging directory (the next prune's), never a torn checkpoint."""
    if _STEP_DIR.match(path.name):
        trash = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:  # deleted already (as rmtree's ignore_errors below tolerates)
            return
        path = trash
    shutil.rmtree(path, ignore_errors=True)


def staging_dirs(root: str | Path) -> list[Path]:
    """`.step-*.tmp-*` directories under `root`: checkpoints being written, or left by a crash."""
    if is_remote(root):
        return []  # on storage those are step directories without a manifest
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STAGING_DIR.match(p.name) and p.is_dir())


def _expert_index(staging: Path) -> dict[str, str]:
    """{"layer.expert": part file} so a reader finds any logical expert without scanning."""
    index = {}
    for part in sorted((staging / "experts").glob("*.safetensors")):
        with safe_open(str(part), "pt") as f:
            for name in f.keys():
                layer, expert = name.split(".")[:2]
                index[f"{layer[1:]}.{expert[1:]}"] = str(part.relative_to(staging))
    return index


class Background(Generic[T]):
    """`work()` on a daemon thread: the writing of an asynchronous checkpoint (the master's files and
    publication, or one worker's part), from a snapshot the training thread no longer touches.

        write = Background(lambda: write_tensors(path, copied), name="vela-checkpoint")
        write.join(0.0)     # False while it runs
        write.result()      # waits; its return value, or its exception re-raised
    """

    def __init__(self, work: Callable[[], T], name: str):
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as err:  # re-raised on the waiting thread by `result`
            self._error = err

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` (None: until it ends); True once it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


# --- reading ------------------------------------------------------------------------------


def step_dirs(root: str | Path) -> list[Path]:
    """`step-*` directories under `root`, valid or not, oldest first (URIs on object storage)."""
    if is_remote(root):
        names = [name for name in Remote(str(root)).dirs() if _STEP_DIR.match(name)]
        return [storage.join(str(root), name) for name in sorted(names, key=lambda n: int(n[5:]))]
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def valid_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoints under `root` whose manifest exists and whose files have the recorded sizes, oldest first."""
    found = []
    for path in step_dirs(root):
        try:
            verify(path, checksums=False)
            found.append(path)
        except ValueError as err:
            logger.warning("skipping invalid checkpoint %s: %s", path, err)
    return found


def latest(root: str | Path) -> Path | None:
    checkpoints = valid_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def resolve(spec: str | Path, root: str | Path) -> Path:
    """The checkpoint `checkpoint.resume` names, fully verified (sizes and sha256).

    `latest`: the newest checkpoint under `root` that verifies; corrupt newer ones are
    skipped with a warning naming them, and set aside (`set_aside`) where local, so a
    crash that damaged the last checkpoint costs one interval, not the run, nor later
    the valid checkpoint before it (pruned as older than the corrupt one). A path: that
    checkpoint, or an error saying whether it does not exist, is a checkpoint root, or
    is damaged.
    """
    if str(spec) == "latest":
        return local_copy(_newest_verified(root))
    if is_remote(spec):
        try:
            return local_copy(str(spec))
        except ValueError as err:
            raise ValueError(f"checkpoint.resume (--resume) {err}; resume from another checkpoint, "
                             "e.g. `latest`") from None
    path = Path(spec)
    if not path.exists():
        newest = step_dirs(root)
        hint = f"the newest under {root} is {newest[-1]}" if newest else f"{root} holds no checkpoint"
        raise ValueError(f"checkpoint.resume (--resume) {path} does not exist ({hint}); give a checkpoint "
                         "directory or `latest`")
    if not (path / MANIFEST).exists() and step_dirs(path):
        raise ValueError(f"checkpoint.resume (--resume) {path} is a checkpoint root, not a checkpoint; give one "
                         f"of its step-* directories, e.g. {step_dirs(path)[-1]}, or `latest`")
    try:
        verify(path)
    except ValueError as err:
        raise ValueError(f"checkpoint.resume (--resume) {err}; resume from another checkpoint, "
                         "e.g. `latest`") from None
    return path


def _newest_verified(root: str | Path) -> Path | str:
    """The newest checkpoint under `root` that passes `verify`, warning once about each newer one skipped: a
    local one is set aside once a valid one is found, so no later call meets it again (where none is valid the
    refusal changes nothing)."""
    corrupt: list[tuple[Path | str, str]] = []
    for path in reversed(step_dirs(root)):
        try:
            verify(path)
        except ValueError as err:
            corrupt.append((path, str(err)))
            continue
        for bad, err in corrupt:
            aside = set_aside(bad) if not is_remote(bad) else None
            where = f": moved aside to {aside.name}, never to be resumed from nor kept in place of a valid one" \
                if aside else ""
            logger.warning("skipping corrupt checkpoint %s (%s)%s", bad, err, where)
        if corrupt:
            logger.warning("resuming from %s, the newest valid checkpoint (skipped corrupt %s)",
                           path, ", ".join(storage.name_of(bad) for bad, _ in corrupt))
        return path
    skipped = [storage.name_of(bad) for bad, _ in corrupt]
    corrupt_text = f" ({len(skipped)} corrupt: {', '.join(skipped)})" if skipped else ""
    raise ValueError(f"checkpoint.resume (--resume) latest: no valid checkpoint under {root}{corrupt_text}; "
                     "start without --resume")


def set_aside(path: Path) -> Path | None:
    """Local checkpoint `path`, which failed verification, renamed to `<step dir>.corrupt-<id>`: no longer a
    step directory, so never resumed from nor counted toward `checkpoint.keep`, nor deleted by `prune` (kept for
    a look). None when it is gone already (another process set it aside first) or cannot be renamed."""
    target = path.with_name(f"{path.name}.corrupt-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    except OSError as err:  # a root this user may only read (another run's checkpoints): skipped, left there
        logger.warning("cannot set corrupt checkpoint %s aside (%s)", path, err.strerror or err)
        return None
    _fsync_dir(path.parent)
    return target


def verify(path: str | Path, checksums: bool = True) -> dict:
    """The manifest, after checking every file's size (and sha256); ValueError saying what is wrong. On object
    storage the sha256s are checked on the local copy (`local_copy`), the sizes where the files are."""
    if is_remote(path):
        if checksums:
            return verify(local_copy(str(path)), checksums=False)  # local_copy checked the checksums
        return _verify_sizes_remote(Remote(str(path)))
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"{path}: no {MANIFEST}; the checkpoint was never finished (crash while writing?)")
    manifest = _parsed_manifest(manifest_file.read_bytes(), path)
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"{path}: file {name} listed in the manifest is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"{path}: {name} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        if checksums and sha256_of(file) != entry["sha256"]:
            raise ValueError(f"{path}: {name} fails its sha256 checksum (corrupted)")
    return manifest


SOURCE_FILE = ".vela-source"  # in a local copy of a checkpoint on storage: the URI it was copied from


def _parsed_manifest(raw: bytes, where: str | Path) -> dict:
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: {MANIFEST} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or "step" not in manifest or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{where}: {MANIFEST} lacks 'step' or 'files' (not written by vela-ray?)")
    return manifest


def _remote_manifest(remote: Remote) -> tuple[dict, bytes]:
    """The manifest of the checkpoint on storage `remote`, and its bytes (a local copy is current while they
    are equal)."""
    try:
        raw = remote.read_bytes(MANIFEST)
    except OSError:  # FileNotFoundError included
        raise ValueError(f"{remote.uri}: no {MANIFEST}; the checkpoint was never finished (crash while "
                         "writing?)") from None
    return _parsed_manifest(raw, remote.uri), raw


def _verify_sizes_remote(remote: Remote) -> dict:
    manifest, _ = _remote_manifest(remote)
    sizes = remote.files()
    for name, entry in manifest["files"].items():
        if name not in sizes:
            raise ValueError(f"{remote.uri}: file {name} listed in the manifest is missing")
        if sizes[name] != entry["bytes"]:
            raise ValueError(f"{remote.uri}: {name} has {sizes[name]} bytes, the manifest says {entry['bytes']} "
                             "(truncated?)")
    return manifest


def local_copy(ref: str | Path) -> Path:
    """A checkpoint as a local directory: `ref` itself when local; a checkpoint on object storage downloaded
    into the cache (`vela_ray.storage.cached_copy`) and verified there in full, sizes and sha256 (a copy
    already there whose manifest equals the checkpoint's and that verifies is used as it is)."""
    if not is_remote(ref):
        return Path(ref)
    remote, copy = Remote(str(ref)), storage.cached_copy(str(ref))
    manifest, raw = _remote_manifest(remote)
    if (copy / MANIFEST).is_file() and (copy / MANIFEST).read_bytes() == raw:
        try:
            verify(copy)
            return copy
        except ValueError:
            pass  # downloaded again below
    shutil.rmtree(copy, ignore_errors=True)
    for name in manifest["files"]:
        try:
            remote.download(name, copy / name)
        except (FileNotFoundError, OSError):
            raise ValueError(f"{remote.uri}: file {name} listed in the manifest is missing") from None
    (copy / MANIFEST).write_bytes(raw)
    (copy / SOURCE_FILE).write_text(remote.uri)
    verify(copy)
    return copy


def source_of(path: str | Path) -> str:
    """Where checkpoint `path` is for another process, on any node: the URI a local copy came from, else
    the path."""
    source = Path(path) / SOURCE_FILE
    return source.read_text() if not is_remote(path) and source.is_file() else str(path)


def read_expert_states_at(ref: str | Path, keys: list[ExpertKey]) -> dict[ExpertKey, dict[str, torch.Tensor]]:
    """`read_expert_states` of a checkpoint anywhere: on object storage only the parts holding `keys` are
    downloaded (into a directory of this process's own, deleted after), and checked against the manifest."""
    if not is_remote(ref):
        return read_expert_states(Path(ref), verify(ref, checksums=False), keys)
    import tempfile

    remote = Remote(str(ref))
    manifest, _ = _remote_manifest(remote)
    index = manifest["experts"]
    needed = sorted({index[f"{k[0]}.{k[1]}"] for k in keys if f"{k[0]}.{k[1]}" in index})
    with tempfile.TemporaryDirectory(prefix="vela-parts-") as tmp:
        for name in needed:
            local = remote.download(name, Path(tmp) / name)
            if sha256_of(local) != manifest["files"][name]["sha256"]:
                raise ValueError(f"{remote.uri}: {name} fails its sha256 checksum (corrupted)")
        return read_expert_states(Path(tmp), manifest, keys)


def read_trainer(path: str | Path) -> dict:
    """Checkpoint `path`'s `trainer.json` (where the run stood: its step, planned steps, placement...), or {}."""
    trainer = Path(path) / "trainer.json"
    return json.loads(trainer.read_text()) if trainer.is_file() else {}


def read_run(path: str | Path) -> dict | None:
    """The identity of the run checkpoint `path` belongs to (`vela_ray.runs.RunIdentity` as a dict), or None
    for a checkpoint written before runs had one."""
    return read_trainer(path).get("run")


def check_compatible(manifest: dict, expected: dict, path: Path) -> None:
    """Refuse a checkpoint of another model / LoRA config: `expected` holds the meta fields to match."""
    meta = manifest.get("meta", {})
    wrong = [f"{k}: checkpoint {meta.get(k)!r} vs this job {v!r}" for k, v in expected.items() if meta.get(k) != v]
    if wrong:
        raise ValueError(f"{path} does not match this job: " + "; ".join(wrong))


def read_expert_states(path: Path, manifest: dict, keys: list[ExpertKey]) -> dict[ExpertKey, dict[str, torch.Tensor]]:
    """{(layer, expert): {state name: tensor}} for exactly `keys`, from whichever parts hold them."""
    index = manifest["experts"]
    if not index:  # a job with frozen experts (`lora.expert_stacks: []`): no expert has any state
        return {key: {} for key in keys}
    missing = [k for k in keys if f"{k[0]}.{k[1]}" not in index]
    if missing:
        raise ValueError(f"{path}: checkpoint has no state for experts {missing[:8]} ({len(missing)} missing)")
    by_file: dict[str, list[ExpertKey]] = {}
    for key in keys:
        by_file.setdefault(index[f"{key[0]}.{key[1]}"], []).append(key)
    states: dict[ExpertKey, dict[str, torch.Tensor]] = {}
    for file, file_keys in by_file.items():
        with safe_open(str(path / file), "pt") as f:
            names = list(f.keys())
            for layer, expert in file_keys:
                prefix = f"l{layer}.e{expert}."
                states[(layer, expert)] = {n[len(prefix):]: f.get_tensor(n) for n in names if n.startswith(prefix)}
    return states


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# --- helpers --------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
