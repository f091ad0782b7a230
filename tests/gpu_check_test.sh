#!/usr/bin/env bash
# scripts/gpu-check.sh's orchestration, with stand-ins for cmake, ctest, compute-sanitizer, m3h
# and the probe (each logs when it starts and ends, and m3h fails where $FAKE_FAIL matches its
# arguments): every step is run and named in the summary with its seconds, in order and one at
# a time by default; with GPU_CHECK_PARALLEL=1 the four checking lanes overlap and the timing
# steps start only after every lane has finished; a failing step in a lane is a FAIL line and
# exit status 1, the other steps still run; under GPU_CHECK_DEADLINE a step still running is
# stopped and the rest skipped, with the summary and logs written; sass-forms reads each
# object's SASS through the disassembler it is given; roofline profiles both dtypes through
# scripts/ncu-layer.sh (a stand-in ncu); compare-device fails when its negative control
# (--fault drop-beta) passes; the determinism step is held to the digest record of the card
# nvidia-smi names (none where no record names it); a named record that does not exist is exit 2;
# compare-official runs both scan modes only on a card with the memory for them.
# Usage: gpu_check_test.sh REPO
set -euo pipefail
repo="$1"
# The test sets what it means to test: a gpu-check running this test (its ctest step, under
# GPU_CHECK_PARALLEL=1 say) must not hand its own settings to the checks below.
unset GPU_CHECK_PARALLEL GPU_CHECK_DEADLINE GPU_CHECK_PACK GPU_CHECK_DIGESTS GPU_CHECK_DIGESTS_DIR \
  GPU_CHECK_ONLY GPU_SWEEP_FROM M3_CUDA_ARCH M3_CUOBJDUMP FAKE_GPU
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

mkdir -p "$work/bin" "$work/build/tools" "$work/build/tests" "$work/build/bench"
touch "$work/build/CMakeCache.txt"
# stand-in PATH NAME: logs "start T PID NAME ARGS" / "end T PID" to $CALLS around a short sleep.
standin() {
  cat >"$1" <<EOF
#!/usr/bin/env bash
echo "start \$(date +%s.%N) \$\$ $2 \$*" >>"\$CALLS"
if [[ -n "\${FAKE_SLOW:-}" && "\$*" =~ \$FAKE_SLOW ]]; then sleep 30; else sleep 0.2; fi
rc=0
if [[ -n "\${FAKE_FAIL:-}" && "\$*" =~ \$FAKE_FAIL ]]; then rc=1; fi
# A negative control fails as the real m3h does, naming its stage (unless told to pass).
if [[ "\$*" == *"--fault drop-beta"* && -z "\${FAKE_FAULT_PASSES:-}" ]]; then
  echo "summary: FAIL first failing stage: L0/F5b/beta [bf16 chunked]"
  rc=1
fi
echo "end \$(date +%s.%N) \$\$" >>"\$CALLS"
exit \$rc
EOF
  chmod +x "$1"
}
# nvidia-smi names the card ($FAKE_GPU, an H200 unless told), which picks the digest record, and
# gives its memory in MiB when asked ($FAKE_MIB, an H200's unless told).
cat >"$work/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
if [[ "$*" == *memory.total* ]]; then echo "${FAKE_MIB:-143771}"; else echo "${FAKE_GPU:-NVIDIA H200}"; fi
EOF
chmod +x "$work/bin/nvidia-smi"
standin "$work/bin/cmake" cmake
standin "$work/bin/ctest" ctest
standin "$work/bin/compute-sanitizer" sanitizer
standin "$work/build/tools/m3h" m3h
standin "$work/build/tests/m3_gpu_tests" gpu_tests
standin "$work/build/bench/m3_wgmma_probe" probe
standin "$work/build/bench/m3_oracle_bench" oracle_bench
export PATH="$work/bin:$PATH" GPU_CHECK_BUILD_DIR="$work/build"
GPU_CHECK_ONLY="ctest memcheck racecheck wgmma-probe oracle-bench golden golden-oracle compare-gpu"
export GPU_CHECK_ONLY+=" compare-device compare-presets compare-golden determinism compare-lm positions bench memory"
export GPU_CHECK_ONLY+=" sweep-gpu sweep-cpu"
steps=(configure build ctest memcheck racecheck golden golden-oracle compare-gpu compare-device compare-presets
  compare-golden determinism digests-record compare-lm positions wgmma-probe oracle-bench bench
  memory sweep-gpu sweep-cpu)

