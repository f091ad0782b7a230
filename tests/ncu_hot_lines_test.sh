#!/usr/bin/env bash
# scripts/ncu-hot-lines.sh on a small source page written here (what `ncu --page source --csv
# --print-source sass` prints): two kernels, the first printed twice (ncu does that; the copy is
# skipped), a sample count with a thousands separator, the per-kernel stall shares, the N
# hottest instructions in the kernel's order with their two largest reasons, the straight runs
# (equal executions) with the most warp instructions, the kernel names without casts and
# parameters; and the refusals (missing file, bad N, no samples column).
# Usage: ncu_hot_lines_test.sh SCRIPT
set -euo pipefail
script="$1"
# shellcheck source=ncu_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ncu_test_lib.sh"
hdr='"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"'
walk='"Kernel Name","void m3::gpu::<unnamed>::chunk_walk_tc_kernel<__nv_bfloat16, (int)4, (int)4, (bool)1>(m3::gpu::ChunkGeom, m3::gpu::ChunkWalkArgs)",'
walk_rows() {
  echo "$hdr"
  echo '"0x10","      LDG.E R2, [R4.64]","10","5","1,000","0","2","8","0"'
  echo '"0x20","      FADD R3, R2, R2","1,200","1000","2,000","100","1,100","0","90"'
  echo '"0x30","      BAR.SYNC 0x0","590","500","500","590","0","0","500"'
  echo '"0x40","      EXIT","0","0","500","0","0","0","0"'
}
{
  echo "$walk"
  walk_rows
  echo "$walk"
  walk_rows
  echo '"Kernel Name","void m3::gpu::<unnamed>::qk_rope_bwd_kernel<__half, (bool)1, (bool)0>(m3::gpu::TailGeom)",'
  echo "$hdr"
  echo '"0x10","      HMMA.16816.F32 R0, R4, R8, R0","4","2","100","0","0","4","0"'
} >"$work/page.csv"
out="$(bash "$script" "$work/page.csv" 2)"
fail() {
  echo "FAIL: $1"
  echo "$out"
  exit 1
}
[[ "$(grep -c '^== ' <<<"$out")" == 2 ]] || fail "not two kernels (the repeated block is not skipped)"
grep -qxF '== chunk_walk_tc_kernel<T, 4, 4, 1>: 1800 samples, 0.0 M warp instructions' <<<"$out" ||
  fail "the walk's title line"
grep -qxF '   stall reasons:  long_sb 61.2 %, barrier 38.3 %, wait 0.4 %' <<<"$out" ||
  fail "the walk's stall shares"
# The two hottest of the walk's four, in the kernel's order (rows 2 and 3), not the LDG.
[[ "$(sed -n 3p <<<"$out" | awk '{print $1, $2, $3}')" == "2 1200 66.7" ]] || fail "row 2 first"
grep -q 'long_sb 1100 barrier 100 *FADD R3, R2, R2$' <<<"$out" || fail "row 2's reasons and text"
[[ "$(sed -n 4p <<<"$out" | awk '{print $1, $2}')" == "3 590" ]] || fail "row 3 second"
! grep -q 'LDG.E' <<<"$out" || fail "a third row for N = 2"
grep -qxF '== qk_rope_bwd_kernel<T, 1, 0>: 4 samples, 0.0 M warp instructions' <<<"$out" ||
  fail "the second kernel's title"
# The walk's straight runs (rows of equal executions): row 2 (2000 of the 4000 warp instructions,
# 1200 of the 1800 samples) first, then row 1 and rows 3–4 (1000 each; the earlier first).
runs_of() { sed -n "/^== $1/,/^== /p" <<<"$out" | sed -n '/straight runs/,/^== /p' | grep -v '^=='; }
walk_runs="$(runs_of chunk_walk)"
[[ "$(grep -c 'of instructions' <<<"$walk_runs")" == 3 ]] || fail "not three runs of the walk"
[[ "$(sed -n 2p <<<"$walk_runs" | tr -s ' ')" == " 2-2 1 x 2000 50.0 % of instructions, 66.7 % of samples; FADD 1" ]] ||
  fail "the walk's largest run"
[[ "$(sed -n 3p <<<"$walk_runs" | awk '{print $1, $2, $4}')" == "1-1 1 1000" ]] || fail "row 1's run second"
grep -q '^ *3-4 *2 x 500 *25.0 % of instructions, *32.8 % of samples; ' <<<"$walk_runs" ||
  fail "rows 3-4 as one run"
grep -q 'BAR 1' <<<"$walk_runs" && grep -q 'EXIT 1' <<<"$walk_runs" || fail "the run's opcodes"
grep -q '^ *1-1 *1 x 100 *100.0 % of instructions, *100.0 % of samples; HMMA 1$' <<<"$(runs_of qk_rope)" ||
  fail "the tail's one run"

expect_refusal "$script" "a missing file" "$work/none.csv"
expect_refusal "$script" "N = 0" "$work/page.csv" 0
echo '"a","b"' >"$work/plain.csv"
expect_refusal "$script" "a page without samples" "$work/plain.csv"
echo "ncu-hot-lines.sh: all checks passed"
