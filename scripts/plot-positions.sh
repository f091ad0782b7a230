#!/usr/bin/env bash
# Renders the error-against-position profiles of an `m3h dump` file to a PNG (docs/HARNESS.md §5):
#
#   bash scripts/plot-positions.sh DUMP.h5 OUT.png [KEY] [--force]
#
# One curve per (scan mode, precision, tensor) with a by_position group in the dump (every
# [B·T, …] tensor it holds; KEY keeps those whose key contains it, e.g. L0/F6/y): rel_l2 of the
# subject against the oracle at each position t, log scale, with a vertical grid line at every
# chunk boundary (the file's /meta chunk_size). It reads the dump with h5ls/h5dump (Debian's
# hdf5-tools) and plots with gnuplot (gnuplot-nox); when either is missing it says so and
# exits 0 without writing anything. OUT is refused when it exists, unless --force.
set -euo pipefail

source "$(dirname -- "${BASH_SOURCE[0]}")/plot-common.sh"
plot_args plot-positions "DUMP.h5 OUT.png [KEY] [--force]" 2 3 "$@"
dump="${args[0]}"
out="${args[1]}"
key="${args[2]:-}"
plot_tools plot-positions "apt-get install hdf5-tools gnuplot-nox" h5ls h5dump gnuplot
[[ -f "$dump" ]] || { echo "plot-positions: error: $dump: no such file" >&2; exit 2; }
plot_out plot-positions "$out"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The profiles the dump holds: /dump/<mode>/<precision>/<key>/by_position.
mapfile -t groups < <(h5ls -r "$dump" | awk '$2 == "Group" && $1 ~ /\/by_position$/ {print $1}')
((${#groups[@]} > 0)) || {
  echo "plot-positions: error: $dump holds no by_position profile (dump a [B*T, ...] tensor)" >&2
  exit 2
}
meta() { h5dump -a "/meta/$1" "$dump" | awk '/\(0\):/ {print $2; exit}'; }
chunk="$(meta chunk_size)"
T="$(meta T)"

plot_cmds=()
n=0
for g in "${groups[@]}"; do
  name="${g#/dump/}"
  name="${name%/by_position}"  # <mode>/<precision>/<key>
  [[ -z "$key" || "$name" == *"$key"* ]] || continue
  n=$((n + 1))
  h5dump -d "$g/rel_l2" -y -w 0 -m "%.9e" -o "$work/raw$n" "$dump" >/dev/null
  tr ',' '\n' <"$work/raw$n" | awk 'NF {print NR - 1, $1}' >"$work/data$n"
  plot_cmds+=("'$work/data$n' using 1:2 with lines lw 1.5 title '${name//_/\\_}'")
done
((n > 0)) || { echo "plot-positions: error: no profile matches '$key'" >&2; exit 2; }

tmp_out="$out.tmp.$$"
trap 'rm -rf "$work" "$tmp_out"' EXIT
{
  echo "set terminal pngcairo size 1400,700 font ',11'"
  echo "set output '$tmp_out'"
  base="$(basename -- "$dump")"
  echo "set title 'rel\\_l2 of the subject against the oracle, per position t (${base//_/\\_})'"
  echo "set xlabel 't (grid: chunk boundaries, chunk\\_size $chunk)'"
  echo "set ylabel 'rel\\_l2 at t (over b and the other axes)'"
  echo "set logscale y"
  echo "set xrange [0:$((T - 1))]"
  echo "set xtics $chunk"
  echo "set grid xtics"
  echo "set key outside right top"
  echo "plot $(IFS=,; echo "${plot_cmds[*]}")"
} >"$work/plot.gp"
gnuplot "$work/plot.gp"
mv -f "$tmp_out" "$out"
echo "plot-positions: wrote $out ($n profile(s) from $dump)"