check() {  # check MODE EXPECTED_EXIT [ENV...]: runs gpu-check.sh, leaves its output in $out
  local mode="$1" want="$2" rc=0
  shift 2
  export CALLS="$work/calls-$mode"
  : >"$CALLS"
  out="$(env "$@" OUT="$work/logs-$mode" bash "$repo/scripts/gpu-check.sh" 2>&1)" || rc=$?
  [[ $rc == "$want" ]] || fail "$mode: exit $rc (want $want): $out"
  for s in "${steps[@]}"; do
    grep -qE "^(PASS|FAIL) $s \([0-9]+ s\)$" "$work/logs-$mode/summary.txt" ||
      fail "$mode: no summary line for $s: $(cat "$work/logs-$mode/summary.txt")"
  done
  [[ "$(wc -l <"$work/logs-$mode/summary.txt")" == "${#steps[@]}" ]] ||
    fail "$mode: summary lines beyond the steps: $(cat "$work/logs-$mode/summary.txt")"
}
# Pairs of stand-in calls that ran at the same time.
overlaps() {
  python3 - "$1" <<'EOF'
import sys
start, calls = {}, []
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "start":
        start[f[2]] = (float(f[1]), " ".join(f[3:6]))
    else:
        t0, what = start.pop(f[2])
        calls.append((t0, float(f[1]), what))
n = sum(1 for i, a in enumerate(calls) for b in calls[i + 1:] if a[0] < b[1] and b[0] < a[1])
timing = [c for c in calls if c[2].startswith(("m3h bench", "probe", "oracle_bench"))]
lanes = [c for c in calls if not c[2].startswith(("m3h bench", "probe", "oracle_bench", "cmake"))
         and "--sweep" not in c[2]]
print(n, int(all(t[0] >= max(c[1] for c in lanes) for t in timing)))
EOF
}

check sequential 0
read -r n after < <(overlaps "$work/calls-sequential")
[[ $n == 0 ]] || fail "sequential: $n pairs of calls overlapped"
grep -q "m3h determinism --runs 20 --expect golden/digests/h200-default.txt" "$work/calls-sequential" ||
  fail "sequential: determinism not held to the committed record"

check parallel 0 GPU_CHECK_PARALLEL=1
read -r n after < <(overlaps "$work/calls-parallel")
((n > 0)) || fail "parallel: no two calls overlapped"
[[ $after == 1 ]] || fail "parallel: a timing step started before a checking lane ended"
[[ -z "$(ls "$work/logs-parallel" | grep '^lane-' || true)" ]] || fail "parallel: lane files left"
[[ ! -e "$work/logs-parallel/.results" ]] || fail "parallel: .results left"

check failing 1 GPU_CHECK_PARALLEL=1 FAKE_FAIL='^determinism --runs 20'
grep -qE '^FAIL determinism \(' "$work/logs-failing/summary.txt" ||
  fail "failing: no FAIL line: $(cat "$work/logs-failing/summary.txt")"
[[ "$(grep -c '^FAIL' "$work/logs-failing/summary.txt")" == 1 ]] ||
  fail "failing: other steps failed: $(cat "$work/logs-failing/summary.txt")"

# compare-device's negative control: a fault that passes fails the step, and only it.
check fault-passes 1 FAKE_FAULT_PASSES=1
grep -qE '^FAIL compare-device \(' "$work/logs-fault-passes/summary.txt" ||
  fail "fault-passes: no FAIL line: $(cat "$work/logs-fault-passes/summary.txt")"
[[ "$(grep -c '^FAIL' "$work/logs-fault-passes/summary.txt")" == 1 ]] ||
  fail "fault-passes: other steps failed: $(cat "$work/logs-fault-passes/summary.txt")"

