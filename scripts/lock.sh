#!/usr/bin/env bash
# `make lock`: re-resolve every dependency to its newest release and rewrite constraints.txt.
#
# The newest releases are installed into a separate venv (.venv-latest, the one `make test-latest`
# tests), then frozen. torch stays the CPU build scripts/setup.sh installs (a GPU node keeps its own
# torch: setup.sh drops the torch pin there). Run `make test` afterwards: the pins are what the suite
# passed with, so commit constraints.txt (and vela_ray/training/verified_families.json, rewritten with it)
# only with a green suite on them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VELA_LATEST_VENV:-.venv-latest}
VELA_VENV=$VENV VELA_LATEST=1 bash scripts/setup.sh
{
  echo "# Exact versions the test suite passed with; scripts/setup.sh installs with -c constraints.txt."
  echo "# Rewritten by \`make lock\` ($($VENV/bin/python -c 'import platform; print("Python", platform.python_version())'))."
  echo "# A GPU node keeps its own torch (setup.sh leaves the torch and CUDA lines out there)."
  "$VENV/bin/python" -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
# the families the suite will verify at these pins (tests/unit/test_family_checks.py holds the two together)
"$VENV/bin/python" -m vela_ray.training.family_check
echo "[lock] constraints.txt: $(grep -c '==' constraints.txt) pins; now run: make test"
