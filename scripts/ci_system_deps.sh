#!/usr/bin/env bash
# System packages the test suite uses beyond Python: Debian's chromium, for the report's browser test
# (tests/unit/test_report.py skips that test when /usr/bin/chromium is missing).
# Idempotent and quiet: does nothing when chromium is already installed. Needs root (or sudo) and apt.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[ci-deps] no apt-get: install chromium yourself to run the report's browser test" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "[ci-deps] installing chromium (for the report's browser test)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
