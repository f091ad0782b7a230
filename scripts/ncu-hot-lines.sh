#!/usr/bin/env bash
# The hot instructions of an Nsight Compute source page: ncu-hot-lines.sh SOURCE.csv [N]
#   SOURCE.csv  `ncu -i REPORT --page source --csv --print-source sass` output: per profiled
#               kernel a "Kernel Name" row, a header row naming the columns, then one row per
#               instruction (or source line) with its warp-state samples, among them "Warp Stall
#               Sampling (All Samples)" and one stall_<reason> column per reason (ncu prints some
#               kernels' blocks twice: a block equal to the one before it is skipped)
#   N           instructions per kernel (default 20)
# Per kernel: its samples (and warp instructions executed, where the page has them), the share
# of each of its six largest stall reasons, and its N instructions with the most samples — row
# (the instruction's place in the kernel), samples, their share, the two largest reasons on it,
# and the instruction's text (90 characters), in the kernel's order. Where the page counts
# executions ("Instructions Executed"), also its five straight runs (consecutive instructions
# executed equally often: in practice a block of straight-line code) with the most warp
# instructions — rows, length × executions, their share of the kernel's warp instructions and of
# its samples, and their five most frequent opcodes (the view that finds, e.g., chunk_bwd_tc's
# per-slot address blocks). Kernel names are written as scripts/ncu-csv.awk's
# kernel_key. POSIX awk (mawk) only.
# A missing file, a bad N, or a page without a samples column: a one-line error, exit 2.
set -euo pipefail

die() {
  echo "ncu-hot-lines.sh: $*" >&2
  exit 2
}
[[ $# -ge 1 && $# -le 2 ]] || die "usage: ncu-hot-lines.sh SOURCE.csv [N]"
[[ -f "$1" && -r "$1" ]] || die "cannot read $1"
n="${2:-20}"
[[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive count, got $n"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

awk -v top="$n" "$(cat "$here/ncu-csv.awk")"'
  # The index of the largest positive val[1..m] not in taken[] (the first of equals), marked
  # taken; 0 if none is left.
  function take_largest(val, m, taken,    i, j, best) {
    best = 0; j = 0
    for (i = 1; i <= m; i++) if (!(i in taken) && val[i] > best) { best = val[i]; j = i }
    if (j) taken[j] = 1
    return j
  }
  # The k largest of val[1..m], as " name share" pairs (names from nm[]).
  function largest(val, nm, m, k, whole, pct,    out, r, j, taken) {
    out = ""
    for (r = 1; r <= k; r++) {
      if (!(j = take_largest(val, m, taken))) break
      if (pct) out = out sprintf("%s %s %.1f %%", out == "" ? "" : ",", nm[j], 100 * val[j] / whole)
      else out = out sprintf(" %s %d", nm[j], val[j])
    }
    return out
  }
  # The opcode of an instruction text: no predicate, no modifiers (IMAD.WIDE.U32 → IMAD).
  function opcode(t,    w) {
    sub(/^@!?U?P[T0-9]+[ \t]+/, "", t)
    split(t, w, /[ \t]+/)
    sub(/\..*$/, "", w[1])
    return w[1]
  }
  # The straight runs of rows 1..rows (equal executions, > 0), the five with the most warp
  # instructions, in that order.
  function runs(    i, a, m, rs0, re0, rw, k, bj, used, ops, on, cnt, o, r, s0) {
    m = 0; a = 1
    for (i = 2; i <= rows + 1; i++) {
      if (i <= rows && exe[i] == exe[a]) continue
      if (exe[a] > 0) { m++; rs0[m] = a; re0[m] = i - 1; rw[m] = (i - a) * exe[a] }
      a = i
    }
    if (m == 0 || inst <= 0) return
    print "   straight runs with the most warp instructions:"
    for (k = 1; k <= 5; k++) {
      if (!(bj = take_largest(rw, m, used))) break
      s0 = 0
      for (o in ops) delete ops[o]
      for (i = rs0[bj]; i <= re0[bj]; i++) { ops[opcode(txt[i])]++; s0 += smp[i] }
      for (o in on) delete on[o]
      r = 0
      for (o in ops) { r++; on[r] = o; cnt[r] = ops[o] }
      printf "%7d-%-7d %5d x %-9d %5.1f %% of instructions, %5.1f %% of samples;%s\n",
             rs0[bj], re0[bj], re0[bj] - rs0[bj] + 1, exe[rs0[bj]], 100 * rw[bj] / inst,
             (total > 0 ? 100 * s0 / total : 0), largest(cnt, on, r, 5, 0, 0)
      for (i = 1; i <= r; i++) delete cnt[i]
    }
  }
  function flush(    key, i, k, used, r) {
    if (!rows) return
    key = title SUBSEP total SUBSEP rows
    if (key != last_key) {
      last_key = key
      printf "== %s: %d samples", title == "" ? "(kernel)" : title, total
      if (ic) printf ", %.1f M warp instructions", inst / 1e6
      printf "\n   stall reasons: %s\n", (total > 0 ? largest(ksum, rname, nr, 6, total, 1) : "-")
      for (k = 1; k <= top; k++) if (!take_largest(smp, rows, used)) break
      for (i = 1; i <= rows; i++) {
        if (!(i in used)) continue
        for (r = 1; r <= nr; r++) one[r] = rs[i, r]
        printf "%7d %8d %5.1f %%%-34s  %s\n", i, smp[i], 100 * smp[i] / total,
               largest(one, rname, nr, 2, total, 0), substr(txt[i], 1, 90)
      }
      if (ic) runs()
    }
    rows = 0; total = 0; inst = 0
    for (i in ksum) delete ksum[i]
  }
  {
    sub(/\r$/, "")
    nf = split_csv($0, f)
    if (f[1] == "Kernel Name") {  # template arguments lose their casts: (int)4 → 4
      flush()
      k = f[2]
      gsub(/\((bool|int|unsigned int|long|unsigned long)\)/, "", k)
      pend = kernel_key(k)
      next
    }
    hdr = 0
    for (i = 1; i <= nf; i++) if (f[i] == "Warp Stall Sampling (All Samples)") hdr = i
    if (hdr) {
      flush()
      title = pend
      sc = hdr; tc = 0; ic = 0; nr = 0
      for (i = 1; i <= nf; i++) {
        if (f[i] == "Source") tc = i
        if (f[i] == "Instructions Executed") ic = i
        if (f[i] ~ /^stall_/ && f[i] !~ /Not Issued/) {
          rc[++nr] = i
          rname[nr] = substr(f[i], 7)
        }
      }
      seen = 1
      next
    }
    if (!seen || nf < sc) next
    rows++
    smp[rows] = csv_value(f[sc])
    total += smp[rows]
    exe[rows] = ic ? csv_value(f[ic]) : 0
    inst += exe[rows]
    t = tc ? f[tc] : ""
    gsub(/^[ \t]+|[ \t]+$/, "", t)
    txt[rows] = t
    for (i = 1; i <= nr; i++) { rs[rows, i] = csv_value(f[rc[i]]); ksum[i] += rs[rows, i] }
  }
  END {
    flush()
    if (!seen) {
      print "ncu-hot-lines.sh: no \"Warp Stall Sampling (All Samples)\" column in " FILENAME > "/dev/stderr"
      exit 2
    }
  }
' "$1"
