#!/usr/bin/env bash
# Packs every entry directly under DIR, but logs.tar.gz and the names given with --keep, into
# DIR/logs.tar.gz and removes what it packed: the device tool returns at most 8 files per call,
# and a full gpu-check or an `gpu-ab.sh run --ncu` writes about 20. Used by scripts/gpu-check.sh
# (GPU_CHECK_PACK=1) and scripts/gpu-ab.sh (AB_PACK=1).
#   scripts/pack-logs.sh DIR [--keep NAME]...
# A missing DIR, a bad option or a failed tar: a one-line error and exit 2 (nothing is removed
# unless the archive was written).
set -euo pipefail
die() {
  echo "pack-logs.sh: $*" >&2
  exit 2
}
[[ $# -ge 1 ]] || die "usage: pack-logs.sh DIR [--keep NAME]..."
dir="$1"
shift
[[ -d "$dir" ]] || die "no directory $dir"
keep=(! -name logs.tar.gz)
while (($#)); do
  [[ "$1" == --keep && $# -ge 2 ]] || die "unknown argument $1 (--keep NAME)"
  keep+=(! -name "$2")
  shift 2
done
(cd "$dir" && find . -mindepth 1 -maxdepth 1 "${keep[@]}" -printf '%P\n' |
  tar czf logs.tar.gz --remove-files -T -) || die "tar of $dir failed"
