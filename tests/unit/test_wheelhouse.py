"""The offline wheelhouse's packing and checks (scripts/wheelhouse.sh pack, scripts/offline_install.sh), on a
small fake wheelhouse: nothing is downloaded or installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE_SH = REPO / "scripts" / "wheelhouse.sh"
NAME = "vela-wheelhouse"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None
                                or shutil.which("split") is None, reason="needs bash and coreutils")


def _run(*args: str | Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, Path]:
    """A fake 2.5 MiB wheelhouse packed into 1 MiB parts: (the folder, the parts folder)."""
    folder = tmp_path / "build" / NAME
    folder.mkdir(parents=True)
    (folder / "constraints.txt").write_text("torch==2.13.0\nnumpy==2.3.5\nnvidia-nccl-cu12==2.27.5\n")
    (folder / "info.txt").write_text("python=2.7\nplatform=manylinux_2_28_x86_64\n")
    (folder / "fake-1.0-py3-none-any.whl").write_bytes(os.urandom(5 * 2**19))
    parts = tmp_path / "parts"
    done = _run(WHEELHOUSE_SH, "pack", folder, parts, PART_SIZE="1m")
    assert done.returncode == 0, done.stderr
    return folder, parts


def _part_names(parts: Path) -> list[str]:
    return sorted(p.name for p in parts.glob(f"{NAME}.tar.[0-9][0-9][0-9]"))


def test_pack_splits_into_parts_with_a_manifest(packed):
    _, parts = packed
    names = _part_names(parts)
    assert names == [f"{NAME}.tar.000", f"{NAME}.tar.001", f"{NAME}.tar.002"]
    assert all((parts / n).stat().st_size <= 2**20 for n in names)
    manifest = (parts / "SHA256SUMS").read_text().splitlines()
    assert [line.split()[2] for line in manifest if line.startswith("part ")] == names
    assert any(line.startswith("tar ") for line in manifest)
    assert (parts / "offline_install.sh").is_file()  # travels with the parts


def test_good_parts_reassemble_into_the_same_files(packed):
    folder, parts = packed
    done = _run(parts / "offline_install.sh", "--extract-only", parts)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and f"{NAME}: 1 wheels" in done.stdout
    out = parts / NAME
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    for p in folder.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert not (parts / f"{NAME}.tar").exists()  # the reassembled tar is removed after extraction


def _one_line_failure(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_corrupt_part_is_refused_in_one_line(packed):
    _, parts = packed
    part = parts / f"{NAME}.tar.001"
    data = bytearray(part.read_bytes())
    data[1000] ^= 0xFF
    part.write_bytes(bytes(data))
    line = _one_line_failure(_run(parts / "offline_install.sh", "--extract-only", parts))
    assert line.startswith(f"offline_install: corrupt part {NAME}.tar.001"), line
    assert not (parts / NAME).exists()


def test_a_missing_part_is_named_in_one_line(packed):
    _, parts = packed
    (parts / f"{NAME}.tar.002").unlink()
    line = _one_line_failure(_run(parts / "offline_install.sh", "--extract-only", parts))
    assert line.startswith(f"offline_install: missing part {NAME}.tar.002"), line


def test_no_manifest_and_a_wrong_python_fail_in_one_line(packed, tmp_path):
    _, parts = packed
    # a venv whose Python is not the wheelhouse's (info.txt says 2.7): refused before pip runs
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    line = _one_line_failure(_run(parts / "offline_install.sh", parts, venv))
    assert "the wheelhouse is for Python 2.7" in line, line
    # without SHA256SUMS nothing is reassembled
    (parts / "SHA256SUMS").unlink()
    shutil.rmtree(parts / NAME)
    line = _one_line_failure(_run(parts / "offline_install.sh", "--extract-only", parts))
    assert "no SHA256SUMS" in line, line
