#!/usr/bin/env bash
# Per-kernel comparison of two Nsight Compute runs of the same work (e.g. the bf16 and the f16
# path, or two commits): ncu-compare.sh A.csv B.csv [LABEL_A LABEL_B]
#   A.csv, B.csv   `ncu --metrics gpu__time_duration.sum --csv ...` output (ncu's own lines and
#                  the program's output before the CSV are skipped)
# Prints one row per kernel — launches, total µs and µs per launch on each side, and the
# difference of the totals — sorted by the size of the difference, then the totals. Kernel names
# are compared without their parameter lists, with the 16-bit storage types (__nv_bfloat16,
# __half) written T, so that a kernel's bf16 and f16 instantiations share a row; cuBLAS's
# kernels (nvjet, cutlass, gemm, cublasLt) are one row, "GEMMs (cuBLAS)", since the library
# picks other kernels per type (scripts/ncu-csv.awk reads the CSV). POSIX awk (mawk) only.
# A missing or unreadable file, one without gpu__time_duration.sum rows, or a time unit other
# than ns, us or ms: a one-line error, exit 2.
set -euo pipefail

die() {
  echo "ncu-compare.sh: $*" >&2
  exit 2
}
[[ $# -eq 2 || $# -eq 4 ]] || die "usage: ncu-compare.sh A.csv B.csv [LABEL_A LABEL_B]"
for f in "$1" "$2"; do
  [[ -f "$f" && -r "$f" ]] || die "cannot read $f"
done
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
label_a="${3:-A}"
label_b="${4:-B}"

# kernels FILE: "name<TAB>µs" per launch, from the rows whose metric is gpu__time_duration.sum.
kernels() {
  awk "$(cat "$here/ncu-csv.awk")"'
    /^"/ {
      n = split_csv($0, f)
      if (!hdr) { csv_header(f, n); hdr = 1; next }
      if (!kc || !mc || !vc || f[mc] != "gpu__time_duration.sum") next
      u = uc ? f[uc] : ""
      s = unit_scale(u, "time")
      if (s < 0) { bad = u == "" ? "(none)" : u; exit }
      printf "%s\t%.3f\n", kernel_key(f[kc]), csv_value(f[vc]) * s
      rows++
    }
    END {
      if (bad != "") { print "time unit " bad > "/dev/stderr"; exit 4 }
      if (!rows) exit 3
    }
  ' "$1"
}

for side in a b; do
  f="$1"
  [[ "$side" == b ]] && f="$2"
  rows="$(kernels "$f" 2>/dev/null)" ||
    die "$f: no gpu__time_duration.sum rows in ns, us or ms (ncu --csv output expected)"
  printf -v "${side}_rows" '%s' "$rows"
done

{
  printf '%s\n' "$a_rows" | sed 's/^/A\t/'
  printf '%s\n' "$b_rows" | sed 's/^/B\t/'
} | awk -F '\t' -v la="$label_a" -v lb="$label_b" '
  { key[$2] = 1; n[$1, $2]++; t[$1, $2] += $3; tot[$1] += $3 }
  END {
    m = 0
    for (k in key) { m++; name[m] = k; d[m] = t["B", k] - t["A", k] }
    for (i = 2; i <= m; i++) {                # insertion sort by |difference|, largest first
      j = i; kn = name[i]; kd = d[i]
      while (j > 1 && (d[j - 1] < 0 ? -d[j - 1] : d[j - 1]) < (kd < 0 ? -kd : kd)) {
        name[j] = name[j - 1]; d[j] = d[j - 1]; j--
      }
      name[j] = kn; d[j] = kd
    }
    printf "%-9s %-9s %10s %10s %9s %9s %10s  %s\n", "n " la, "n " lb, "us " la, "us " lb,
           "per " la, "per " lb, lb " - " la, "kernel"
    for (i = 1; i <= m; i++) {
      k = name[i]; na = n["A", k] + 0; nb = n["B", k] + 0
      printf "%-9d %-9d %10.1f %10.1f %9s %9s %+10.1f  %s\n", na, nb, t["A", k], t["B", k],
             na ? sprintf("%.1f", t["A", k] / na) : "-", nb ? sprintf("%.1f", t["B", k] / nb) : "-",
             d[i], k
    }
    pct = tot["A"] ? 100 * (tot["B"] - tot["A"]) / tot["A"] : 0
    printf "total: %s %.1f us, %s %.1f us, %s - %s %+.1f us (%+.1f %%)\n", la, tot["A"], lb,
           tot["B"], lb, la, tot["B"] - tot["A"], pct
  }'
