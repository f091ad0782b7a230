#!/usr/bin/env bash
# scripts/ncu-roofline.sh on small ncu --csv files written here: the floors by bytes and by
# issue (two launches of one kernel at different clocks, the bf16 and f16 instantiations in one
# row), prefixed units, the GEMMs' row and the totals, the order by time, the budgets table
# (ranges over launches, the limit and ties, time-weighted occupancy), --launches (a range
# and single IDs, and `layer`: the window found by the norms, before and after a fusion); and
# the refusals (missing file, no metric rows, a launch without a metric, some budget metrics
# only, budgets on some launches only, an unknown unit, a bad
# --copy, a malformed or backwards --launches list, one that selects nothing, a file without the
# layer's norms for `layer`).
# Usage: ncu_roofline_test.sh SCRIPT
set -euo pipefail
script="$1"
# shellcheck source=ncu_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ncu_test_lib.sh"
hdr="$(ncu_header)"
ns='void m3::gpu::<unnamed>::'
{
  echo "==PROF== Connected to process 1 (m3h)"
  echo "$hdr"
  # 100 SMs × 4 schedulers: 400 instructions per cycle. A memory-bound kernel: 2,000,000 bytes
  # at 1000 GB/s = 2 µs; 400,000 instructions at 1 GHz = 1 µs.
  ncu_launch 0 "${ns}copy_kernel<__nv_bfloat16>(long)" '4,000' '2,000,000' '400,000' '1,000,000,000'
  # An issue-bound kernel, two launches: 800,000 instructions at 1 GHz = 2 µs, then at 2 GHz
  # = 1 µs; 1,000,000 bytes = 1 µs each.
  ncu_launch 1 "${ns}walk_kernel<__half, 4>(int)" '5,000' '1,000,000' '800,000' '1,000,000,000'
  ncu_launch 2 "${ns}walk_kernel<__nv_bfloat16, 4>(int)" '3,000' '1,000,000' '800,000' \
    '2,000,000,000'
  ncu_launch 3 'nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT' '9,000' '3,000,000' '5' \
    '1,000,000,000'
} >"$work/run.csv"
out="$(bash "$script" "$work/run.csv" --copy 1000)"
fail() {
  echo "FAIL: $1"
  echo "$out"
  exit 1
}
line() { grep -F -- "  $1" <<<"$out" || fail "no row for $1"; }  # a row ends in its name
[[ "$(line 'walk_kernel<T, 4>' | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}')" == \
   "2 8.0 0.002 0.002 2.0 3.0 3.0 issue 38%" ]] || fail "issue-bound row"
[[ "$(line 'copy_kernel<T>' | awk '{print $1, $2, $5, $6, $7, $8, $9}')" == \
   "1 4.0 2.0 1.0 2.0 bytes 50%" ]] || fail "byte-bound row"
[[ "$(line 'GEMMs (cuBLAS)' | awk '{print $1, $2, $3, $4, $5, $8}')" == \
   "1 9.0 0.003 - 3.0 tensor" ]] || fail "GEMM row"
[[ "$(sed -n 2p <<<"$out")" == *"GEMMs (cuBLAS)" &&
   "$(sed -n 3p <<<"$out")" == *walk_kernel* ]] || fail "rows by time, largest first"
others="$(grep '^kernels but' <<<"$out")"
[[ "$others" == "kernels but the GEMMs: 3 launches, 12.0 us, 0.004 GB, 0.002 Ginst;"* ]] ||
  fail "totals of the other kernels"
[[ "$others" == *"floor 5.0 us (bytes 4.0, issue 4.0, the larger per kernel), at 42%" ]] ||
  fail "floor totals"
[[ "$(grep '^GEMMs' <<<"$out")" == "GEMMs (cuBLAS): 1 launch, 9.0 us"* ]] || fail "GEMM total"
[[ "$(grep '^all kernels' <<<"$out")" == "all kernels: 21.0 us; copy ceiling 1000 GB/s" ]] ||
  fail "all kernels"
[[ "$(tail -n 1 <<<"$out")" == "budgets: not in this profile"* ]] ||
  fail "a profile without launch statistics says it has no budgets"
