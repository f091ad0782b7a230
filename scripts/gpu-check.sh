#!/usr/bin/env bash
# For the GPU machine: builds with CUDA into build-gpu/ and runs every GPU check in one go:
#   configure, build          cmake -DM3_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a (Ninja; M3_CUDA_ARCH=90
#                             builds without wgmma: the same bits, chunk_bwd_tc on mma.sync)
#   nvidia-smi                what the card is
#   ctest                     every test; GPU tests run the whole coverage grid
#                             (M3_GPU_FULL_GRID=1) and 20-run determinism
#   memcheck, racecheck       compute-sanitizer on the small sanitizer test (f32, both scan
#                             modes) and the typed chunked SSM tests (bf16/f16: the plane
#                             kernels, short and long chunks)
#   wgmma-probe               m3_wgmma_probe: chunk_bwd_tc's product set on mma.sync and on wgmma
#                             (µs per official grid, TFLOP/s, registers, shared bytes)
#   golden                    m3h golden check --all
#   golden-oracle             m3h golden check --all --device gpu-oracle: the GPU oracle in f64
#                             against every golden case (its full proof against the Eigen
#                             oracle, the golden cases and a random sweep, is ctest's
#                             m3_gpu_oracle_tests)
#   compare-gpu               m3h compare --device gpu --mode both: f32/bf16/f16 x seq/chunked,
#                             end-to-end and isolated, baseline = the reference at the same
#                             storage precision
#   compare-device            m3h compare --device gpu --oracle gpu: the default problem judged on
#                             the device against the GPU oracle (docs/HARNESS.md §11), then the
#                             negative control --fault drop-beta, which must fail first at
#                             L0/F5b/beta
#   compare-official          only when GPU_CHECK_ONLY names it (alone): m3h compare --oracle gpu
#                             --mode both at the official widths, B 8, T 4096, 2 layers,
#                             f32/bf16/f16; both scan modes on a card of at least 136000 MiB
#                             (with the sequential cells the run peaks at 134 GB), the chunked
#                             mode alone (67 GB) on a smaller one, which the step's log says
#   compare-presets           the same, end-to-end, on the adversarial presets
#   compare-golden            the same, end-to-end and isolated, on every golden case
#   determinism               m3h determinism --runs 20 (f32, bf16, f16; both scan modes),
#                             held to this card's record: the golden/digests/*-default.txt
#                             whose environment line names the card nvidia-smi reports
#                             (h100-default.txt, h200-default.txt; --expect: a tensor whose
#                             bits moved fails the step, named; GPU_CHECK_DIGESTS=FILE another
#                             record, =none none; a card without one runs unheld), then the
#                             build's own record written to digests-default.txt (--runs 2
#                             --record): the file to commit when a change moves the bits on
#                             purpose
#   oracle-bench              m3_oracle_bench: the GPU oracle's forward and backward times and
#                             device memory at B 8, T 4096, the official widths, 2 layers (both
#                             keep policies) and at 24 layers, B 1
#   bench                     m3h bench --profile (the measured copy/GEMM ceilings; default and
#                             official shapes, f32 and bf16, per-stage time, bytes, FLOPs and
#                             achieved rates; the reference time on the f32 rows)
#   memory                    m3h bench on official and official2, bf16 chunked, both recompute
#                             policies: the marginal layer's time and bytes per further layer
#   train                     scripts/train-figures.sh: m3h train's throughput at the official
#                             shape next to m3h bench, a Jargon File model (data/jargon.txt,
#                             carried: scripts/fetch-jargon.sh), parity with and without angles,
#                             selective-copy; logs and metrics in train.tar.gz
#   compare-lm                m3h compare --device gpu --preset lm --mode both (a training step)
#   positions                 m3h dump --profiles-only of the long_t preset in bf16, both scan
#                             modes: y's and d_x's error against t (render it with
#                             scripts/plot-positions.sh where gnuplot is installed)
#   sweep-gpu                 m3h compare --device gpu --sweep 220 --seed 7: random problems
#                             over the supported space, every precision and scan mode, e2e and
#                             isolated (0 failures of correct code over >= 200, docs/HARNESS.md §4);
#                             ≈ 62 s on an H100. GPU_SWEEP_FROM=K runs problems K … 219 only
#                             (--sweep-from: the rest of a sweep that an earlier call cut short)
#   sweep-cpu                 m3h compare --device cpu --sweep 1000 --seed 5 --jobs $(nproc)
#   sass-forms                only when GPU_CHECK_ONLY names it: every GPU object's SASS
#                             (cuobjdump, or .sass-tools/bin's: scripts/fetch-sass-tools.sh)
#                             through scripts/fp-forms.py sass — per function, which product
#                             ptxas fused in a·b − c·d, in division dividends and in hi/lo
#                             splits, for pinning a form that every instantiation has
#   roofline                  only when GPU_CHECK_ONLY names it: scripts/ncu-layer.sh on one
#                             official forward + backward, bf16 then f16 (ncu-<dtype>.csv and
#                             ncu-<dtype>-roofline.txt): each of the layer's kernels with its
#                             time, bytes, floors, registers, shared memory and occupancy
#                             (its budgets)
# Each step's stdout+stderr goes to ${OUT:-gpu-logs}/<step>.log; one PASS/FAIL line per step,
# with its seconds, is printed at the end (and written to summary.txt), and the exit status is
# non-zero if any step failed. GPU_CHECK_PACK=1 then packs every other file there into
# logs.tar.gz.
# Order: the tests (ctest, memcheck, racecheck), the compares (golden … compare-golden), the
# bits (determinism, digests-record, compare-lm, positions), the timing steps (wgmma-probe,
# bench, memory, train), the sweeps. GPU_CHECK_PARALLEL=1 runs the tests, compares, bits and
# sweeps as four concurrent lanes on the one GPU (none of them times anything, and a result
# that depended on what else runs would be a bug to find), then the timing steps alone: the
# whole check in about the time of its longest lane plus the timing steps.
# GPU_CHECK_BUILD_DIR: the build directory (default build-gpu). GPU_CHECK_DEADLINE=S: stop at S
# seconds (below), e.g. 560 in a call limited to 600, so that the summary and logs come back.
# Installs nothing (the GPU machine has no network). Boost.Program_options, missing there, is
# taken from .boost/ when scripts/make-boost-bundle.sh made it here and the call carried it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR="${GPU_CHECK_BUILD_DIR:-build-gpu}"
LOGS="${OUT:-gpu-logs}"
JOBS="$(nproc)"
mkdir -p "$LOGS"

