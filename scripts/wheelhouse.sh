#!/usr/bin/env bash
# Build an offline wheelhouse of vela-ray for GPU nodes that reach no package index.
#
#   scripts/wheelhouse.sh [OUT]                 (or: make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64 OUT=wheelhouse)
#   scripts/wheelhouse.sh pack FOLDER PARTS     pack an existing folder into PARTS (used by the tests)
#
# Run it on a connected machine. It downloads, for the node's Python (PY, e.g. 3.12) and platform
# (PLATFORM, e.g. manylinux_2_28_x86_64; the older manylinux tags that platform runs are added), a wheel
# of every pin of constraints.txt except torch, triton and nvidia-* (the node keeps its own torch), with
# --no-deps (constraints.txt is a full lock), plus a wheel of vela-ray itself. A pin with no wheel for the
# node is built from its sdist here when that gives a pure-python (py3-none-any) wheel; otherwise the
# build fails naming it. PY and PLATFORM default to the running python's.
#
# OUT/vela-wheelhouse/   the wheels, constraints.txt (less torch/triton/nvidia-*), info.txt
# OUT/report.txt         one line per pin: wheel | built-from-sdist | MISSING
# OUT/parts/             what to carry to the node: vela-wheelhouse.tar.NNN (at most PART_SIZE, 60m),
#                        SHA256SUMS (every part, in order, and the whole tar) and offline_install.sh
# Then on the node:  bash parts/offline_install.sh parts [VENV]   (deploy/README.md, "Install without internet")
#
# PACK=0 downloads only (to check that every pin has something for PY/PLATFORM).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PART_SIZE=${PART_SIZE:-60m}
NAME=vela-wheelhouse

log() { echo "[wheelhouse] $*" >&2; }
die() { echo "wheelhouse: $*" >&2; exit 1; }

# pack FOLDER PARTS: tar FOLDER (as its basename), split into PARTS/<basename>.tar.NNN, write SHA256SUMS.
pack() {
  local folder=${1%/} parts=$2 base
  [ -d "$folder" ] || die "no folder $folder to pack"
  base=$(basename "$folder")
  mkdir -p "$parts"
  rm -f "$parts/$base".tar.[0-9][0-9][0-9] "$parts/SHA256SUMS"
  tar -C "$(dirname "$folder")" -cf - "$base" | split -b "$PART_SIZE" -d -a 3 - "$parts/$base.tar."
  (
    cd "$parts"
    local whole
    whole=$(cat "$base".tar.[0-9][0-9][0-9] | sha256sum | cut -d' ' -f1)
    {
      echo "# vela-ray wheelhouse: parts in order; 'tar' is the whole reassembled tar"
      sha256sum "$base".tar.[0-9][0-9][0-9] | sed 's/^/part /'
      echo "tar $whole  $base.tar"
    } > SHA256SUMS
  )
  cp "$ROOT/scripts/offline_install.sh" "$parts/"
  log "packed $folder into $(ls "$parts/$base".tar.[0-9][0-9][0-9] | wc -l) part(s) in $parts ($(du -sh --apparent-size "$parts" | cut -f1))"
}

