#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test. GPU tests skip without a device.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-2}"
bash scripts/setup.sh

echo "test: ctest --test-dir $BUILD_DIR --output-on-failure -j$JOBS"
exec ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS"
