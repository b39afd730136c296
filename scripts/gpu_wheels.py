"""The wheels a bare, offline GPU node needs to run vela-ray's Ray-free GPU battery, and nothing it already has.

    .venv/bin/python scripts/gpu_wheels.py [--out gpu-wheels] [--python-version 3.12]
                                           [--platform manylinux_2_28_x86_64]
    (or: make gpu-wheels PY=3.12 PLATFORM=manylinux_2_28_x86_64)

Why not `make wheelhouse`: that carries every pin of constraints.txt (Ray, cvxpy, datasets, pyarrow, ...)
in tar parts, while the battery needs only the training core. The reference node comes with a CUDA torch
(with torch's own requirements) and numpy, has no package index, and takes at most 60 MiB. So this
carries the closure of the training core's requirements (ROOTS), stopped at what the node has
(NODE_HAS), at the versions pinned in constraints.txt, plus vela-ray's own wheel.

The closure comes from the metadata of the installed .venv, which setup.sh installs from constraints.txt:
no resolver and no index, only markers evaluated for the node's Python and platform, extras dropped.
Run it with .venv/bin/python, so that metadata is the pinned one. A member without a pin fails, naming it.

OUT/*.whl            the closure's wheels (pip download --no-deps for PY/platform) and vela_ray-*.whl
OUT/requirements.txt the pinned roots: pip resolves them against the node's torch and numpy
OUT/INSTALL          the install line, run beside OUT (it keeps the node's torch)
OUT/manifest.json    each wheel's name, version and bytes; the total; python, platforms; the install line
                     and what the closure asks of the node's own packages (node_requires)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("transformers", "tokenizers", "safetensors", "huggingface-hub", "peft", "pydantic", "pyyaml", "tqdm",
         "psutil")
# What the reference node already has: a CUDA torch, torch's own requirements (and theirs), numpy. Not
# typing-extensions, which torch needs too: pydantic's pin asks for a newer one than a torch image may hold
# (>= 4.16), and its 45 KB wheel is only installed where the node's is older.
NODE_HAS = frozenset({"torch", "triton", "filelock", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec",
                      "setuptools", "numpy"})
LIMIT_BYTES = 60 * 2**20


class GpuWheelsError(Exception):
    """A reason the folder cannot be built, said in one line."""


def on_node(name: str) -> bool:
    return name in NODE_HAS or name.startswith("nvidia-")


def read_pins(path: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """constraints.txt as {PEP 503 name: version}."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in found}


def node_platforms(platform: str) -> list[str]:
    """The tags a node of `platform` (manylinux_2_Y_ARCH) runs, newest first: pip takes each tag literally."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        raise GpuWheelsError(f"--platform {platform}: give the node's manylinux_2_Y_ARCH tag, "
                             "e.g. manylinux_2_28_x86_64")
    glibc, arch = int(match[1]), match[2]
    legacy = [f"{tag}_{arch}" for oldest, tag in ((17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1"))
              if glibc >= oldest]
    return [f"manylinux_2_{y}_{arch}" for y in range(glibc, 4, -1)] + legacy


def marker_env(python_version: str, platform: str) -> dict[str, str]:
    """The marker environment of a CPython `python_version` node on Linux `platform`, with no extra."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": platform.split("_", 3)[-1], "extra": ""}


def requirements(name: str, env: dict[str, str]) -> list[Requirement]:
    """What the installed `name` requires on the node: its markers evaluated in `env`, extras dropped."""
    parsed = (Requirement(line) for line in distribution(name).requires or [])
    return [req for req in parsed if req.marker is None or req.marker.evaluate(env)]


