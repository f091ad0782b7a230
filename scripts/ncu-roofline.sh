#!/usr/bin/env bash
# Per-kernel roofline of one Nsight Compute run (docs/PERF.md's tables):
#   ncu-roofline.sh CSV [--copy GBPS] [--launches LIST|layer] | ncu-roofline.sh --metrics
#   CSV      `ncu --print-units base --csv --metrics "$(ncu-roofline.sh --metrics)" ...` output
#            (scripts/gpu-profile.sh and gpu-ab.sh --ncu take it; ncu's own lines and the
#            program's output before the CSV are skipped)
#   --metrics  prints the metrics it reads, comma-separated, and exits: gpu__time_duration.sum,
#            dram__bytes.sum, smsp__inst_executed.sum, sm__cycles_elapsed.avg.per_second,
#            device__attribute_multiprocessor_count (required), then the nine budget metrics
#            (launch__block_size, launch__registers_per_thread,
#            launch__shared_mem_per_block_static and _dynamic, launch__occupancy_limit_registers,
#            _shared_mem, _warps and _blocks, sm__warps_active.avg.pct_of_peak_sustained_active)
#   --copy   the copy ceiling in GB/s, bytes read plus written per second (`m3h bench
#            --ceilings`; default 4262, the H200's measured figure in PERF.md)
#   --launches  only these launches (ncu's ID column, from 0 in launch order): IDs and
#            inclusive ranges, comma-separated, e.g. 21-32,36-66 (the layer's launches of a
#            one-layer run); default every launch.
#            `--launches layer` finds the layer's launches of a one-layer forward + backward
#            (gpu-ab.sh --ncu's run) by the norms around them, so that a change that adds or
#            removes a launch inside the layer keeps its window: the forward from the launch
#            after the last
#            rmsnorm_forward_kernel<…, 0> (the pre-norm of the last pass) through the next
#            rmsnorm_forward_kernel<…, 1> (norm_f, the residual add folded in); the backward
#            from the launch after the next convert_kernel<float, …> (δ's typed copy) through the
#            launch after the last rmsnorm_backward_kernel (the layer's norm backward and its
#            weight's column sum). It prints the IDs it found first ("launches: …"); a file
#            without those kernels in that order is refused.
# One row per kernel (its launches summed; named as scripts/ncu-compare.sh names them): launches,
# µs, DRAM GB, warp instructions, and two floors, each per launch and summed:
#   bytes   DRAM bytes / copy ceiling
#   issue   warp instructions / (SMs × 4 schedulers × one instruction per cycle × the launch's
#           SM clock)
# floor = the larger, bound = which one, at = floor / µs. cuBLAS's GEMMs (one row) run on the
# tensor cores, where an instruction is many FLOPs, so their issue floor means nothing: their
# row gives time and bytes, and m3h bench --profile's TFLOP/s says how near their FLOP ceiling
# they run. Rows by time, largest first; then the totals of every other kernel (time, floors) and
# the GEMMs' time.
# Then, where the profile has ncu's launch statistics (the nine budget metrics --metrics lists
# after the five above; launch__* cost no replay), each kernel's budgets in the same order:
#   threads  block size;  regs  registers per thread;  smem_KB  shared memory per block, static
#   + dynamic, in KiB;  blk/SM  blocks per SM the launch allows, the least of ncu's four limits;
#   limit  which of them sets it (regs, smem, warps, blocks; ties joined by '=');  warps  blk/SM ×
#   threads / 32, of the SM's 64;  achieved  sm__warps_active as % of 64, time-weighted over the
#   launches. A value that differs between a kernel's launches prints as its range, lo-hi.
# POSIX awk (mawk) only; scripts/ncu-csv.awk reads the CSV.
# A missing or unreadable file, no gpu__time_duration.sum rows, a launch without one of the five
# metrics or with some but not all of the nine, an unknown unit, a bad --copy, a malformed
# --launches list or one that selects no launch of the file: a one-line error, exit 2. A profile
# without the nine gets one line saying the budgets are not in it.
set -euo pipefail

die() {
  echo "ncu-roofline.sh: $*" >&2
  exit 2
}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
csv=""
copy=4262
launches=""
usage="usage: ncu-roofline.sh CSV [--copy GBPS] [--launches LIST|layer] | ncu-roofline.sh --metrics"
metrics=(gpu__time_duration.sum dram__bytes.sum smsp__inst_executed.sum
  sm__cycles_elapsed.avg.per_second device__attribute_multiprocessor_count
  launch__block_size launch__registers_per_thread launch__shared_mem_per_block_static
  launch__shared_mem_per_block_dynamic launch__occupancy_limit_registers
  launch__occupancy_limit_shared_mem launch__occupancy_limit_warps launch__occupancy_limit_blocks
  sm__warps_active.avg.pct_of_peak_sustained_active)
