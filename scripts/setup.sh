#!/usr/bin/env bash
# Create .venv and install vela-ray with its test extras.
#
# torch comes first so that pip never resolves the bare `torch` requirement to a
# multi-GB CUDA wheel on a CPU-only machine:
#   - a machine with an NVIDIA GPU (nvidia-smi works) gets PyPI's default CUDA build;
#   - a CPU machine gets torch==$VELA_CPU_TORCH (2.13.0: a CPU wheel lies on this
#     workplace's disk; elsewhere point PIP_EXTRA_INDEX_URL at a CPU wheel index).
# Override either choice with VELA_TORCH_SPEC="torch==X.Y.Z".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VELA_VENV:-.venv}
STAMP="$VENV/.vela-installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if [ -n "${VELA_TORCH_SPEC:-}" ]; then
  torch_spec=$VELA_TORCH_SPEC
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_spec="torch>=2.6"
else
  torch_spec="torch==${VELA_CPU_TORCH:-2.13.0}"
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $torch_spec"
  $PIP install -q "$torch_spec"
fi
echo "[setup] installing vela-ray and its dependencies"
$PIP install -q -e ".[dev]"
touch "$STAMP"
