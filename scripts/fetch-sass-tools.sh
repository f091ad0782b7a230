#!/usr/bin/env bash
# Fetches cuobjdump and nvdisasm for reading SASS on a machine without them (the CUDA toolkit
# here has nvcc and ptxas but neither disassembler), so that scripts/sass-forms.sh can read
# what ptxas made of a build's objects without a device call.
#
#   scripts/fetch-sass-tools.sh [--dest DIR] [--force]
#
# Source: Debian's non-free `nvidia-cuda-toolkit` package of trixie (CUDA 12.4). The chain is
# checked end to end: trixie's InRelease must carry a good signature from the Debian archive
# keyring (/usr/share/keyrings/debian-archive-keyring.gpg, gpgv); non-free's Packages.xz must
# have the SHA256 that InRelease lists; the package must have the SHA256 that Packages lists.
# The two binaries are taken from the package (dpkg-deb -x into a temporary directory) into
# DIR/bin (default .sass-tools/bin, ignored by git), with DIR/VERSION naming the package; the
# 87 MB package itself is not kept. A DIR that already has both is kept unless --force.
# The 12.4 disassemblers read sm_90a cubins and nvcc 13's objects; the SASS is the
# local ptxas's, which is the device's only where both toolkits are the same release
# (`nvcc --version` on each side).
# M3_DEBIAN_MIRROR overrides the archive (default http://deb.debian.org/debian); the
# signature check makes plain http safe.
# Errors (no network, a bad signature or hash, a missing tool, a bad option): one line, exit 2,
# and nothing written under DIR.
set -euo pipefail

die() {
  echo "fetch-sass-tools.sh: $*" >&2
  exit 2
}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.sass-tools"
force=0
while (($#)); do
  case "$1" in
    --dest) [[ $# -ge 2 ]] || die "--dest needs a directory"; dest="$2"; shift 2 ;;
    --force) force=1; shift ;;
    *) die "unknown argument $1 (usage: fetch-sass-tools.sh [--dest DIR] [--force])" ;;
  esac
done
if [[ -x "$dest/bin/cuobjdump" && -x "$dest/bin/nvdisasm" && $force -eq 0 ]]; then
  echo "fetch-sass-tools.sh: $dest/bin has both ($(cat "$dest/VERSION" 2>/dev/null)); --force fetches again"
  exit 0
fi
for t in curl gpgv sha256sum xz dpkg-deb; do
  command -v "$t" >/dev/null 2>&1 || die "$t is missing (apt-get install curl gpgv xz-utils dpkg)"
done
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -f "$keyring" ]] || die "no $keyring (apt-get install debian-archive-keyring)"
mirror="${M3_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=trixie
index=non-free/binary-amd64/Packages.xz
package=nvidia-cuda-toolkit

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
get() {  # get URL FILE
  curl -fsL --retry 2 --max-time 600 -o "$2" "$1" || die "cannot download $1"
}
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

get "$mirror/dists/$suite/InRelease" "$work/InRelease"
gpgv --keyring "$keyring" --output "$work/Release" "$work/InRelease" 2>"$work/gpgv.log" ||
  die "$mirror/dists/$suite/InRelease: no good signature from $keyring"
# Release's SHA256 section: " HASH SIZE PATH" lines after "SHA256:".
want="$(awk -v p="$index" '/^SHA256:/{s=1; next} /^[^ ]/{s=0} s && $3 == p {print $1}' "$work/Release")"
[[ -n "$want" ]] || die "$suite's Release lists no $index"
get "$mirror/dists/$suite/$index" "$work/Packages.xz"
[[ "$(sha_of "$work/Packages.xz")" == "$want" ]] || die "$index: SHA256 is not the one Release lists"

read -r file hash version < <(xz -dc "$work/Packages.xz" | awk -v p="$package" '
  /^Package: /{inp = ($2 == p)}
  inp && /^Filename: /{f = $2} inp && /^SHA256: /{h = $2} inp && /^Version: /{v = $2}
  /^$/ && inp && f != "" {print f, h, v; exit}
  END {if (inp && f != "") print f, h, v}') || true
[[ -n "${file:-}" && -n "${hash:-}" ]] || die "$index has no $package"
echo "fetch-sass-tools.sh: $package $version ($file, 87 MB)"
get "$mirror/$file" "$work/pkg.deb"
[[ "$(sha_of "$work/pkg.deb")" == "$hash" ]] || die "$file: SHA256 is not the one Packages lists"
dpkg-deb -x "$work/pkg.deb" "$work/x" || die "dpkg-deb cannot unpack $file"
for t in cuobjdump nvdisasm; do
  [[ -x "$work/x/usr/bin/$t" ]] || die "$file has no usr/bin/$t"
done
"$work/x/usr/bin/nvdisasm" --version >/dev/null 2>&1 || die "the package's nvdisasm does not run here"

# Written into a sibling first and renamed, so an interrupted fetch leaves no half of DIR/bin.
mkdir -p "$dest"
rm -rf "$dest/bin.new"
mkdir "$dest/bin.new"
cp "$work/x/usr/bin/cuobjdump" "$work/x/usr/bin/nvdisasm" "$dest/bin.new/"
echo "$package $version from $mirror ($suite non-free), SHA256 $hash" >"$dest/VERSION.new"
rm -rf "$dest/bin"
mv "$dest/bin.new" "$dest/bin"
mv "$dest/VERSION.new" "$dest/VERSION"
echo "fetch-sass-tools.sh: $dest/bin/cuobjdump and nvdisasm ($("$dest/bin/nvdisasm" --version | tail -1))"
