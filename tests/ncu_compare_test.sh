#!/usr/bin/env bash
# scripts/ncu-compare.sh on two small ncu --csv files written here: quoted commas in kernel
# names and values, the preamble ncu and the program print, a kernel in one file only, the
# bf16 and f16 instantiations of one kernel in one row, cuBLAS's kernels in one row, the order
# by difference and the totals; and the refusals (missing file, no metric rows, unknown unit).
# Usage: ncu_compare_test.sh SCRIPT
set -euo pipefail
script="$1"
# shellcheck source=ncu_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ncu_test_lib.sh"
hdr="$(ncu_header)"
row() { ncu_row 0 "$1" gpu__time_duration.sum ns "$2"; }  # row KERNEL NS
ns='void m3::gpu::<unnamed>::'
prep_args='(m3::gpu::PrepGeom, m3::gpu::PrepArgs<T1>)'
{
  echo "==PROF== Connected to process 1 (m3h)"
  echo "m3h bench: GPU path"
  echo "$hdr"
  row "${ns}prep_kernel<__nv_bfloat16, 1, 1>$prep_args" '1,000'
  row "${ns}prep_kernel<__nv_bfloat16, 1, 1>$prep_args" '1,000'
  row 'nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT' '3,000'
  row "${ns}gate_kernel<__nv_bfloat16>(long, const T1 *, T1 *)" '500'
  row 'void m3::only_in_a_kernel(int)' '250'
} >"$work/a.csv"
{
  echo "$hdr"
  row "${ns}prep_kernel<__half, 1, 1>$prep_args" '1,500'
  row "${ns}prep_kernel<__half, 1, 1>$prep_args" '1,500'
  row 'nvjet_sm90_hss_320x128_64x3_2x4_h_badd_coopB' '2,000'
  row 'void cutlass::Kernel<cutlass_80_wmma_tensorop_f16>(Params)' '1,100'
  row "${ns}gate_kernel<__half>(long, const T1 *, T1 *)" '520'
} >"$work/b.csv"
out="$(bash "$script" "$work/a.csv" "$work/b.csv" bf16 f16)"
fail() {
  echo "FAIL: $1"
  echo "$out"
  exit 1
}
line() { grep -F -- "$1" <<<"$out" || fail "no row for $1"; }
[[ "$(line 'prep_kernel<T, 1, 1>' | awk '{print $1, $2, $3, $4, $5, $6, $7}')" == \
   "2 2 2.0 3.0 1.0 1.5 +1.0" ]] || fail "prep row"
[[ "$(line 'GEMMs (cuBLAS)' | awk '{print $1, $2, $3, $4, $7}')" == "1 2 3.0 3.1 +0.1" ]] ||
  fail "GEMM row"
[[ "$(line 'only_in_a_kernel' | awk '{print $1, $2, $4, $6, $7}')" == "1 0 0.0 - -0.2" ]] ||
  fail "a kernel of one side only"
[[ "$(sed -n 2p <<<"$out")" == *"prep_kernel<T, 1, 1>"* ]] || fail "largest difference first"
[[ "$(tail -n 1 <<<"$out")" == "total: bf16 5.8 us, f16 6.6 us, f16 - bf16 +0.9 us (+15.1 %)" ]] ||
  fail "totals"
[[ "$(grep -c . <<<"$out")" == 6 ]] || fail "four kernel rows, a header and the totals"
expect_refusal "$script" "a missing file" "$work/a.csv" "$work/missing.csv"
echo "no csv here" >"$work/plain.txt"
expect_refusal "$script" "a file without metric rows" "$work/plain.txt" "$work/b.csv"
sed 's/"ns"/"fortnight"/' "$work/b.csv" >"$work/unit.csv"
expect_refusal "$script" "an unknown time unit" "$work/a.csv" "$work/unit.csv"
expect_refusal "$script" "three arguments" "$work/a.csv" "$work/b.csv" bf16
echo "ncu-compare: rows, merging, order, totals and refusals checked"