# Prefixed units give the same figures.
sed -e 's/"dram__bytes.sum","byte","2,000,000"/"dram__bytes.sum","Mbyte","2"/' \
  -e 's/"gpu__time_duration.sum","nsecond","4,000"/"gpu__time_duration.sum","usecond","4"/' \
  -e 's/"cycle\/second","1,000,000,000"/"cycle\/nsecond","1"/' "$work/run.csv" >"$work/units.csv"
[[ "$(bash "$script" "$work/units.csv" --copy 1000)" == "$out" ]] || fail "prefixed units"
# --launches: the walk's two launches alone, then the copy and the GEMM by single IDs.
sub="$(bash "$script" "$work/run.csv" --copy 1000 --launches 1-2)"
[[ "$(grep -c 'walk_kernel<T, 4>' <<<"$sub")" == 1 && "$sub" != *copy_kernel* ]] ||
  fail "--launches 1-2 rows: $sub"
[[ "$(grep '^kernels but' <<<"$sub")" == "kernels but the GEMMs: 2 launches, 8.0 us"* &&
   "$(grep '^GEMMs' <<<"$sub")" == "GEMMs (cuBLAS): 0 launches, 0.0 us"* ]] ||
  fail "--launches 1-2 totals: $sub"
sub="$(bash "$script" "$work/run.csv" --copy 1000 --launches 0,3)"
[[ "$(grep '^all kernels' <<<"$sub")" == "all kernels: 13.0 us; copy ceiling 1000 GB/s" &&
   "$sub" != *walk_kernel* ]] || fail "--launches 0,3: $sub"
expect_refusal "$script" "a malformed --launches" "$work/run.csv" --launches 1-
expect_refusal "$script" "a backwards --launches range" "$work/run.csv" --launches 3-1
expect_refusal "$script" "--launches that selects nothing" "$work/run.csv" --launches 7-9
expect_refusal "$script" "--launches without a list" "$work/run.csv" --launches
expect_refusal "$script" "a missing file" "$work/missing.csv"
echo "no csv here" >"$work/plain.txt"
expect_refusal "$script" "a file without metric rows" "$work/plain.txt"
grep -v '"2",.*smsp__inst_executed' "$work/run.csv" >"$work/lacking.csv"
expect_refusal "$script" "a launch without its instructions" "$work/lacking.csv"
sed 's/"byte"/"fortnight"/' "$work/run.csv" >"$work/unit.csv"
expect_refusal "$script" "an unknown unit" "$work/unit.csv"
expect_refusal "$script" "a bad --copy" "$work/run.csv" --copy fast
expect_refusal "$script" "--copy 0" "$work/run.csv" --copy 0
expect_refusal "$script" "two files" "$work/run.csv" "$work/run.csv"
# The budgets (ncu_budget ID KERNEL THREADS REGS STATIC DYNAMIC LIM_REGS LIM_SMEM LIM_WARPS
# PCT): the same run with ncu's launch statistics. The walk's two launches differ in
# registers, shared memory and what limits them (a range and both limits); the copy is held by
# its registers, the GEMM by registers and shared memory at once (a tie).
{
  cat "$work/run.csv"
  ncu_budget 0 "${ns}copy_kernel<__nv_bfloat16>(long)" 256 40 0 0 6 32 8 70
  # 1024 + 90,000 bytes = 88.9 KiB, 1024 + 60,000 = 59.6 KiB; achieved (20·5 + 30·3) / 8 µs.
  ncu_budget 1 "${ns}walk_kernel<__half, 4>(int)" 256 128 1024 '90,000' 2 2 8 20
  ncu_budget 2 "${ns}walk_kernel<__nv_bfloat16, 4>(int)" 256 96 1024 '60,000' 2 3 8 30
  ncu_budget 3 'nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT' 384 168 0 '200,000' 1 1 5 18
} >"$work/budgets.csv"
out="$(bash "$script" "$work/budgets.csv" --copy 1000)"
[[ "$(grep -c '^budgets per kernel' <<<"$out")" == 1 ]] || fail "no budgets table"
brow() {  # the budget row of kernel $1
  sed -n '/^budgets per kernel/,$p' <<<"$out" | grep -F -- "  $1" || fail "no budget row $1"
}
[[ "$(brow 'copy_kernel<T>' | awk '{print $1, $2, $3, $4, $5, $6, $7, $8}')" == \
   "1 256 40 0.0 6 regs 48 70.0%" ]] || fail "the copy's budgets"
