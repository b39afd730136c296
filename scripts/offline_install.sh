#!/usr/bin/env bash
# Install vela-ray on a node without internet, from the parts scripts/wheelhouse.sh built.
#
#   bash offline_install.sh DIR [VENV]
#
# DIR holds vela-wheelhouse.tar.NNN and SHA256SUMS (as wheelhouse.sh wrote them into OUT/parts), or is an
# already extracted vela-wheelhouse folder. VENV defaults to $VELA_VENV or .venv.
#   1. checks every part against SHA256SUMS (a missing or corrupt part: one line naming it), reassembles
#      the tar, checks it whole and extracts it into DIR/vela-wheelhouse (VELA_WHEELHOUSE_EXTRACT=dir to move it);
#   2. creates VENV unless it exists, with --system-site-packages when the system python (PYTHON, else
#      python3) already has torch, so the node keeps its own (CUDA) torch; the wheelhouse carries no torch;
#   3. pip install --no-index --find-links <wheelhouse> -c <its constraints, torch lines left out> vela-ray[dev],
#      with pip's configuration files and PIP_* index settings ignored, so only the wheelhouse is used.
# Any failure ends it with one line on stderr and a non-zero exit. --extract-only stops after step 1.
set -uo pipefail
NAME=vela-wheelhouse

die() { echo "offline_install: $*" >&2; exit 1; }

EXTRACT_ONLY=0
args=()
for a in "$@"; do
  case $a in
    --extract-only) EXTRACT_ONLY=1 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $a (usage: offline_install.sh [--extract-only] DIR [VENV])" ;;
    *) args+=("$a") ;;
  esac
done
[ ${#args[@]} -ge 1 ] && [ ${#args[@]} -le 2 ] || die "usage: offline_install.sh [--extract-only] DIR [VENV]"
DIR=${args[0]%/}
VENV=${args[1]:-${VELA_VENV:-.venv}}
[ -d "$DIR" ] || die "no folder $DIR"
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"

# --- 1. verify, reassemble, extract -------------------------------------------------------------------
if [ -f "$DIR/constraints.txt" ] && ls "$DIR"/*.whl >/dev/null 2>&1; then
  WH=$DIR  # an extracted wheelhouse
else
  MANIFEST="$DIR/SHA256SUMS"
  [ -f "$MANIFEST" ] || die "no SHA256SUMS in $DIR (copy every vela-wheelhouse.tar.NNN part and SHA256SUMS)"
  parts=()
  want_tar=
  while read -r kind sum file; do
    case $kind in
      part)
        [ -f "$DIR/$file" ] || die "missing part $file (SHA256SUMS lists it; copy it into $DIR)"
        got=$(sha256sum "$DIR/$file" | cut -d' ' -f1)
        [ "$got" = "$sum" ] || die "corrupt part $file (sha256 $got, SHA256SUMS says $sum; copy it again)"
        parts+=("$DIR/$file") ;;
      tar) want_tar=$sum ;;
      ''|\#*) ;;
      *) die "SHA256SUMS has an unknown line '$kind $sum $file'" ;;
    esac
  done < "$MANIFEST"
  [ ${#parts[@]} -gt 0 ] || die "SHA256SUMS in $DIR lists no parts"
  EXTRACT=${VELA_WHEELHOUSE_EXTRACT:-$DIR}
  mkdir -p "$EXTRACT" || die "cannot create $EXTRACT"
  tarball="$EXTRACT/$NAME.tar"
  cat "${parts[@]}" > "$tarball" || die "could not reassemble the parts into $tarball (disk full?)"
  if [ -n "$want_tar" ]; then
    got=$(sha256sum "$tarball" | cut -d' ' -f1)
    [ "$got" = "$want_tar" ] || die "the reassembled $tarball does not match SHA256SUMS (parts out of order?)"
  fi
  rm -rf "${EXTRACT:?}/$NAME"
  tar -xf "$tarball" -C "$EXTRACT" 2>/dev/null || die "could not extract $tarball into $EXTRACT"
  rm -f "$tarball"
  WH="$EXTRACT/$NAME"
  [ -f "$WH/constraints.txt" ] || die "$tarball holds no $NAME/constraints.txt (not a vela-ray wheelhouse)"
fi
WH=$(cd "$WH" && pwd)
n_wheels=$(ls "$WH"/*.whl 2>/dev/null | wc -l)
echo "[offline_install] wheelhouse $WH: $n_wheels wheels ($(sed -n 's/^python=//p;s/^platform=//p' "$WH/info.txt" 2>/dev/null | paste -sd' '))"
[ "$EXTRACT_ONLY" = 1 ] && exit 0

# --- 2. the venv, keeping the node's torch -----------------------------------------------------------
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  command -v "$PY" >/dev/null || die "no $PY to create $VENV with (set PYTHON=/path/to/python3.X)"
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[offline_install] creating $VENV on the node's torch $("$PY" -c 'import torch; print(torch.__version__)') (--system-site-packages)"
    "$PY" -m venv --system-site-packages "$VENV" || die "$PY -m venv --system-site-packages $VENV failed"
  else
    "$PY" -m venv "$VENV" || die "$PY -m venv $VENV failed"
  fi
fi
VPY="$VENV/bin/python"
want_py=$(sed -n 's/^python=//p' "$WH/info.txt" 2>/dev/null)
have_py=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "$VPY does not run"
[ -z "$want_py" ] || [ "$want_py" = "$have_py" ] \
  || die "the wheelhouse is for Python $want_py but $VENV has Python $have_py (rebuild it with PY=$have_py)"
"$VPY" -c "import torch" >/dev/null 2>&1 \
  || die "$VENV has no torch and the wheelhouse carries none: install the node's torch first (or give a PYTHON that has it)"

# --- 3. install from the wheelhouse only --------------------------------------------------------------
pins="$WH/constraints.offline.txt"
grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+)==' "$WH/constraints.txt" > "$pins"
log="$VENV/offline_install.log"
echo "[offline_install] installing vela-ray[dev] into $VENV from the wheelhouse (no index; log: $log)"
if ! env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_REQUIREMENT \
     PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
     "$VPY" -m pip install --no-index --find-links "$WH" -c "$pins" "vela-ray[dev]" > "$log" 2>&1; then
  die "pip install failed: $(grep -E '^ERROR' "$log" | head -1 | cut -c1-300) (full log: $log)"
fi
"$VPY" -c "import vela_ray, actors, placement, ray" >>"$log" 2>&1 \
  || die "installed, but 'import vela_ray, actors, placement, ray' fails (see $log)"
echo "[offline_install] done: $VENV ($("$VPY" -c 'import torch, ray; print(f"torch {torch.__version__}, ray {ray.__version__}")' 2>/dev/null))"