if [ "${1:-}" = pack ]; then
  [ $# -eq 3 ] || die "usage: wheelhouse.sh pack FOLDER PARTS"
  pack "$2" "$3"
  exit 0
fi

OUT=${1:-${OUT:-wheelhouse}}
PYTHON=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
PY=${PY:-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
PLATFORM=${PLATFORM:-$("$PYTHON" -c '
import platform, sysconfig
libc, ver = platform.libc_ver()
arch = sysconfig.get_platform().split("-", 1)[-1]
major, minor = (ver.split(".") + ["0"])[:2]
print(f"manylinux_{major}_{minor}_{arch}" if libc == "glibc" else sysconfig.get_platform().replace("-", "_").replace(".", "_"))')}
JOBS=${JOBS:-4}

# The platform tags a node of PLATFORM runs: manylinux_2_Y for Y down to 5, and the legacy aliases.
platforms=("$PLATFORM")
if [[ $PLATFORM =~ ^manylinux_([0-9]+)_([0-9]+)_(.+)$ ]]; then
  glibc_minor=${BASH_REMATCH[2]}; arch=${BASH_REMATCH[3]}
  for ((y = glibc_minor - 1; y >= 5; y--)); do platforms+=("manylinux_2_${y}_$arch"); done
  [ "$glibc_minor" -ge 17 ] && platforms+=("manylinux2014_$arch")
  [ "$glibc_minor" -ge 12 ] && platforms+=("manylinux2010_$arch")
  platforms+=("manylinux1_$arch")
elif [[ $PLATFORM =~ ^manylinux2014_(.+)$ ]]; then
  platforms+=("manylinux_2_17_${BASH_REMATCH[1]}")
fi
PLATFORM_ARGS=()
for p in "${platforms[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done

WH="$OUT/$NAME"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd); WH="$OUT/$NAME"
rm -rf "$WH"; mkdir -p "$WH"
grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+)==' "$ROOT/constraints.txt" > "$WH/constraints.txt"
mapfile -t pins < <(grep -E '^[A-Za-z0-9_.-]+(\[[^]]*\])?==' "$WH/constraints.txt")
# A lock from `pip freeze` leaves out setuptools, which osqp (and torch on 3.12) require at run time and
# which `python3.12 -m venv` no longer installs: carry the version this machine has (SETUPTOOLS to change it).
if ! grep -q -E '^setuptools==' "$WH/constraints.txt"; then
  st=${SETUPTOOLS:-$("$PYTHON" -c 'import setuptools; print(setuptools.__version__)' 2>/dev/null || true)}
  pins+=("setuptools${st:+==$st}")
fi
log "Python $PY, $PLATFORM (+${#platforms[@]} tags): ${#pins[@]} pins of constraints.txt (torch/triton/nvidia-* left out) into $WH"

# One pin: the node's wheel, else a pure-python wheel built from the sdist here. Prints its report line.
fetch_pin() {
  local pin=$1 tmp rc=0
  tmp=$(mktemp -d)
  if "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" "${PLATFORM_ARGS[@]}" \
       -d "$tmp" "$pin" >"$tmp/log" 2>&1; then
    mv "$tmp"/*.whl "$WH/" && echo "$pin wheel"
  elif "$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$tmp/sdist" "$pin" >>"$tmp/log" 2>&1 \
       && "$PYTHON" -m pip wheel -q --no-deps -w "$tmp/built" "$tmp"/sdist/* >>"$tmp/log" 2>&1; then
    local whl
    whl=$(ls "$tmp"/built/*.whl)
    if [[ $(basename "$whl") =~ -(py3|py2\.py3)-none-any\.whl$ ]]; then
      mv "$whl" "$WH/" && echo "$pin built-from-sdist (pure python)"
    else
      echo "$pin MISSING (no wheel for $PY/$PLATFORM; its sdist builds $(basename "$whl"), not pure python)"; rc=1
    fi
  else
    echo "$pin MISSING (no wheel for $PY/$PLATFORM and no sdist: $(grep -m1 -E '^ERROR' "$tmp/log" || tail -1 "$tmp/log"))"; rc=1
  fi
  rm -rf "$tmp"
  return $rc
}
export -f fetch_pin
export PYTHON PY PLATFORM WH
export PLATFORM_ARGS_STR="${PLATFORM_ARGS[*]}"

# xargs runs fetch_pin in a child bash, which cannot inherit the array: rebuild it there.
printf '%s\n' "${pins[@]}" \
  | xargs -P "$JOBS" -I{} bash -c 'read -ra PLATFORM_ARGS <<<"$PLATFORM_ARGS_STR"; fetch_pin "$1"' _ {} \
  | sort > "$OUT/report.txt" || true
missing=$(grep -c MISSING "$OUT/report.txt" || true)
sdists=$(grep -c built-from-sdist "$OUT/report.txt" || true)
got=$(grep -c -v MISSING "$OUT/report.txt" || true)
log "$got/${#pins[@]} pins fetched ($sdists built from an sdist here), $missing missing (see $OUT/report.txt)"

# vela-ray itself, built from the working tree (tracked and untracked-but-not-ignored files).
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
if git -C "$ROOT" rev-parse >/dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -cf - -T - 2>/dev/null) | tar -xf - -C "$src"
else
  (cd "$ROOT" && tar --exclude=.venv --exclude=.git --exclude=build -cf - .) | tar -xf - -C "$src"
fi
"$PYTHON" -m pip wheel -q --no-deps -w "$WH" "$src" >"$OUT/vela-ray-build.log" 2>&1 \
  || die "building vela-ray's wheel failed (see $OUT/vela-ray-build.log)"
ls "$WH"/vela_ray-*.whl >/dev/null 2>&1 || die "no vela_ray wheel was built (see $OUT/vela-ray-build.log)"

printf 'python=%s\nplatform=%s\nbuilt=%s\n' "$PY" "$PLATFORM" "$(date -u +%FT%TZ)" > "$WH/info.txt"
log "$(ls "$WH"/*.whl | wc -l) wheels, $(du -sh --apparent-size "$WH" | cut -f1) in $WH"

if [ "$missing" != 0 ]; then
  grep MISSING "$OUT/report.txt" >&2
  die "$missing pin(s) have neither a wheel for Python $PY/$PLATFORM nor a pure-python sdist (listed above)"
fi
if [ "${PACK:-1}" = 1 ]; then
  pack "$WH" "$OUT/parts"
fi
