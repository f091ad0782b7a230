#!/usr/bin/env bash
# The CPU code built with AddressSanitizer and UndefinedBehaviorSanitizer, assert(), Eigen's
# asserts and _GLIBCXX_ASSERTIONS on (-DM3_SANITIZE=ON, CUDA off, into build-sanitize/), then
# every test of that build: an out-of-bounds access, a use after free, a leak, an undefined
# operation (signed overflow, a bad shift or cast, a misaligned access), an index or size that
# an assert refuses fails the test that hits it, with the report in its output. scripts/test.sh
# runs it after the tests (M3_SANITIZE=0 skips it); two cores: ≈ 12 min of build, 11–13 of tests.
#   SANITIZE_BUILD_DIR  build directory (default: build-sanitize)
#   JOBS                parallel build and test jobs (default: 2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dir="${SANITIZE_BUILD_DIR:-build-sanitize}"
JOBS="${JOBS:-2}"
BUILD_DIR="$dir" CMAKE_ARGS="-DM3_CUDA=OFF -DM3_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo" \
  JOBS="$JOBS" bash scripts/setup.sh
# Leaks are errors; a report names the source lines (the frames of the failing test).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}"
echo "sanitize: ctest --test-dir $dir --output-on-failure -j$JOBS"
exec ctest --test-dir "$dir" --output-on-failure -j"$JOBS"
