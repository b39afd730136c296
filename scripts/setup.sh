#!/usr/bin/env bash
# Create .venv and install vela-ray with its test extras, at the versions in constraints.txt.
#
# constraints.txt holds the exact versions the test suite passed with (`make lock` rewrites it), so a
# fresh machine installs what was tested, not whatever was released since. VELA_LATEST=1 installs the
# newest releases instead, into a venv of their own (`make test-latest`, `make lock`).
#
# torch comes first so that pip never resolves the bare `torch` requirement to a
# multi-GB CUDA wheel on a CPU-only machine:
#   - a machine with an NVIDIA GPU (nvidia-smi works) keeps the node's own CUDA torch when its
#     python has one (the venv sees it through --system-site-packages), else gets the newest torch
#     built for a CUDA the node's driver runs: the "CUDA Version" of nvidia-smi's header picks the
#     PyTorch index (13.0 or newer: cu130, 12.8: cu128, 12.6: cu126, 12.4: cu124, 11.8: cu118), as
#     PyPI's default build may need a newer driver than the node's. A torch already in the venv that
#     cannot use the GPU (a CPU build, a CUDA too new for the driver) is replaced with that build, and
#     after installing, torch.cuda.is_available() must hold, or setup fails in one line. The torch
#     and CUDA pins of constraints.txt are left out there;
#   - a CPU machine gets the pinned torch (2.13.0: a CPU wheel lies on this workplace's disk;
#     elsewhere point PIP_EXTRA_INDEX_URL at a CPU wheel index).
# Override either choice with VELA_TORCH_SPEC="torch==X.Y.Z", the GPU's index with
# VELA_TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ; VELA_DEVICE=cpu treats a GPU node as a CPU one.
# `scripts/setup.sh --torch-plan` prints the choice for this machine and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VELA_VENV:-.venv}
LATEST=${VELA_LATEST:-0}
STAMP="$VENV/.vela-installed"
TORCH_INDEX_ROOT=https://download.pytorch.org/whl
CUDA_BUILDS="13.0:cu130 12.8:cu128 12.6:cu126 12.4:cu124 11.8:cu118"  # torch>=2.6's CUDA builds, newest first

gpu_host() {
  [ "${VELA_DEVICE:-}" != cpu ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}
node_has_cuda_torch() { "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; }
venv_cuda_ok() { "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; }
venv_torch() {
  "$VENV/bin/python" -c "import torch; print(torch.__version__, 'CUDA', torch.version.cuda or 'none')" 2>/dev/null ||
    echo none
}
# The newest CUDA the driver runs, X.Y, from nvidia-smi's header ("CUDA Version: 12.8"); empty if not found.
driver_cuda() {
  { nvidia-smi 2>/dev/null || true; } | sed -n -E 's/.*CUDA Version: *([0-9]+)\.([0-9]+).*/\1.\2/p' | head -n 1 || true
}
# $1 = X.Y: the tag of the newest CUDA build in CUDA_BUILDS not newer than X.Y; empty if none is.
cuda_build() {
  local major=${1%%.*} minor=${1#*.} entry build
  for entry in $CUDA_BUILDS; do
    build=${entry%%:*}
    if [ "${build%%.*}" -lt "$major" ] || { [ "${build%%.*}" -eq "$major" ] && [ "${build#*.}" -le "$minor" ]; }; then
      echo "${entry#*:}"
      return 0
    fi
  done
}
# The index a GPU node installs torch from (VELA_TORCH_INDEX, else the driver's build); fails in one line
# if the driver is older than every build.
torch_index() {
  if [ -n "${VELA_TORCH_INDEX:-}" ]; then echo "$VELA_TORCH_INDEX"; return 0; fi
  local version build
  version=$(driver_cuda)
  if [ -z "$version" ]; then
    echo "[setup] nvidia-smi shows no \"CUDA Version\": set VELA_TORCH_INDEX=$TORCH_INDEX_ROOT/cuXYZ for the node's driver" >&2
    return 1
  fi
  build=$(cuda_build "$version")
  if [ -z "$build" ]; then
    echo "[setup] the NVIDIA driver runs CUDA $version, older than any torch>=2.6 build (11.8):" \
      "update the driver, or VELA_DEVICE=cpu for a CPU torch" >&2
    return 1
  fi
  echo "$TORCH_INDEX_ROOT/$build"
}
pinned_torch=$(sed -n -E 's/^torch==(.*)$/\1/p' constraints.txt)

if [ "${1:-}" = --torch-plan ]; then  # what this machine would get: "cuda X.Y <index>" or "cpu <spec>"
  if gpu_host; then
    index=$(torch_index) || exit 1
    echo "cuda $(driver_cuda) $index"
  else
    echo "cpu torch==${VELA_CPU_TORCH:-$pinned_torch}"
  fi
  exit 0
fi

if [ "$LATEST" != 1 ] && [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt constraints.txt ]; then
  if ! gpu_host || venv_cuda_ok; then
    exit 0
  fi
  echo "[setup] $VENV's torch ($(venv_torch)) cannot use this node's GPU"
fi

if [ ! -x "$VENV/bin/python" ]; then
  if gpu_host && node_has_cuda_torch; then
    echo "[setup] keeping the node's CUDA torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP="$VENV/bin/python -m pip"

# The pins this install follows: all of constraints.txt, less torch and CUDA's wheels on a GPU node.
CONSTRAINTS=()
if [ "$LATEST" != 1 ]; then
  pins="$VENV/constraints.txt"
  if gpu_host; then
    grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+)==' constraints.txt > "$pins"
  else
    cp constraints.txt "$pins"
  fi
  CONSTRAINTS=(-c "$pins")
fi

index=""
if [ -n "${VELA_TORCH_SPEC:-}" ]; then
  torch_spec=$VELA_TORCH_SPEC
  index=${VELA_TORCH_INDEX:-}
elif gpu_host; then
  torch_spec="torch>=2.6"
  index=$(torch_index) || exit 1
else
  torch_spec="torch==${VELA_CPU_TORCH:-$pinned_torch}"
fi
INDEX=()
if [ -n "$index" ]; then INDEX=(--index-url "$index"); fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $torch_spec${index:+ from $index}"
  $PIP install -q ${INDEX[@]+"${INDEX[@]}"} "$torch_spec"
elif gpu_host && ! venv_cuda_ok; then
  echo "[setup] replacing $VENV's torch ($(venv_torch)), which cannot use this node's GPU," \
    "with $torch_spec${index:+ from $index}"
  $PIP install -q --force-reinstall ${INDEX[@]+"${INDEX[@]}"} "$torch_spec"
fi
if gpu_host && ! venv_cuda_ok; then
  echo "[setup] torch $(venv_torch) in $VENV reports torch.cuda.is_available() == False on this GPU node" \
    "(driver CUDA $(driver_cuda)): set VELA_TORCH_INDEX=$TORCH_INDEX_ROOT/cuXYZ or VELA_TORCH_SPEC for a build" \
    "the driver runs, or VELA_DEVICE=cpu" >&2
  exit 1
fi
if [ "$LATEST" = 1 ]; then
  echo "[setup] installing vela-ray with the newest releases of its dependencies (torch kept)"
  $PIP install -q --upgrade --upgrade-strategy eager -e ".[dev]" "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
else
  echo "[setup] installing vela-ray and its dependencies at the versions in constraints.txt"
  $PIP install -q "${CONSTRAINTS[@]}" -e ".[dev]"
fi
touch "$STAMP"
