"""Where vela-ray finds shared data and keeps its caches.

`../shared/data` beside the repository holds the reference data sets
(override with VELA_DATA_DIR); built artefacts such as the tiny pre-trained
model are cached under VELA_CACHE_DIR (default: ~/.cache/vela-ray).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, PlainValidator


def _expand_user(value: object) -> object:
    return Path(value).expanduser() if isinstance(value, (str, Path)) and str(value).startswith("~") else value


UserPath = Annotated[Path, BeforeValidator(_expand_user)]
"""A config path field: `~` and `~user` expand to the home directory, as a shell would have done."""


_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_remote(path: object) -> bool:
    """Whether `path` names object storage (a URI other than file://, `vela_ray.storage`) rather than a local
    directory."""
    return bool(_URI.match(str(path))) and not str(path).startswith("file://")


def _storage_path(value: object) -> Path | str:
    if isinstance(value, str) and is_remote(value):
        return value.rstrip("/")
    if not isinstance(value, (str, Path)):
        raise ValueError(f"expected a directory or a URI, got {type(value).__name__}")
    return Path(_expand_user(value))


StoragePath = Annotated[Path | str, PlainValidator(_storage_path), PlainSerializer(str, return_type=str)]
"""A directory a run writes to: a local path (a `Path`, `~` expanded) or a URI on object storage kept as a
string (`s3://bucket/run`, `gs://...`; `vela_ray.storage`)."""

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """The reference data directory (`../shared/data` beside the repository)."""
    env = os.environ.get("VELA_DATA_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


def cache_dir() -> Path:
    """The cache directory for built models and profiles (created on demand)."""
    env = os.environ.get("VELA_CACHE_DIR")
    path = Path(env) if env else Path.home() / ".cache" / "vela-ray"
    path.mkdir(parents=True, exist_ok=True)
    return path
