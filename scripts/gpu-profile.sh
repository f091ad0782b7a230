#!/usr/bin/env bash
# For the GPU machine: where the time goes, in one call (docs/PERF.md keeps the results):
#   build        as scripts/gpu-check.sh (configure + build into build-gpu/, nothing else)
#   marginal     m3h bench, official and official2 (1 and 2 layers), bf16 and f16 chunked: the
#                per-layer figures and the "marginal layer" line (2 layers − 1 layer: a layer
#                without the backbone-level input_proj and norm_f)
#   profile      m3h bench --profile on the official shape (stage times; they include the
#                events' gaps, see docs/log/PERF-history.md)
#   ncu          Nsight Compute on one official bf16 chunked forward+backward: every kernel's
#                time, DRAM bytes, warp instructions and SM clock (ncu-all.csv) and their
#                per-kernel roofline against the copy ceiling the profile measured and one issue
#                per cycle and scheduler (scripts/ncu-roofline.sh: ncu-roofline.txt), then
#                speed-of-light, occupancy, warp-state
#                and instruction statistics of the chunked scan's kernels and the angle scans
#                (ncu-scan.txt); the same forward+backward in f16 (ncu-all-f16.csv) and the
#                per-kernel f16 − bf16 table of scripts/ncu-compare.sh (ncu-f16-vs-bf16.txt)
# Logs under ${OUT:-gpu-logs}/. Needs ncu on the PATH for the last step (skipped otherwise).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS="${OUT:-gpu-logs}"
mkdir -p "$LOGS"
GPU_CHECK_ONLY="nvidia-smi" OUT="$LOGS" bash scripts/gpu-check.sh >"$LOGS/build-summary.txt" 2>&1 || {
  tail -n 20 "$LOGS/build-summary.txt"
  exit 1
}
m3h=build-gpu/tools/m3h
run_bench=("$m3h" bench --no-reference --shapes official --dtype bf16 --scan chunked)
"$m3h" bench --no-reference --shapes official,official2 --dtype bf16,f16 --scan chunked \
  >"$LOGS/marginal.txt" 2>&1
grep -E "^official|^marginal" "$LOGS/marginal.txt"
"${run_bench[@]}" --profile >"$LOGS/profile.txt" 2>&1
grep -E "^official|total" "$LOGS/profile.txt"
if command -v ncu >/dev/null; then
  metrics="$(bash scripts/ncu-roofline.sh --metrics)"
  ncu --clock-control none --print-units base --metrics "$metrics" --csv \
    "${run_bench[@]}" --warmup 0 --repeats 1 >"$LOGS/ncu-all.csv" 2>&1 || true
  copy="$({ grep -o 'copy [0-9]* GB/s' "$LOGS/profile.txt" || true; } | head -n 1 |
    awk '{print $2}')"
  bash scripts/ncu-roofline.sh "$LOGS/ncu-all.csv" ${copy:+--copy "$copy"} \
    >"$LOGS/ncu-roofline.txt" 2>&1 || true
  head -n 16 "$LOGS/ncu-roofline.txt"
  grep -E "^(kernels but|GEMMs \(cuBLAS\):|all kernels)" "$LOGS/ncu-roofline.txt" || true
  # Each kernel's registers, shared memory and blocks per SM (the budgets table of docs/PERF.md).
  sed -n '/^budgets/,$p' "$LOGS/ncu-roofline.txt" | head -n 18
  ncu --clock-control none \
    -k regex:'chunk_bwd_tc|chunk_scan_tc|chunk_state_tc|state_pass|qk_rope_bwd|prep_kernel|angle_' \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section InstructionStats --section LaunchStats --section MemoryWorkloadAnalysis -s 5 -c 11 \
    "${run_bench[@]}" --warmup 0 --repeats 1 >"$LOGS/ncu-scan.txt" 2>&1 || true
  grep -E "^  [a-z_ ]+.*\(|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy" \
    "$LOGS/ncu-scan.txt" | cut -c1-110 || true
  ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes.sum --csv \
    "$m3h" bench --no-reference --shapes official --dtype f16 --scan chunked --warmup 0 \
    --repeats 1 >"$LOGS/ncu-all-f16.csv" 2>&1 || true
  bash scripts/ncu-compare.sh "$LOGS/ncu-all.csv" "$LOGS/ncu-all-f16.csv" bf16 f16 \
    >"$LOGS/ncu-f16-vs-bf16.txt" 2>&1 || true
  head -n 12 "$LOGS/ncu-f16-vs-bf16.txt"
  tail -n 1 "$LOGS/ncu-f16-vs-bf16.txt"
else
  echo "ncu not found: kernel-level step skipped"
fi
