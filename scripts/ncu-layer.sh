#!/usr/bin/env bash
# One official forward + backward (bf16 or f16, chunked, recompute none, one repeat) under
# Nsight Compute with ncu-roofline.sh's metrics, then that layer's roofline and budgets:
#   ncu-layer.sh M3H DTYPE PREFIX [--launches LIST|layer] [--copy GBPS]
#   M3H      the m3h binary to profile
#   DTYPE    bf16 or f16
#   PREFIX   writes PREFIX.csv (ncu's output, the program's too) and PREFIX-roofline.txt
#            (scripts/ncu-roofline.sh PREFIX.csv --launches LIST, default layer: the layer's
#            launches found by its norms; --copy passed on)
# gpu-ab.sh --ncu runs it on both sides of an A/B and gpu-check.sh's opt-in roofline step on the
# build (each kernel's time, bytes, floors, registers, shared memory and occupancy).
# Exit status: 2 with one line for bad arguments, a missing binary, ncu missing or an output
# that exists (nothing is overwritten); else ncu's if it failed, else ncu-roofline.sh's.
set -euo pipefail
die() {
  echo "ncu-layer.sh: $*" >&2
  exit 2
}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage="usage: ncu-layer.sh M3H DTYPE PREFIX [--launches LIST|layer] [--copy GBPS]"
(($# >= 3)) || die "$usage"
bin="$1" dtype="$2" prefix="$3"
shift 3
roof=(--launches layer)
while (($#)); do
  case "$1" in
    --launches | --copy)
      (($# >= 2)) || die "$1 needs a value ($usage)"
      roof+=("$1" "$2")
      shift 2
      ;;
    *) die "unknown argument $1 ($usage)" ;;
  esac
done
[[ -x "$bin" ]] || die "no executable m3h at $bin"
[[ "$dtype" == bf16 || "$dtype" == f16 ]] || die "DTYPE must be bf16 or f16, not '$dtype'"
command -v ncu >/dev/null || die "ncu is not on the PATH"
for f in "$prefix.csv" "$prefix-roofline.txt"; do
  [[ ! -e "$f" ]] || die "$f exists (remove it first)"
done
metrics="$(bash "$here/ncu-roofline.sh" --metrics)"
rc=0
ncu --clock-control none --print-units base --metrics "$metrics" --csv \
  "$bin" bench --no-reference --shapes official --dtype "$dtype" --scan chunked \
  --recompute none --warmup 0 --repeats 1 >"$prefix.csv" 2>&1 || rc=$?
((rc == 0)) || { echo "ncu-layer.sh: ncu exited $rc (its output: $prefix.csv)" >&2; exit "$rc"; }
bash "$here/ncu-roofline.sh" "$prefix.csv" "${roof[@]}" >"$prefix-roofline.txt" 2>&1 || {
  rc=$?
  echo "ncu-layer.sh: $(tail -n 1 "$prefix-roofline.txt")" >&2
  exit "$rc"
}
