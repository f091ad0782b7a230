#!/usr/bin/env bash
# For the GPU machine: builds with CUDA into build-gpu/, then runs each check below.
# Each step's stdout+stderr goes to ${OUT:-gpu-logs}/<step>.log; one PASS/FAIL line per step
# is printed at the end, and the exit status is non-zero if any step failed.
# Installs nothing: the GPU machine must already have the packages of scripts/setup.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR=build-gpu
LOGS="${OUT:-gpu-logs}"
JOBS="$(nproc)"
mkdir -p "$LOGS"

names=()
results=()
failed=0

# step NAME CMD...: runs CMD, logging to $LOGS/NAME.log, and records PASS or FAIL.
step() {
  local name="$1"
  shift
  echo "=== $name: $*"
  if "$@" 2>&1 | tee "$LOGS/$name.log"; then
    results+=(PASS)
  else
    results+=(FAIL)
    failed=1
  fi
  names+=("$name")
}

configure_args=(-S . -B "$BUILD_DIR" -DM3_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then configure_args+=(-G Ninja); fi

step configure cmake "${configure_args[@]}"
if ((failed == 0)); then
  step build cmake --build "$BUILD_DIR" -j "$JOBS"
fi
if ((failed == 0)); then
  if command -v nvidia-smi >/dev/null 2>&1; then step nvidia-smi nvidia-smi; fi
  step ctest ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"
  m3h="$BUILD_DIR/tools/m3h"
  if [[ -x "$m3h" ]]; then
    step compare "$m3h" compare
    step bench-reference "$m3h" bench --reference
  fi
fi

echo "=== summary (logs in $LOGS/)"
for i in "${!names[@]}"; do
  printf '%-4s %s\n' "${results[$i]}" "${names[$i]}"
done
exit "$failed"