if [[ $# -eq 1 && "$1" == --metrics ]]; then
  (IFS=,; echo "${metrics[*]}")
  exit 0
fi
while (($#)); do
  case "$1" in
    --copy)
      (($# >= 2)) || die "--copy needs a value in GB/s"
      copy="$2"
      shift 2
      ;;
    --launches)
      (($# >= 2)) ||
        die "--launches needs a list of launch IDs and ranges (e.g. 21-32,36-66) or layer"
      launches="$2"
      shift 2
      ;;
    -*) die "unknown option $1 ($usage)" ;;
    *)
      [[ -z "$csv" ]] || die "one CSV file only (got $csv and $1)"
      csv="$1"
      shift
      ;;
  esac
done
[[ -n "$csv" ]] || die "$usage"
[[ "$copy" =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v c="$copy" 'BEGIN { exit !(c > 0) }' ||
  die "--copy must be a positive number of GB/s, not '$copy'"
if [[ "$launches" == layer ]]; then
  [[ -f "$csv" && -r "$csv" ]] || die "cannot read $csv"
  # The launches in ID order with their row names, then the anchors of the header's rule.
  launches="$(awk "$(cat "$here/ncu-csv.awk")"'
    /^"/ {
      n = split_csv($0, f)
      if (!hdr) { csv_header(f, n); hdr = 1; next }
      if (!kc || !ic) exit 2
      id = f[ic] + 0
      if (!(id in name)) { name[id] = kernel_key(f[kc]); if (id > last) last = id }
    }
    END {
      if (!hdr) exit 2
      pre = -1
      for (i = 0; i <= last; i++) if (name[i] ~ /^rmsnorm_forward_kernel<.*, 0>$/) pre = i
      if (pre < 0) exit 3
      for (fe = pre + 1; fe <= last && name[fe] !~ /^rmsnorm_forward_kernel<.*, 1>$/; fe++) ;
      if (fe > last) exit 4
      for (cv = fe + 1; cv <= last && name[cv] !~ /^convert_kernel<float, /; cv++) ;
      if (cv > last) exit 5
      nb = -1
      for (i = cv + 1; i <= last; i++) if (name[i] ~ /^rmsnorm_backward_kernel</) nb = i
      if (nb < 0 || nb + 1 > last) exit 6
      print pre + 1 "-" fe "," cv + 1 "-" nb + 1
    }' "$csv")" || case $? in
    2) die "--launches layer: $csv has no ncu --csv header with ID and Kernel Name" ;;
    3) die "--launches layer: no rmsnorm_forward_kernel<…, 0> (the layer's pre-norm) in $csv" ;;
    4) die "--launches layer: no rmsnorm_forward_kernel<…, 1> (norm_f)" \
      "after the last pre-norm in $csv" ;;
    5) die "--launches layer: no convert_kernel<float, …> (δ's typed copy)" \
      "after norm_f in $csv" ;;
    6) die "--launches layer: no rmsnorm_backward_kernel with a launch after it," \
      "after δ's copy, in $csv" ;;
    *) die "--launches layer: reading $csv failed" ;;
  esac
  echo "launches: $launches (the layer's, found by its norms)"
