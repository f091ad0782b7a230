#!/usr/bin/env bash
# For the GPU machine: where inside a kernel its warps wait — Nsight Compute's warp-state samples
# per SASS instruction, for the chunked scan's kernels at the official shape (the first launches
# that match, bf16 chunked — M3_SOURCE_DTYPE=f16 for f16 — Recompute none, one forward +
# backward).
#
#   scripts/ncu-source.sh M3H OUTDIR [REGEX]
#     M3H     the m3h to profile
#     OUTDIR  gets profile.log (ncu's own output), source-sass.csv (ncu's source page: per
#             kernel, one row per instruction with its samples by stall reason) and
#             hot-lines.txt (scripts/ncu-hot-lines.sh: per kernel its stall reasons, its
#             instructions with the most samples and its largest straight runs); the report
#             itself, source.ncu-rep, is removed unless M3_KEEP_REPORT=1 (it is large: the
#             device tool brings back little).
#             The build has -lineinfo, so ncu's GUI shows a kept report's samples against the
#             CUDA lines; the CLI's CSV of that page (--print-source cuda) holds only the
#             source text, no metrics (ncu on the H200 machine), so it is not exported.
#     REGEX   the kernels (ncu -k regex:...), default the scan's plane kernels, the tail and
#             the prep
# A missing m3h, an existing OUTDIR/source-sass.csv or no ncu: a one-line error, exit 2; a
# profile ncu cannot take: ncu's status, its log in OUTDIR/profile.log.
set -euo pipefail

die() {
  echo "ncu-source.sh: $*" >&2
  exit 2
}
[[ $# -ge 2 && $# -le 3 ]] || die "usage: ncu-source.sh M3H OUTDIR [REGEX]"
m3h="$1"
out="$2"
regex="${3:-chunk_bwd_tc|chunk_walk_tc|chunk_scan_tc|qk_rope_bwd|prep_kernel}"
[[ -x "$m3h" ]] || die "no executable $m3h"
command -v ncu >/dev/null || die "ncu is not on the PATH"
[[ ! -e "$out/source-sass.csv" ]] || die "$out/source-sass.csv exists (another OUTDIR, or remove it)"
mkdir -p "$out"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

rm -f "$out/source.ncu-rep"
ncu --clock-control none --set full -k "regex:$regex" --launch-count 12 -o "$out/source" \
  "$m3h" bench --no-reference --shapes official --dtype "${M3_SOURCE_DTYPE:-bf16}" \
  --scan chunked --recompute none --warmup 0 --repeats 1 >"$out/profile.log" 2>&1
ncu -i "$out/source.ncu-rep" --page source --csv --print-source sass \
  >"$out/source-sass.csv.tmp" 2>>"$out/profile.log"
mv "$out/source-sass.csv.tmp" "$out/source-sass.csv"
[[ "${M3_KEEP_REPORT:-}" == 1 ]] || rm -f "$out/source.ncu-rep"
bash "$here/ncu-hot-lines.sh" "$out/source-sass.csv" >"$out/hot-lines.txt"
echo "ncu-source.sh: $(grep -c '^== ' "$out/hot-lines.txt") kernels in $out/hot-lines.txt"
