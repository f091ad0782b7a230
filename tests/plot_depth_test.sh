#!/usr/bin/env bash
# scripts/plot-depth.sh on a real report: the depth table has one line per (cell, direction,
# layer) and a PNG comes out when jq and gnuplot are installed (the file starts with the PNG
# signature; a second run without --force is refused and leaves it, a report without layer rows
# is refused), otherwise the one-line skip note and no file. Usage: plot_depth_test.sh M3H SCRIPT
set -euo pipefail
m3h="$1"
script="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$m3h" compare --device cpu --dtype bf16 --scan chunked --layers 3 --B 1 --T 24 --chunk-size 8 \
  --json "$work/r.json" >/dev/null
out="$(bash "$script" "$work/r.json" "$work/p.png" 2>&1)"
if [[ "$out" == *"skipped:"* ]]; then
  [[ ! -e "$work/p.png" ]] || { echo "FAIL: skipped but wrote a file"; exit 1; }
  echo "plot-depth skipped here ($out): checked the skip path only"
  exit 0
fi
[[ "$(head -c 8 "$work/p.png" | od -An -tx1 | tr -d ' \n')" == "89504e470d0a1a0a" ]] ||
  { echo "FAIL: $work/p.png is not a PNG: $out"; exit 1; }
rows="$(grep -c '^bf16 ' <<<"$out" || true)"
[[ "$rows" == 6 ]] || { echo "FAIL: expected 6 table lines (3 layers x fwd, bwd), got $rows: $out"; exit 1; }
[[ "$out" == *"2 curve(s) over 3 layer(s)"* ]] || { echo "FAIL: $out"; exit 1; }
before="$(md5sum <"$work/p.png")"
if bash "$script" "$work/r.json" "$work/p.png" >/dev/null 2>&1; then
  echo "FAIL: an existing PNG was replaced without --force"
  exit 1
fi
[[ "$(md5sum <"$work/p.png")" == "$before" ]] || { echo "FAIL: the refused run changed the file"; exit 1; }
bash "$script" "$work/r.json" "$work/p.png" --force >/dev/null
"$m3h" compare --device cpu --dtype bf16 --scan chunked --layers 1 --B 1 --T 8 --stage 'grad/*' \
  --json "$work/g.json" >/dev/null
if bash "$script" "$work/g.json" "$work/q.png" >/dev/null 2>&1; then
  echo "FAIL: a report without layer rows was not refused"
  exit 1
fi
echo "plot-depth: table and PNG written, refusals and --force checked"
