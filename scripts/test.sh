#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test. GPU tests skip without a device. Then
# scripts/sanitize.sh builds the CPU code again with ASan, UBSan and the asserts on
# (build-sanitize/) and runs its tests; M3_SANITIZE=0 skips that second build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-2}"
bash scripts/setup.sh

echo "test: ctest --test-dir $BUILD_DIR --output-on-failure -j$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS"
if [[ "${M3_SANITIZE:-1}" != 0 ]]; then
  JOBS="$JOBS" bash scripts/sanitize.sh
else
  echo "test: M3_SANITIZE=0: the sanitizer build skipped"
fi
