#!/usr/bin/env bash
# scripts/plot-positions.sh on a real dump: a PNG when h5dump and gnuplot are installed (the
# file starts with the PNG signature; a second run without --force is refused and leaves it),
# otherwise the one-line skip note and no file. Usage: plot_positions_test.sh M3H SCRIPT
set -euo pipefail
m3h="$1"
script="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$m3h" dump --device cpu --dtype bf16 --stage 'L0/F6/y,grad/L0/d_param' --layers 1 --B 1 --T 40 \
  --chunk-size 16 --out "$work/d.h5" >/dev/null
out="$(bash "$script" "$work/d.h5" "$work/p.png" 2>&1)"
if [[ "$out" == *"skipped:"* ]]; then
  [[ ! -e "$work/p.png" ]] || { echo "FAIL: skipped but wrote a file"; exit 1; }
  echo "plot-positions skipped here ($out): checked the skip path only"
  exit 0
fi
[[ "$(head -c 8 "$work/p.png" | od -An -tx1 | tr -d ' \n')" == "89504e470d0a1a0a" ]] ||
  { echo "FAIL: $work/p.png is not a PNG: $out"; exit 1; }
[[ "$out" == *"2 profile(s)"* ]] || { echo "FAIL: expected 2 profiles (seq, chunked): $out"; exit 1; }
before="$(md5sum <"$work/p.png")"
if bash "$script" "$work/d.h5" "$work/p.png" >/dev/null 2>&1; then
  echo "FAIL: an existing PNG was replaced without --force"
  exit 1
fi
[[ "$(md5sum <"$work/p.png")" == "$before" ]] || { echo "FAIL: the refused run changed the file"; exit 1; }
bash "$script" "$work/d.h5" "$work/p.png" --force >/dev/null
if bash "$script" "$work/d.h5" "$work/q.png" nothing-matches >/dev/null 2>&1; then
  echo "FAIL: a KEY that matches nothing was not refused"
  exit 1
fi
echo "plot-positions: PNG written, refusal and --force checked"