fi
if [[ -n "$launches" ]]; then
  [[ "$launches" =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] ||
    die "--launches takes launch IDs and ranges like 21-32,36-66, or layer, not '$launches'"
  IFS=, read -ra parts <<<"$launches"
  for part in "${parts[@]}"; do
    [[ "$part" != *-* ]] || ((10#${part%-*} <= 10#${part#*-})) ||
      die "--launches: the range $part runs backwards"
  done
fi
[[ -f "$csv" && -r "$csv" ]] || die "cannot read $csv"

awk -v copy="$copy" -v launches="$launches" -v metric_names="${metrics[*]}" \
  "$(cat "$here/ncu-csv.awk")"'
  function fail(msg) { err = msg; exit 2 }
  function wanted(id,    j) {  # id in --launches (every launch without it)
    if (launches == "") return 1
    for (j = 1; j <= nsel; j++)
      if (id + 0 >= lo[j] && id + 0 <= hi[j]) return 1
    return 0
  }
  function budget_scale(u, slot,    p) {  # the budget metrics: bytes as counts, the rest plain
    p = u
    if (slot == "ss" || slot == "sd") { sub(/\/block$/, "", p); return unit_scale(p, "count") }  # byte or byte/block
    if (u == "" || (slot == "rg" && u == "register/thread") || (slot ~ /^l/ && u == "block") ||
        (slot == "wa" && u == "%")) return 1
    return -1
  }
  function span(k, what, v) {  # the least and largest v over the launches of kernel k
    if (!((k, what) in LO) || v < LO[k, what]) LO[k, what] = v
    if (!((k, what) in HI) || v > HI[k, what]) HI[k, what] = v
  }
  function range(k, what, fmt) {  # one value, or lo-hi where the launches differ
    return LO[k, what] == HI[k, what] ? sprintf(fmt, LO[k, what]) \
                                      : sprintf(fmt "-" fmt, LO[k, what], HI[k, what])
  }
  BEGIN {
    # The budget metrics: the list of --metrics after the five required ones, in this order;
    # the four block limits and their names in the limit column.
    nbs = split("bs rg ss sd lr ls lw lb wa", bslots, " ")
    split(metric_names, all_names, " ")
    for (q = 1; q <= nbs; q++) { bnames[q] = all_names[5 + q]; budget_slot[bnames[q]] = bslots[q] }
    split("lr ls lw lb", lslots, " ")
    split("regs smem warps blocks", lnames, " ")
    nsel = split(launches, sel, ",")  # --launches as ranges [lo[j], hi[j]], parsed once
    for (j = 1; j <= nsel; j++) {
      if (split(sel[j], rg, "-") == 1) rg[2] = rg[1]
      lo[j] = rg[1] + 0; hi[j] = rg[2] + 0
    }
  }
  /^"/ {
    n = split_csv($0, f)
    if (!hdr) { csv_header(f, n); hdr = 1; next }
    if (!kc || !mc || !vc || !ic) fail("no ID, Kernel Name, Metric Name or Metric Value column")
    m = f[mc]; u = uc ? f[uc] : ""; id = f[ic]
    if (m == "gpu__time_duration.sum") { kind = "time"; slot = "t" }
    else if (m == "dram__bytes.sum") { kind = "count"; slot = "b" }
    else if (m == "smsp__inst_executed.sum") { kind = "count"; slot = "i" }
    else if (m == "sm__cycles_elapsed.avg.per_second") { kind = "rate"; slot = "c" }
    else if (m == "device__attribute_multiprocessor_count") { kind = "count"; slot = "s" }
    else if (m in budget_slot) { kind = "budget"; slot = budget_slot[m] }
    else next
    s = kind == "budget" ? budget_scale(u, slot) : unit_scale(u, kind)
    if (s < 0) fail("unknown unit \"" u "\" of " m)
    if (!wanted(id)) { seen++; next }
    if (!(id in key)) { key[id] = kernel_key(f[kc]); ids[++nid] = id }
    val[id, slot] = csv_value(f[vc]) * s
    has[id, slot] = 1
    if (slot == "t") rows++
  }
  END {
    if (!rows && err == "" && seen)
      err = "--launches " launches " selects no launch of the file"
    if (!rows && err == "") err = "no gpu__time_duration.sum rows (ncu --csv output expected)"
    if (err != "") { print "ncu-roofline.sh: " err > "/dev/stderr"; exit 2 }
    split("t b i c s", slots, " ")
    split(metric_names, names, " ")  # the metric of each slot, in the order of slots[]
    for (j = 1; j <= nid; j++) {
      id = ids[j]; k = key[id]
      for (q = 1; q <= 5; q++)
        if (!has[id, slots[q]]) {
          print "ncu-roofline.sh: launch " id " (" k ") has no " names[q] \
                " (profile with the metrics of the header)" > "/dev/stderr"
          exit 2
        }
      if (val[id, "c"] <= 0 || val[id, "s"] <= 0) {
        print "ncu-roofline.sh: launch " id " (" k ") has no SM clock or SM count" > "/dev/stderr"
        exit 2
      }
      nb = 0; miss = ""
      for (q = 1; q <= nbs; q++)
        if (has[id, bslots[q]]) nb++; else miss = miss (miss == "" ? "" : ", ") bnames[q]
      if (nb > 0 && nb < nbs) {
        print "ncu-roofline.sh: launch " id " (" k ") has some budget metrics but not " miss \
              " (profile with the metrics of the header)" > "/dev/stderr"
        exit 2
      }
      if (nb) {
        budgets++
        for (q = 1; q <= 4; q++) {  # blocks per SM: the least limit, ties named together
          v = val[id, lslots[q]]
          if (q == 1 || v < blk) { blk = v; lim = lnames[q] }
          else if (v == blk) lim = lim "=" lnames[q]
        }
        span(k, "threads", val[id, "bs"])
        span(k, "regs", val[id, "rg"])
        span(k, "smem", (val[id, "ss"] + val[id, "sd"]) / 1024)
        span(k, "blocks", blk)
        span(k, "warps", blk * val[id, "bs"] / 32)
        if (!(k in bcnt)) blim[k] = lim
        else if (index("/" blim[k] "/", "/" lim "/") == 0) blim[k] = blim[k] "/" lim
        bcnt[k]++
        WA[k] += val[id, "wa"] * val[id, "t"]; WT[k] += val[id, "t"]
      }
      if (!(k in cnt)) order[++nk] = k
      cnt[k]++
      T[k] += val[id, "t"]; B[k] += val[id, "b"]; I[k] += val[id, "i"]
      FB[k] += val[id, "b"] / (copy * 1e9) * 1e6
      FI[k] += val[id, "i"] / (val[id, "s"] * 4 * val[id, "c"]) * 1e6
    }
    if (budgets && budgets < nid) {
      print "ncu-roofline.sh: " nid - budgets " of " nid " launches have no budget metrics" \
            " (profile with the metrics of the header)" > "/dev/stderr"
      exit 2
    }
    for (a = 2; a <= nk; a++) {               # insertion sort by time, largest first
      kn = order[a]; b = a
      while (b > 1 && T[order[b - 1]] < T[kn]) { order[b] = order[b - 1]; b-- }
      order[b] = kn
    }
    printf "%5s %10s %8s %8s %9s %9s %9s %-6s %6s  %s\n", "n", "us", "GB", "Ginst",
           "bytes_us", "issue_us", "floor_us", "bound", "at", "kernel"
    for (a = 1; a <= nk; a++) {
      k = order[a]
      if (k == "GEMMs (cuBLAS)") {
        printf "%5d %10.1f %8.3f %8s %9.1f %9s %9s %-6s %6s  %s\n", cnt[k], T[k], B[k] / 1e9,
               "-", FB[k], "-", "-", "tensor", "-", k
        gt += T[k]; gn += cnt[k]
        continue
      }
      fl = FB[k] > FI[k] ? FB[k] : FI[k]
      printf "%5d %10.1f %8.3f %8.3f %9.1f %9.1f %9.1f %-6s %5.0f%%  %s\n", cnt[k], T[k],
             B[k] / 1e9, I[k] / 1e9, FB[k], FI[k], fl, (FB[k] >= FI[k] ? "bytes" : "issue"),
             (T[k] > 0 ? 100 * fl / T[k] : 0), k
      ot += T[k]; on += cnt[k]; ob += FB[k]; oi += FI[k]; of += fl; oB += B[k]; oI += I[k]
    }
    printf "kernels but the GEMMs: %d launch%s, %.1f us, %.3f GB, %.3f Ginst; floor %.1f us " \
           "(bytes %.1f, issue %.1f, the larger per kernel), at %.0f%%\n", on,
           (on == 1 ? "" : "es"), ot, oB / 1e9, oI / 1e9, of, ob, oi, (ot > 0 ? 100 * of / ot : 0)
    printf "GEMMs (cuBLAS): %d launch%s, %.1f us (their FLOP rate: m3h bench --profile)\n", gn,
           (gn == 1 ? "" : "es"), gt
    printf "all kernels: %.1f us; copy ceiling %s GB/s\n", ot + gt, copy
    if (!budgets) {
      print "budgets: not in this profile (its launches have no launch__* metrics)"
      exit 0
    }
    printf "budgets per kernel (ncu launch statistics; warps of 64 per SM):\n"
    printf "%5s %9s %9s %13s %7s %-14s %9s %8s  %s\n", "n", "threads", "regs", "smem_KB",
           "blk/SM", "limit", "warps", "achieved", "kernel"
    for (a = 1; a <= nk; a++) {
      k = order[a]
      printf "%5d %9s %9s %13s %7s %-14s %9s %7.1f%%  %s\n", bcnt[k], range(k, "threads", "%d"),
             range(k, "regs", "%d"), range(k, "smem", "%.1f"), range(k, "blocks", "%d"),
             blim[k], range(k, "warps", "%d"), (WT[k] > 0 ? WA[k] / WT[k] : 0), k
    }
  }
' "$csv" || exit 2
