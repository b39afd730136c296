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
#     python has one (the venv sees it through --system-site-packages), else gets PyPI's default
#     CUDA build; the torch and CUDA pins of constraints.txt are left out there;
#   - a CPU machine gets the pinned torch (2.13.0: a CPU wheel lies on this workplace's disk;
#     elsewhere point PIP_EXTRA_INDEX_URL at a CPU wheel index).
# Override either choice with VELA_TORCH_SPEC="torch==X.Y.Z".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VELA_VENV:-.venv}
LATEST=${VELA_LATEST:-0}
STAMP="$VENV/.vela-installed"

if [ "$LATEST" != 1 ] && [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt constraints.txt ]; then
  exit 0
fi

gpu_host() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
node_has_cuda_torch() { "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; }

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

pinned_torch=$(sed -n -E 's/^torch==(.*)$/\1/p' constraints.txt)
if [ -n "${VELA_TORCH_SPEC:-}" ]; then
  torch_spec=$VELA_TORCH_SPEC
elif gpu_host; then
  torch_spec="torch>=2.6"
else
  torch_spec="torch==${VELA_CPU_TORCH:-$pinned_torch}"
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $torch_spec"
  $PIP install -q "$torch_spec"
fi
if [ "$LATEST" = 1 ]; then
  echo "[setup] installing vela-ray with the newest releases of its dependencies (torch kept)"
  $PIP install -q --upgrade --upgrade-strategy eager -e ".[dev]" "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
else
  echo "[setup] installing vela-ray and its dependencies at the versions in constraints.txt"
  $PIP install -q "${CONSTRAINTS[@]}" -e ".[dev]"
fi
touch "$STAMP"
