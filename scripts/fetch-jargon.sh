#!/usr/bin/env bash
# Fetches the Jargon File (public domain English text, ~1.7 MB) from the Debian archive as the
# built-in real corpus of `m3h train --data` (TRAINING.md §3). Needs no root:
#   apt-get download jargon-text      the .deb into a temporary folder (needs a prior
#                                     `apt-get update` for the package lists)
#   dpkg-deb -x                       unpacked there
#   gunzip                            usr/share/doc/jargon-text/jargon.txt.gz → OUTPUT
# Usage: scripts/fetch-jargon.sh [--force] [OUTPUT]     (OUTPUT defaults to data/jargon.txt)
# An existing OUTPUT is kept unless --force is given. Prints the path and size on success; on
# failure one line on stderr and a non-zero exit status.
set -euo pipefail

die() {
  echo "fetch-jargon: $*" >&2
  exit 1
}

force=0
out=""
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h | --help)
      sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*) die "unknown option '$arg' (usage: fetch-jargon.sh [--force] [OUTPUT])" ;;
    *)
      [[ -z "$out" ]] || die "more than one output path given ('$out' and '$arg')"
      out="$arg"
      ;;
  esac
done
[[ -n "$out" ]] || out="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/data/jargon.txt"

for tool in apt-get dpkg-deb gunzip; do
  command -v "$tool" >/dev/null || die "'$tool' is not installed (needs Debian or Ubuntu)"
done
if [[ -e "$out" || -L "$out" ]]; then
  [[ -f "$out" ]] || die "$out exists and is not a regular file; nothing is written there"
  ((force)) || die "$out exists (pass --force to replace it)"
fi
mkdir -p "$(dirname "$out")" || die "cannot create the folder of $out"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/fetch-jargon.XXXXXX")" || die "cannot create a temporary folder"
# The text is written beside the output and renamed, so an interrupted run never leaves a
# partial file.
part="$out.part.$$"
trap 'rm -rf "$tmp"; rm -f "$part"' EXIT

(cd "$tmp" && apt-get download jargon-text >"$tmp/apt.log" 2>&1) ||
  die "apt-get download jargon-text failed ($(tail -n 1 "$tmp/apt.log"));" \
    "run 'apt-get update' first"
debs=("$tmp"/jargon-text_*.deb)
[[ -f "${debs[0]}" ]] || die "apt-get download left no jargon-text .deb in $tmp"
dpkg-deb -x "${debs[0]}" "$tmp/root" || die "dpkg-deb -x could not unpack ${debs[0]##*/}"
gz="$tmp/root/usr/share/doc/jargon-text/jargon.txt.gz"
[[ -f "$gz" ]] || die "the package has no usr/share/doc/jargon-text/jargon.txt.gz"

gunzip -c "$gz" >"$part" || {
  rm -f "$part"
  die "gunzip of jargon.txt.gz failed"
}
mv -f "$part" "$out" || {
  rm -f "$part"
  die "cannot move the text to $out"
}
echo "$out: $(stat -c %s "$out") bytes (jargon-text $(dpkg-deb -f "${debs[0]}" Version))"