# A deadline: compare-gpu's stand-in would take 30 s; with GPU_CHECK_DEADLINE=3 it is stopped
# (TIMEOUT), every step after it is not run (SKIP), none fails, the summary and the logs are
# there, and the check is over long before the 30 s.
t0=$(date +%s)
rc=0
CALLS="$work/calls-deadline" FAKE_SLOW='^compare --device gpu --mode both' GPU_CHECK_DEADLINE=3 \
  GPU_CHECK_PACK=1 OUT="$work/logs-deadline" bash "$repo/scripts/gpu-check.sh" >/dev/null 2>&1 || rc=$?
((rc == 1)) || fail "deadline: exit $rc (want 1)"
(($(date +%s) - t0 < 20)) || fail "deadline: the check waited for the slow step"
sum="$(cat "$work/logs-deadline/summary.txt")"
grep -qE '^(TIMEOUT|SKIP) compare-gpu \(' <<<"$sum" || fail "deadline: compare-gpu not stopped: $sum"
grep -qE '^SKIP sweep-cpu \(0 s\)$' <<<"$sum" || fail "deadline: the last step not skipped: $sum"
! grep -q '^FAIL' <<<"$sum" || fail "deadline: a step failed: $sum"
[[ -f "$work/logs-deadline/logs.tar.gz" ]] || fail "deadline: the logs were not packed"
rc=0
msg="$(GPU_CHECK_DEADLINE=soon OUT="$work/logs-y" bash "$repo/scripts/gpu-check.sh" 2>&1)" || rc=$?
[[ $rc == 2 && "$msg" == *"not a positive number of seconds"* ]] || fail "a bad deadline: exit $rc: $msg"

# sass-forms with a stand-in disassembler ($M3_CUOBJDUMP) over the build's one object.
mkdir -p "$work/build/gpu"
echo object >"$work/build/gpu/k.cu.o"
cat >"$work/bin/dis" <<'EOF'
#!/usr/bin/env bash
printf '\t\tFunction : _Z1fv\n        /*0000*/                   FMUL R2, R3, R4 ;\n'
printf '        /*0010*/                   FFMA R5, R6, R7, -R2 ;\n'
EOF
chmod +x "$work/bin/dis"
CALLS="$work/calls-sass" M3_CUOBJDUMP="$work/bin/dis" GPU_CHECK_ONLY=sass-forms \
  OUT="$work/logs-sass" bash "$repo/scripts/gpu-check.sh" >/dev/null 2>&1 || fail "sass-forms: not exit 0"
grep -qE '^PASS sass-forms \(' "$work/logs-sass/summary.txt" || fail "sass-forms: no PASS line"
grep -qx ' *1 *0 *0 *0 *0 *0  _Z1fv' "$work/logs-sass/sass-forms.log" ||
  fail "sass-forms: $(cat "$work/logs-sass/sass-forms.log")"

# roofline with a stand-in ncu that prints a miniature one-layer profile: ncu-layer.sh's two
# files for each dtype, and both rooflines in the step's log.
(source "$repo/tests/ncu_test_lib.sh" && ncu_layer_csv) >"$work/layer.csv"
printf '#!/usr/bin/env bash\ncat "%s"\n' "$work/layer.csv" >"$work/bin/ncu"
chmod +x "$work/bin/ncu"
CALLS="$work/calls-roof" GPU_CHECK_ONLY=roofline OUT="$work/logs-roof" \
  bash "$repo/scripts/gpu-check.sh" >/dev/null 2>&1 || fail "roofline: not exit 0"
grep -qE '^PASS roofline \(' "$work/logs-roof/summary.txt" || fail "roofline: no PASS line"
for d in bf16 f16; do
  [[ -s "$work/logs-roof/ncu-$d.csv" && -s "$work/logs-roof/ncu-$d-roofline.txt" ]] ||
    fail "roofline: no ncu-$d files"
  grep -qx -- "--- $d" "$work/logs-roof/roofline.log" || fail "roofline: no $d roofline in the log"
done
[[ "$(grep -c '^launches: 4-6,9-12 ' "$work/logs-roof/roofline.log")" == 2 ]] ||
  fail "roofline: $(cat "$work/logs-roof/roofline.log")"

