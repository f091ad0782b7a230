#!/usr/bin/env bash
# Prints the disassembler that scripts/sass-diff.sh and gpu-check.sh's sass-forms step read SASS
# with: $M3_CUOBJDUMP where set; else cuobjdump on the PATH (the CUDA toolkit's own, the release
# that compiled the objects: the GPU machine); else .sass-tools/bin/cuobjdump, which
# scripts/fetch-sass-tools.sh puts there for a machine whose toolkit has none (this one's).
# None of them executable: one line naming the fix, exit 2.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${M3_CUOBJDUMP:-}" ]]; then
  dis="$M3_CUOBJDUMP"
elif ! dis="$(command -v cuobjdump)"; then
  dis="$root/.sass-tools/bin/cuobjdump"
fi
[[ -x "$dis" ]] || {
  echo "find-cuobjdump.sh: no cuobjdump at $dis (bash scripts/fetch-sass-tools.sh, or" \
    "M3_CUOBJDUMP=PATH)" >&2
  exit 2
}
echo "$dis"
