"""Object storage for a run's outputs and checkpoints: `output.dir` / `checkpoint.dir` as `s3://...`,
`gs://...` or any URI `pyarrow.fs` opens.

Cluster nodes are ephemeral, so a run's outputs belong on storage that outlives them. What lives where:
  * checkpoints are written straight to storage, each process its own files (an ExpertManager uploads its
    part from its own node, never through the master); the manifest is written last and is what publishes
    a checkpoint (`vela_ray.training.checkpoint`), as the rename does on a local disk;
  * everything else a run writes (adapter, summary, report, placement, trackers' files) is written into a
    local mirror of the output directory (`local_mirror`) and uploaded when the run ends, however it ends;
  * reading a remote checkpoint downloads it into a local cache first, where it is verified like a local one.

Credentials come from the environment, as each filesystem reads them (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL,
GOOGLE_APPLICATION_CREDENTIALS, ...); a URI that carries them (`s3://key:secret@bucket`) is refused, so they
never reach a config file, a log line, the summary or the report.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path, PurePosixPath
from typing import Iterable

from vela_ray.paths import cache_dir, is_remote

__all__ = ["Remote", "is_remote", "check_uri", "join", "name_of", "sha256_of", "local_mirror", "cached_copy",
           "pull_outputs", "push_outputs"]  # is_remote: defined with the config's path types (vela_ray.paths)

logger = logging.getLogger(__name__)

SHA256_SUFFIX = ".sha256"  # beside a file uploaded by another process: its checksum, for the manifest


def check_uri(uri: str, field: str) -> None:
    """One line naming `field` if `uri` carries credentials or names no bucket."""
    rest = uri.split("://", 1)[1]
    if "@" in rest.split("/", 1)[0]:
        raise ValueError(f"{field} {uri.split('://')[0]}://...: the URI carries credentials; give them in the "
                         "environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and write the URI without them")
    if not rest.strip("/"):
        raise ValueError(f"{field} {uri}: names no bucket; write e.g. s3://bucket/runs/job")


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def name_of(path: str | Path) -> str:
    """The last component of a local path or a URI."""
    return PurePosixPath(str(path).rstrip("/")).name


def _filesystem(uri: str):
    from pyarrow import fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as err:
        raise ValueError(f"{uri.split('?')[0]}: pyarrow cannot open it ({str(err).splitlines()[0]})") from None


class Remote:
    """A directory on object storage, as the few operations checkpoints and outputs need."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.fs, self.base = _filesystem(self.uri)

    def _path(self, rel: str = "") -> str:
        return f"{self.base}/{rel.strip('/')}" if rel.strip("/") else self.base

    def child(self, rel: str) -> "Remote":
        return Remote(join(self.uri, rel))

    def files(self, rel: str = "") -> dict[str, int]:
        """{relative path: bytes} of every file under `rel`, recursively; {} when there is none."""
        from pyarrow import fs as pafs

        root = self._path(rel)
        infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        return {info.path[len(root) + 1:]: info.size for info in infos if info.type == pafs.FileType.File}

    def dirs(self, rel: str = "") -> list[str]:
        """Names of the directories directly under `rel`."""
        from pyarrow import fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self._path(rel), allow_not_found=True))
        return sorted(info.base_name for info in infos if info.type == pafs.FileType.Directory)

    def exists(self, rel: str) -> bool:
        from pyarrow import fs as pafs

        return self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._path(rel)) as stream:
            return stream.read()

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        with self.fs.open_input_file(self._path(rel)) as f:
            return f.read_at(length, start)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.fs.open_output_stream(self._path(rel)) as stream:
            stream.write(data)

    def upload(self, local: Path, rel: str, *, with_checksum: bool = False) -> str:
        """Copy the local file `local` to `rel` (and, with `with_checksum`, its sha256 to `rel.sha256`, for a
        manifest written by another process); returns the sha256."""
        digest = sha256_of(local)
        with open(local, "rb") as src, self.fs.open_output_stream(self._path(rel)) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        if with_checksum:
            self.write_bytes(rel + SHA256_SUFFIX, digest.encode())
        return digest

    def upload_tree(self, local: Path, skip: Iterable[str] = ()) -> int:
        """Every file under the local directory `local` to the same relative paths here, except those under a
        top-level name in `skip`; returns the number of files."""
        skip, count = set(skip), 0
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = path.relative_to(local)
            if rel.parts[0] in skip:
                continue
            self.upload(path, rel.as_posix())
            count += 1
        return count

    def download(self, rel: str, local: Path) -> Path:
        local.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_input_stream(self._path(rel)) as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        return local

    def download_tree(self, local: Path, skip: Iterable[str] = ()) -> int:
        """Every file here into the local directory `local`, except those under a top-level name in `skip`."""
        skip, files = set(skip), self.files()
        for rel in files:
            if rel.split("/")[0] not in skip:
                self.download(rel, local / rel)
        return len(files)

    def delete_tree(self, rel: str = "") -> None:
        from pyarrow import fs as pafs

        path = self._path(rel)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            self.fs.delete_dir(path)

    def delete(self, rel: str) -> None:
        self.fs.delete_file(self._path(rel))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def local_mirror(uri: str) -> Path:
    """The local directory a run writes its outputs into before they are uploaded to `uri`."""
    scheme, rest = uri.split("://", 1)
    return cache_dir() / "outputs" / scheme / rest.split("?")[0].strip("/")


def cached_copy(uri: str) -> Path:
    """The local cache directory a remote checkpoint `uri` is downloaded into."""
    scheme, rest = uri.split("://", 1)
    return cache_dir() / "checkpoints" / scheme / rest.split("?")[0].strip("/")


OUTPUTS_SKIP = ("checkpoints",)  # written straight to storage, never through the mirror


def pull_outputs(uri: str, mirror: Path, *, fresh: bool) -> Path:
    """The local mirror of output directory `uri`, emptied (`fresh`: a new run) or holding what is on
    storage (a resumed run continues its trackers' files; the driver's samples read the adapter)."""
    shutil.rmtree(mirror, ignore_errors=True)
    mirror.mkdir(parents=True)
    if not fresh:
        Remote(uri).download_tree(mirror, skip=OUTPUTS_SKIP)
    return mirror


def push_outputs(uri: str, mirror: Path, *, failing: bool = False) -> None:
    """The mirror's files to `uri` (its checkpoints went there directly). `failing`: the run is failing already
    and its own error is the one to see, so an upload error is logged, not raised over it."""
    try:
        count = Remote(uri).upload_tree(mirror, skip=OUTPUTS_SKIP)
    except OSError as err:
        if not failing:
            raise
        logger.warning("uploading the outputs to %s failed (%s); they are in %s", uri, err, mirror)
        return
    logger.info("uploaded %d output files to %s", count, uri)