# compare-official sizes itself to the card: both scan modes on an H200's memory, the chunked
# one alone on an H100's, and the chunked one where nvidia-smi gives no number.
official() {  # official NAME MIB: only compare-official; its m3h call line in $call
  export CALLS="$work/calls-$1"
  : >"$CALLS"
  FAKE_MIB="$2" GPU_CHECK_ONLY=compare-official OUT="$work/logs-$1" \
    bash "$repo/scripts/gpu-check.sh" >/dev/null 2>&1 || fail "$1: not exit 0"
  grep -qE '^PASS compare-official \(' "$work/logs-$1/summary.txt" || fail "$1: no PASS line"
  call="$(grep '^start .* m3h compare' "$CALLS")" || fail "$1: m3h compare not called"
  [[ "$call" == *"--preset official --B 8 --T 4096 --layers 2 "* && "$call" == *"--mode both"* ]] ||
    fail "$1: not the official problem in both modes: $call"
}
official official-h200 143771
[[ "$call" == *"--scan seq,chunked "* ]] || fail "official-h200: not both scan modes: $call"
grep -q "^compare-official: --scan seq,chunked (the card has 143771 MiB" \
  "$work/logs-official-h200/compare-official.log" || fail "official-h200: the choice not said"
official official-h100 81559
[[ "$call" == *"--scan chunked "* ]] || fail "official-h100: not the chunked mode alone: $call"
grep -q "^compare-official: --scan chunked (the card has 81559 MiB; seq needs 136000)" \
  "$work/logs-official-h100/compare-official.log" || fail "official-h100: the choice not said"
official official-unknown "N/A"
[[ "$call" == *"--scan chunked "* ]] || fail "official-unknown: not the chunked mode alone: $call"

# The record follows the card: the committed file whose environment line names it; a card
# without one runs unheld and says so; GPU_CHECK_DIGESTS overrides the choice.
mkdir -p "$work/digests"
for c in "H100 80GB HBM3" "H200"; do
  slug="$(tr 'A-Z' 'a-z' <<<"${c%% *}")"
  printf 'm3h-digests 1\nenvironment: NVIDIA %s, sm_90, CUDA runtime 13.0, cuBLAS 13.1.0\n' "$c" \
    >"$work/digests/$slug-default.txt"
done
cards() {  # cards NAME FAKE_GPU [ENV...]: only the determinism step; leaves its output in $out
  local name="$1" gpu="$2"
  shift 2
  export CALLS="$work/calls-$name"
  : >"$CALLS"
  out="$(env FAKE_GPU="$gpu" GPU_CHECK_DIGESTS_DIR="$work/digests" GPU_CHECK_ONLY=determinism \
    "$@" OUT="$work/logs-$name" bash "$repo/scripts/gpu-check.sh" 2>&1)" || fail "$name: not exit 0: $out"
}
cards h100 "NVIDIA H100 80GB HBM3"
grep -q "m3h determinism --runs 20 --expect $work/digests/h100-default.txt" "$work/calls-h100" ||
  fail "h100: not held to the H100 record: $(cat "$work/calls-h100")"
cards h200 "NVIDIA H200"
grep -q "m3h determinism --runs 20 --expect $work/digests/h200-default.txt" "$work/calls-h200" ||
  fail "h200: not held to the H200 record: $(cat "$work/calls-h200")"
cards a100 "NVIDIA A100-SXM4-80GB"
grep -q "m3h determinism --runs 20$" "$work/calls-a100" ||
  fail "a100: determinism held to a record of another card: $(cat "$work/calls-a100")"
[[ "$out" == *"no committed digest record for this card (NVIDIA A100-SXM4-80GB)"* ]] ||
  fail "a100: the unheld run not said: $out"
cards named "NVIDIA H100 80GB HBM3" GPU_CHECK_DIGESTS="$work/digests/h200-default.txt"
grep -q "m3h determinism --runs 20 --expect $work/digests/h200-default.txt" "$work/calls-named" ||
  fail "named: GPU_CHECK_DIGESTS not used: $(cat "$work/calls-named")"

rc=0
msg="$(GPU_CHECK_DIGESTS="$work/none.txt" OUT="$work/logs-x" bash "$repo/scripts/gpu-check.sh" 2>&1)" || rc=$?
[[ $rc == 2 && "$msg" == *"no such file"* ]] || fail "a missing record: exit $rc: $msg"
echo "gpu_check_test: all checks passed"