failed=0
rm -f "$LOGS/.results"

# GPU_CHECK_DEADLINE=S: the check ends S seconds after it started, so that a call with a time
# limit still ends with its summary and packed logs: a step running then is stopped (TIMEOUT), a
# step not started by then is not run (SKIP); either makes the exit status 1.
deadline="${GPU_CHECK_DEADLINE:-}"
if [[ -n "$deadline" && ! "$deadline" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu-check.sh: GPU_CHECK_DEADLINE=$deadline: not a positive number of seconds" >&2
  exit 2
fi
t_start=$(date +%s)

# The determinism step's record (see the header): one named explicitly must exist; otherwise
# the committed record made on this card, found by the card's name in its environment line
# (a record holds its bits to one GPU model, CUDA runtime and cuBLAS: m3h refuses another's).
# GPU_CHECK_DIGESTS_DIR: where the committed records are (default golden/digests).
card_record() {  # card_record CARD: the committed record whose environment line names CARD
  local f
  [[ -n "$1" ]] || return 0
  for f in "${GPU_CHECK_DIGESTS_DIR:-golden/digests}"/*-default.txt; do
    [[ -f "$f" ]] && grep -qF "environment: $1," "$f" && { echo "$f"; return 0; }
  done
  return 0
}
if [[ -n "${GPU_CHECK_DIGESTS:-}" ]]; then
  digests="$GPU_CHECK_DIGESTS"
  if [[ "$digests" != none && ! -f "$digests" ]]; then
    echo "gpu-check.sh: GPU_CHECK_DIGESTS=$digests: no such file (none: no record)" >&2
    exit 2
  fi
else
  card="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)"
  digests="$(card_record "$card")"
  [[ -n "$digests" ]] || digests=none unheld_card="${card:-no card named by nvidia-smi}"
fi

# GPU_CHECK_ONLY="name name ...": run only those steps (configure and build always run), e.g. to
# split the check over two calls of a time-limited device session. digests-record comes with
# determinism. The opt-in steps (sass-forms, roofline) run only when named there.
named() { [[ " ${GPU_CHECK_ONLY:-} " == *" $1 "* ]]; }
wanted() {
  local name="$1"
  [[ "$name" == digests-record ]] && name=determinism
  [[ -z "${GPU_CHECK_ONLY:-}" || "$name" == configure || "$name" == build ]] || named "$name"
}

# sass-forms: fp-forms.py sass over each object of the CUDA library that holds functions.
# The disassembler: scripts/find-cuobjdump.sh's ($M3_CUOBJDUMP, cuobjdump on the PATH on the GPU
# machine, or .sass-tools/bin's from scripts/fetch-sass-tools.sh on a machine without it, where
# GPU_CHECK_ONLY=sass-forms configures, builds and reads the objects).
sass_forms() {
  local o tmp="$LOGS/sass-forms.tmp" dis
  dis="$(bash scripts/find-cuobjdump.sh)" || return 1
  while IFS= read -r o; do
    "$dis" -sass "$o" >"$tmp" || { rm -f "$tmp"; return 1; }
    grep -q "Function :" "$tmp" || continue
    echo "--- $o"
    python3 scripts/fp-forms.py sass "$tmp" || { rm -f "$tmp"; return 1; }
  done < <(find "$BUILD_DIR/gpu" -name '*.cu.o' | sort)
  rm -f "$tmp"
}

# roofline: ncu-layer.sh on the build's m3h, bf16 then f16; each roofline (with the budgets)
# printed into the step's log.
roofline_layers() {
  local d
  for d in bf16 f16; do
    rm -f "$LOGS/ncu-$d.csv" "$LOGS/ncu-$d-roofline.txt"  # this check's own
    bash scripts/ncu-layer.sh "$BUILD_DIR/tools/m3h" "$d" "$LOGS/ncu-$d" || return 1
    echo "--- $d"
    cat "$LOGS/ncu-$d-roofline.txt"
  done
}

# compare-official M3H: the official widths at B 8 in both modes. With the sequential cells the
# run peaks at 134 GB of device memory (an H200, docs/HARNESS.md §11), with the chunked ones alone
# at 67 GB: both scan modes where the card holds them with a margin, the chunked one elsewhere.
compare_official() {
  local mib scans=chunked
  mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null |
    head -1 | tr -d ' ')"
  if [[ "$mib" =~ ^[0-9]+$ ]] && ((mib >= 136000)); then scans=seq,chunked; fi
  echo "compare-official: --scan $scans (the card has ${mib:-an unknown number of} MiB;" \
    "seq needs 136000)"
  "$1" compare --device gpu --oracle gpu --preset official --B 8 --T 4096 --layers 2 \
    --scan "$scans" --dtype f32,bf16,f16 --mode both --failures-only
}

# step NAME CMD...: runs CMD, logging to $LOGS/NAME.log, and records PASS, FAIL, TIMEOUT or
# SKIP with its seconds in $LOGS/.results (a file, so that steps of parallel lanes record theirs
# too). Under a deadline CMD runs in `timeout` (a function through bash -c: they are exported
# below), its whole process group stopped when the deadline comes.
step() {
  local name="$1"
  shift
  wanted "$name" || return 0
  local t0 result=PASS left="" rc=0
  t0=$(date +%s)
  if [[ -n "$deadline" ]]; then
    left=$((deadline - (t0 - t_start)))
    if ((left <= 0)); then
      echo "=== $name: not run (GPU_CHECK_DEADLINE=$deadline s reached)"
      echo "SKIP $name 0" >>"$LOGS/.results"
      failed=1
      return 0
    fi
  fi
  echo "=== $name: $*"
  if [[ -n "$left" ]]; then
    timeout --kill-after=10 "$left" bash -c '"$@"' step "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then
      result=TIMEOUT
      echo "gpu-check: stopped at GPU_CHECK_DEADLINE=$deadline s" >>"$LOGS/$name.log"
    elif ((rc != 0)); then
      result=FAIL
    fi
  else
    "$@" >"$LOGS/$name.log" 2>&1 || result=FAIL
  fi
  echo "$result $name $(($(date +%s) - t0))" >>"$LOGS/.results"
  [[ $result == PASS ]] || failed=1
  tail -n 5 "$LOGS/$name.log"
}

# m3h compare on the GPU for every committed golden case: f32, bf16, f16 x the file's scan
# modes, end-to-end and isolated (oracle = the file's double tensors).
# Every case runs even after a failure; the failing ones are named at the end.
compare_golden() {
  local f failing=()
  for f in golden/cases/*.h5; do
    echo "--- golden $f"
    "$1" compare --device gpu --golden "$f" --dtype f32,bf16,f16 --mode both --failures-only ||
      failing+=("$f")
  done
  if ((${#failing[@]})); then
    echo "failing golden cases: ${failing[*]}"
    return 1
  fi
}

# m3h compare on the GPU for every adversarial preset (end-to-end, all precisions); every
# preset runs even after a failure, and the failing ones are named at the end.
compare_presets() {
  local p failing=()
  for p in strong_decay near_zero large_angles long_t official; do
    echo "--- preset $p"
    "$1" compare --device gpu --preset "$p" --failures-only || failing+=("$p")
  done
  if ((${#failing[@]})); then
    echo "failing presets: ${failing[*]}"
    return 1
  fi
}

# The device comparison (m3h compare --oracle gpu) on the default problem, then its negative
# control: layer 0's beta dropped must fail, first at L0/F5b/beta.
compare_device() {
  "$1" compare --device gpu --oracle gpu --failures-only || return 1
  local out
  if out="$("$1" compare --device gpu --oracle gpu --dtype bf16 --scan chunked --fault drop-beta \
      --failures-only 2>&1)"; then
    echo "$out"
    echo "compare-device: the fault drop-beta passed"
    return 1
  fi
  echo "$out"
  [[ "$out" == *"first failing stage: L0/F5b/beta"* ]] ||
    { echo "compare-device: the fault was not named first at L0/F5b/beta"; return 1; }
}

# What step's `bash -c` needs under a deadline.
export -f compare_golden compare_presets compare_device compare_official sass_forms roofline_layers
export LOGS BUILD_DIR

configure_args=(-S . -B "$BUILD_DIR" -DM3_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${M3_CUDA_ARCH:-90a}")
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then configure_args+=(-G Ninja); fi
if [[ -d .boost ]]; then configure_args+=(-DM3_BOOST_BUNDLE="$PWD/.boost"); fi

step configure cmake "${configure_args[@]}"
if ((failed == 0)); then
  step build cmake --build "$BUILD_DIR" -j "$JOBS"
fi
# The steps after the build, in groups. The first four only check results, so
# GPU_CHECK_PARALLEL=1 runs them as concurrent lanes (one GPU, shared; bits must not depend on
# what else runs); the timing group runs alone after them either way.
m3h="$BUILD_DIR/tools/m3h"
gpu_tests="$BUILD_DIR/tests/m3_gpu_tests"
tests_lane() {
  step ctest env M3_GPU_FULL_GRID=1 ctest --test-dir "$BUILD_DIR" --output-on-failure -j 4
  if [[ -x "$gpu_tests" ]] && command -v compute-sanitizer >/dev/null 2>&1; then
    for tool in memcheck racecheck; do
      step "$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$gpu_tests" --gtest_filter='GpuSanitizer.*:*TypedSsm*Chunked*:*TypedSsm*ChunkWalk*:*RmsnormBackward*:*GpuAnglesFull*'
    done
  fi
}
compare_lane() {
  [[ -x "$m3h" ]] || return 0
  step golden "$m3h" golden check --all
  step golden-oracle "$m3h" golden check --all --device gpu-oracle
  step compare-gpu "$m3h" compare --device gpu --mode both --failures-only
  step compare-device compare_device "$m3h"
  step compare-presets compare_presets "$m3h"
  step compare-golden compare_golden "$m3h"
}
bits_lane() {
  [[ -x "$m3h" ]] || return 0
  local expect=()
  if [[ "$digests" != none ]]; then
    expect=(--expect "$digests")
  elif [[ -n "${unheld_card:-}" ]]; then
    echo "gpu-check: no committed digest record for this card ($unheld_card): determinism is" \
      "not held to one; commit the digests-record step's file as golden/digests/<card>-default.txt"
  fi
  step determinism "$m3h" determinism --runs 20 "${expect[@]}"
  step digests-record "$m3h" determinism --runs 2 --record "$LOGS/digests-default.txt" --force
  step compare-lm "$m3h" compare --device gpu --preset lm --mode both --failures-only
  step positions "$m3h" dump --device gpu --preset long_t --dtype bf16 --profiles-only \
    --stage 'L0/F6/y,L0/B6/d_x' --force --out "$LOGS/long_t_bf16_positions.h5"
}
sweep_lane() {
  [[ -x "$m3h" ]] || return 0
  step sweep-gpu "$m3h" compare --device gpu --sweep 220 --seed 7 \
    ${GPU_SWEEP_FROM:+--sweep-from "$GPU_SWEEP_FROM"}
  step sweep-cpu "$m3h" compare --device cpu --sweep 1000 --seed 5 --jobs "$JOBS"
}
timing_group() {
  probe="$BUILD_DIR/bench/m3_wgmma_probe"
  if [[ -x "$probe" ]]; then step wgmma-probe "$probe"; fi
  oracle_bench="$BUILD_DIR/bench/m3_oracle_bench"
  if [[ -x "$oracle_bench" ]]; then step oracle-bench "$oracle_bench"; fi
  [[ -x "$m3h" ]] || return 0
  step bench "$m3h" bench --profile
  step memory "$m3h" bench --no-reference --shapes official,official2 --dtype bf16 \
    --scan chunked --recompute none,scan
  step train bash scripts/train-figures.sh "$m3h"
}

if ((failed == 0)); then
  if command -v nvidia-smi >/dev/null 2>&1; then step nvidia-smi nvidia-smi; fi
  if [[ -n "${GPU_CHECK_PARALLEL:-}" ]]; then
    # Each lane's console lines go to lane-NAME.txt and are shown when every lane is done.
    pids=()
    for lane in tests compare bits sweep; do
      "${lane}_lane" >"$LOGS/lane-$lane.txt" 2>&1 &
      pids+=($!)
    done
    echo "=== lanes tests, compare, bits, sweep running (their steps' lines in $LOGS/lane-*.txt)"
    for pid in "${pids[@]}"; do wait "$pid" || true; done
    for lane in tests compare bits sweep; do
      echo "--- lane $lane"
      cat "$LOGS/lane-$lane.txt"
      rm -f "$LOGS/lane-$lane.txt"
    done
  else
    tests_lane
    compare_lane
    bits_lane
  fi
  timing_group
  [[ -n "${GPU_CHECK_PARALLEL:-}" ]] || sweep_lane
  if [[ -x "$m3h" ]] && named sass-forms; then step sass-forms sass_forms; fi
  if [[ -x "$m3h" ]] && named roofline; then step roofline roofline_layers; fi
  if [[ -x "$m3h" ]] && named compare-official; then
    step compare-official compare_official "$m3h"
  fi
fi

echo "=== summary (logs in $LOGS/)"
# One line per step in the order the steps finished, with its seconds; a lane's failed (or
# stopped, or skipped) step fails the check as a step of the main shell does.
awk '{printf "%-4s %s (%d s)\n", $1, $2, $3}' "$LOGS/.results" | tee "$LOGS/summary.txt"
grep -qv '^PASS ' "$LOGS/.results" && failed=1
rm -f "$LOGS/.results"
# GPU_CHECK_PACK=1: everything else under $LOGS into one logs.tar.gz beside summary.txt (the
# device tool returns at most 8 files per call; a full check writes about 20).
if [[ -n "${GPU_CHECK_PACK:-}" ]]; then
  bash scripts/pack-logs.sh "$LOGS" --keep summary.txt || failed=1
fi
exit "$failed"
