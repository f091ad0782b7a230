# Sourced by the tests of scripts/ncu-*.sh: what ncu --csv writes, and the refusal check.
# Sourcing it makes the test's scratch folder $work, removed when the test exits.
#   ncu_header                       the CSV header line of `ncu --csv --metrics ...`
#   ncu_row ID KERNEL METRIC UNIT VALUE
#                                    one metric row of launch ID
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