[[ "$(brow 'walk_kernel<T, 4>' | awk '{print $1, $2, $3, $4, $5, $6, $7, $8}')" == \
   "2 256 96-128 59.6-88.9 2 regs=smem/regs 16 23.8%" ]] || fail "the walk's budgets"
[[ "$(brow 'GEMMs (cuBLAS)' | awk '{print $1, $2, $3, $4, $5, $6, $7, $8}')" == \
   "1 384 168 195.3 1 regs=smem 12 18.0%" ]] || fail "the GEMMs' budgets"
[[ "$(sed -n '/^budgets per kernel/,$p' <<<"$out" | sed -n 3p)" == *"GEMMs (cuBLAS)" ]] ||
  fail "budget rows in the order of the time table"
[[ "$(sed -n '1,/^all kernels/p' <<<"$out")" == \
   "$(bash "$script" "$work/run.csv" --copy 1000 | sed -n '1,/^all kernels/p')" ]] ||
  fail "the budgets changed the time table"
[[ "$(bash "$script" "$work/budgets.csv" --copy 1000 --launches 1-2 | grep -c 'walk_kernel')" == \
   2 ]] || fail "--launches keeps the budget rows of its launches"
grep -v '"1",.*launch__occupancy_limit_warps' "$work/budgets.csv" >"$work/some.csv"
expect_refusal "$script" "a launch with some budget metrics" "$work/some.csv"
grep -v '"3",.*\(launch__\|sm__warps_active\)' "$work/budgets.csv" >"$work/mixed.csv"
expect_refusal "$script" "a launch without budgets beside launches with them" "$work/mixed.csv"
sed 's/"register\/thread"/"register\/fortnight"/' "$work/budgets.csv" >"$work/bunit.csv"
expect_refusal "$script" "an unknown unit of a budget metric" "$work/bunit.csv"
# --launches layer: a one-layer forward + backward in miniature (two forward passes, then the
# backward), the layer's launches found by the norms around them: 4-6 and 9-12.
ncu_layer_csv >"$work/layer.csv"
found="$(bash "$script" "$work/layer.csv" --launches layer)"
[[ "$(head -n 1 <<<"$found")" == "launches: 4-6,9-12 (the layer's, found by its norms)" ]] ||
  { echo "FAIL: --launches layer found: $found"; exit 1; }
[[ "$(tail -n +2 <<<"$found")" == "$(bash "$script" "$work/layer.csv" --launches 4-6,9-12)" ]] ||
  { echo "FAIL: --launches layer is not --launches 4-6,9-12: $found"; exit 1; }
# A launch fewer inside the layer's forward (a fusion): the window follows it.
grep -v '^"5",' "$work/layer.csv" | awk -F'","' -v OFS='","' '
  /^"[0-9]+",/ { id = substr($1, 2) + 0; if (id > 5) $1 = "\"" id - 1 } { print }' \
  >"$work/fused.csv"
[[ "$(bash "$script" "$work/fused.csv" --launches layer | head -n 1)" == \
   "launches: 4-5,8-11 (the layer's, found by its norms)" ]] ||
  { echo "FAIL: --launches layer after a fusion"; exit 1; }
expect_refusal "$script" "--launches layer without the layer's norms" "$work/run.csv" \
  --launches layer
grep -v 'convert_kernel' "$work/layer.csv" >"$work/no-convert.csv"
expect_refusal "$script" "--launches layer without δ's copy" "$work/no-convert.csv" \
  --launches layer
expect_refusal "$script" "--launches layer on a missing file" "$work/missing.csv" --launches layer
# --metrics: the five metrics the CSV must hold and the nine budget metrics (what gpu-profile.sh
# and gpu-ab.sh profile with).
m="gpu__time_duration.sum,dram__bytes.sum,smsp__inst_executed.sum"
m+=",sm__cycles_elapsed.avg.per_second,device__attribute_multiprocessor_count"
m+=",launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_static"
m+=",launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers"
m+=",launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps"
m+=",launch__occupancy_limit_blocks,sm__warps_active.avg.pct_of_peak_sustained_active"
[[ "$(bash "$script" --metrics)" == "$m" ]] ||
  { echo "FAIL: --metrics"; exit 1; }
expect_refusal "$script" "--metrics with a CSV" --metrics "$work/run.csv"
echo "ncu-roofline: floors, rows, units, totals, budgets, --launches (lists and layer)" \
  "and refusals checked"