def closure(roots: tuple[str, ...], pins: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """{name: pinned version} of `roots` and all they require, less what the node has.

    Every member must be pinned and installed here at its pin (the metadata read is that version's)."""
    members: dict[str, str] = {}
    todo = [(canonicalize_name(root), "a root") for root in roots]
    while todo:
        name, wanted_by = todo.pop()
        if name in members or on_node(name):
            continue
        if name not in pins:
            raise GpuWheelsError(f"{name} (required by {wanted_by}) is not pinned in constraints.txt")
        try:
            installed = distribution(name).version
        except PackageNotFoundError:
            raise GpuWheelsError(f"{name} (required by {wanted_by}) is not installed here: run with "
                                 ".venv/bin/python after make setup") from None
        if installed != pins[name]:
            raise GpuWheelsError(f"{name} is {installed} here but pinned {pins[name]}: run with the pinned "
                                 ".venv/bin/python")
        members[name] = pins[name]
        todo += [(canonicalize_name(req.name), name) for req in requirements(name, env)]
    return dict(sorted(members.items()))


def node_requires(members: dict[str, str], env: dict[str, str]) -> list[str]:
    """The versions the closure asks of the node's own packages: an older one there fails the install."""
    asks = {f"{canonicalize_name(req.name)}{req.specifier} ({name})"
            for name in members for req in requirements(name, env)
            if on_node(canonicalize_name(req.name)) and req.specifier}
    return sorted(asks)


def download(members: dict[str, str], out: Path, python_version: str, platforms: list[str]) -> None:
    """Each member's wheel for the node, as pinned; pure-python wheels match any platform."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp",
               *(arg for platform in platforms for arg in ("--platform", platform)),
               "-d", str(out), *(f"{name}=={version}" for name, version in members.items())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or [done.stderr.strip()]
        raise GpuWheelsError(f"pip download for Python {python_version}/{platforms[0]}: {errors[0]}")


def build_vela_wheel(out: Path) -> None:
    """vela-ray's wheel, from a copy of the work tree's files (tracked and untracked-but-not-ignored).

    A copy, as setuptools' in-tree build/ would keep modules deleted since; no isolation, so no index."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    with tempfile.TemporaryDirectory() as tmp:
        for relative in filter(None, listed):
            if (ROOT / relative).is_file():  # a tracked file may be deleted in the work tree
                (Path(tmp) / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / relative, Path(tmp) / relative)
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                               "-w", str(out), tmp], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GpuWheelsError(f"building vela-ray's wheel failed: {last}")


def install_line(out: Path) -> str:
    """The node's install command, run from the folder holding `out`: the roots, then vela-ray without
    its Ray, cvxpy and datasets requirements, which the battery does not need."""
    return (f"python3 -m pip install --no-index --find-links {out.name} -r {out.name}/requirements.txt"
            f" && python3 -m pip install --no-index --no-deps {out.name}/vela_ray-*.whl")


def folder_bytes(folder: Path) -> int:
    """The apparent size of the files in `folder`, as `du -sb` counts them (less the folder's own entry)."""
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def check_size(folder: Path, limit: int = LIMIT_BYTES) -> int:
    """The folder's size in bytes, if it is at most `limit`."""
    total = folder_bytes(folder)
    if total > limit:
        raise GpuWheelsError(f"{folder} holds {total} bytes ({mib(total)} MiB), over the {mib(limit)} MiB "
                             "that may travel to the node")
    return total


def mib(size: int) -> str:
    return f"{size / 2**20:.1f}"


def write_folder(out: Path, pins: dict[str, str], python_version: str, platforms: list[str],
                 asks: list[str]) -> None:
    """requirements.txt, INSTALL and manifest.json beside the wheels."""
    roots = sorted(canonicalize_name(root) for root in ROOTS)
    (out / "requirements.txt").write_text("".join(f"{name}=={pins[name]}\n" for name in roots))
    (out / "INSTALL").write_text(install_line(out) + "\n")
    wheels = []
    for path in sorted(out.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        wheels.append({"file": path.name, "name": name, "version": str(version), "bytes": path.stat().st_size})
    manifest = {"python": python_version, "platforms": platforms, "wheels": wheels,
                "total_bytes": sum(wheel["bytes"] for wheel in wheels), "install": install_line(out),
                "node_requires": asks, "closure_of": roots}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def build(out: Path, python_version: str, platform: str) -> int:
    """Fill `out` (its older wheels removed first: two versions of one name break pip); its size in bytes."""
    platforms = node_platforms(platform)
    env = marker_env(python_version, platform)
    pins = read_pins()
    members = closure(ROOTS, pins, env)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.whl"):
        stale.unlink()
    download(members, out, python_version, platforms)
    build_vela_wheel(out)
    asks = node_requires(members, env)
    write_folder(out, pins, python_version, platforms, asks)
    for path in sorted(out.glob("*.whl")):
        print(f"  {path.name:<72} {path.stat().st_size:>10}")
    print(f"the node's own packages must satisfy: {', '.join(asks)}")
    return check_size(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-wheels")
    parser.add_argument("--python-version", default="3.12", help="the node's Python, e.g. 3.12 (default)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64",
                        help="the node's manylinux_2_Y_ARCH tag (the older ones it runs are added)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    try:
        total = build(out, args.python_version, args.platform)
    except GpuWheelsError as error:
        print(f"gpu_wheels: {error}", file=sys.stderr)
        return 1
    print(f"gpu_wheels: {len(list(out.glob('*.whl')))} wheels, {total} bytes ({mib(total)} MiB, "
          f"limit {mib(LIMIT_BYTES)}) in {out}; on the node: {install_line(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
