# Sourced by the tests of scripts/ncu-*.sh: what ncu --csv writes, and the refusal check.
# Sourcing it makes the test's scratch folder $work, removed when the test exits.
#   ncu_header                       the CSV header line of `ncu --csv --metrics ...`
#   ncu_row ID KERNEL METRIC UNIT VALUE
#                                    one metric row of launch ID
#   ncu_launch ID KERNEL NS BYTES INST HZ
#                                    the five roofline metric rows of launch ID (100 SMs)
#   ncu_budget ID KERNEL THREADS REGS STATIC DYNAMIC LIM_REGS LIM_SMEM LIM_WARPS PCT
#                                    its nine budget rows (ncu's block limit 32)
#   ncu_layer_csv                    a one-layer forward + backward in miniature (two forward
#                                    passes, then the backward; every launch 1 µs, 1000 bytes,
#                                    1000 instructions at 1 GHz): the layer is launches 4-6 and
#                                    9-12, as ncu-roofline.sh --launches layer finds them
#   expect_refusal SCRIPT WHAT ARGS...
#                                    `bash SCRIPT ARGS` must fail with exactly one line on
#                                    stdout+stderr, starting "<script's name>:"; else the test
#                                    says what was accepted or what was printed, and exits 1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

ncu_header() {
  local h='"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
  h+='"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
  h+='"Metric Value"'
  echo "$h"
}

ncu_row() {
  printf '"%s","1","m3h","h","%s","1","13","(256, 1, 1)","(8, 1, 1)","0","9.0",' "$1" "$2"
  printf '"Command line profiler metrics","%s","%s","%s"\n' "$3" "$4" "$5"
}

ncu_launch() {
  ncu_row "$1" "$2" gpu__time_duration.sum nsecond "$3"
  ncu_row "$1" "$2" dram__bytes.sum byte "$4"
  ncu_row "$1" "$2" smsp__inst_executed.sum inst "$5"
  ncu_row "$1" "$2" sm__cycles_elapsed.avg.per_second cycle/second "$6"
  ncu_row "$1" "$2" device__attribute_multiprocessor_count "" 100
}

ncu_budget() {
  ncu_row "$1" "$2" launch__block_size "" "$3"
  ncu_row "$1" "$2" launch__registers_per_thread register/thread "$4"
  ncu_row "$1" "$2" launch__shared_mem_per_block_static byte "$5"
  ncu_row "$1" "$2" launch__shared_mem_per_block_dynamic byte/block "$6"
  ncu_row "$1" "$2" launch__occupancy_limit_registers block "$7"
  ncu_row "$1" "$2" launch__occupancy_limit_shared_mem block "$8"
  ncu_row "$1" "$2" launch__occupancy_limit_warps block "$9"
  ncu_row "$1" "$2" launch__occupancy_limit_blocks block 32
  ncu_row "$1" "$2" sm__warps_active.avg.pct_of_peak_sustained_active % "${10}"
}

ncu_layer_csv() {
  local ns='void m3::gpu::<unnamed>::' i=0 k
  local pre="${ns}rmsnorm_forward_kernel<__nv_bfloat16, 32, 1, 0>(int)"
  local norm_f="${ns}rmsnorm_forward_kernel<__nv_bfloat16, 32, 1, 1>(int)"
  local gemm='nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT'
  local walk="${ns}walk_kernel<__nv_bfloat16, 4>(int)"
  ncu_header
  for k in "$pre" "$walk" "$norm_f" "$pre" "$gemm" "$walk" "$norm_f" \
    "${ns}rmsnorm_backward_kernel<float, 32, 1, 0, 1, 0>(int)" \
    "${ns}convert_kernel<float, __nv_bfloat16>(int)" "$gemm" "${ns}copy_kernel<__half>(long)" \
    "${ns}rmsnorm_backward_kernel<__nv_bfloat16, 32, 1, 1, 1, 1>(int)" \
    "m3::colsum_partial_kernel<m3::LoadMatrix>(int)" "$gemm"; do
    ncu_launch "$i" "$k" '1,000' '1,000' '1,000' '1,000,000,000'
    i=$((i + 1))
  done
}

expect_refusal() {
  local script="$1" what="$2" name msg
  shift 2
  name="$(basename "$script")"
  if msg="$(bash "$script" "$@" 2>&1)"; then
    echo "FAIL: $what was accepted"
    exit 1
  fi
  [[ "$(grep -c . <<<"$msg")" == 1 && "$msg" == "$name":* ]] ||
    { echo "FAIL: $what: not one $name line: $msg"; exit 1; }
}
