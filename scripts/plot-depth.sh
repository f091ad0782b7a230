#!/usr/bin/env bash
# The error against depth of an `m3h compare --json` report (docs/HARNESS.md §11): per layer ℓ,
# the subject's rel_l2 against the oracle of what the layer hands on — forward, its output
# Lℓ/F8/layer_output; backward, the gradient it hands to the layer below, Lℓ/B1/d_temporal — and
# the share of the budget used, for every (precision, scan mode) end-to-end cell of the report.
# Prints the table (one line per layer) and renders it to a PNG, rel_l2 on a log scale against
# the layer, one curve per (cell, direction):
#
#   bash scripts/plot-depth.sh REPORT.json OUT.png [--force]
#
# Reads the JSON with jq and plots with gnuplot (gnuplot-nox); when either is missing it says so
# and exits 0 without writing anything. OUT is refused when it exists, unless --force.
set -euo pipefail

source "$(dirname -- "${BASH_SOURCE[0]}")/plot-common.sh"
plot_args plot-depth "REPORT.json OUT.png [--force]" 2 2 "$@"
report="${args[0]}"
out="${args[1]}"
plot_tools plot-depth "apt-get install jq gnuplot-nox" jq gnuplot
[[ -f "$report" ]] || { echo "plot-depth: error: $report: no such file" >&2; exit 2; }
plot_out plot-depth "$out"
jq -e '.schema | startswith("m3h-compare/")' "$report" >/dev/null 2>&1 ||
  { echo "plot-depth: error: $report is not an m3h compare --json report" >&2; exit 2; }

work="$(mktemp -d)"
tmp_out="$out.tmp.$$"
trap 'rm -rf "$work" "$tmp_out"' EXIT

# One line per (precision, mode, direction, layer): rel_l2 and the budget share in %.
jq -r '.cells[]
  | select(.compare_mode == "e2e" and .metrics != null and .layer >= 0)
  | select(.key | test("^L[0-9]+/(F8/layer_output|B1/d_temporal)$"))
  | [.precision, .mode, (if .stage == "F8" then "fwd" else "bwd" end), .layer,
     .metrics.rel_l2, (.pct // 0), .status] | @tsv' "$report" | sort -k1,1 -k2,2 -k3,3 -k4,4n \
  >"$work/rows.tsv"
[[ -s "$work/rows.tsv" ]] ||
  { echo "plot-depth: error: $report has no end-to-end layer_output or d_temporal rows" >&2; exit 2; }

printf '%-5s %-8s %-4s %5s %11s %9s  %s\n' precision mode dir layer rel_l2 "%budget" status
awk -F'\t' '{printf "%-5s %-8s %-4s %5d %11.3e %8.1f%%  %s\n", $1, $2, $3, $4, $5, $6, $7}' \
  "$work/rows.tsv"

# One data file per curve, and the plot command naming them.
mapfile -t curves < <(cut -f1-3 "$work/rows.tsv" | sort -u)
plot=""
i=0
for c in "${curves[@]}"; do
  IFS=$'\t' read -r p m d <<<"$c"
  f="$work/c$i.dat"
  awk -F'\t' -v p="$p" -v m="$m" -v d="$d" '$1 == p && $2 == m && $3 == d {print $4, $5}' \
    "$work/rows.tsv" >"$f"
  what="$([[ "$d" == fwd ]] && echo "layer output" || echo "gradient handed down")"
  plot+="${plot:+, }'$f' using 1:2 with linespoints title '$p $m: $what'"
  i=$((i + 1))
done
layers="$(cut -f4 "$work/rows.tsv" | sort -n | tail -1)"
gnuplot <<EOF
set terminal pngcairo size 1000,600 font ",10" noenhanced
set output "$tmp_out"
set title "error against depth: rel_l2 of the subject against the oracle, per layer"
set xlabel "layer"
set ylabel "rel_l2"
set logscale y
set format y "%.0e"
set xrange [-0.5:$layers + 0.5]
set xtics 1
set key outside bottom center
set grid
plot $plot
EOF
mv -f "$tmp_out" "$out"
echo "plot-depth: ${#curves[@]} curve(s) over $((layers + 1)) layer(s) written to $out"
