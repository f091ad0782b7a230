#!/usr/bin/env bash
# Installs what is missing, builds, and runs `m3h compare` (on the default config unless
# arguments say otherwise): bash scripts/run.sh [m3h compare options...]
# Build output goes to stderr so that stdout is the comparison report alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR="${BUILD_DIR:-build}"
bash scripts/setup.sh >&2

m3h="$BUILD_DIR/tools/m3h"
if [[ ! -x "$m3h" ]]; then
  echo "run: $m3h was not built (tools/ missing or the build skipped it)" >&2
  exit 2
fi
exec "$m3h" compare "$@"
