#!/usr/bin/env bash
# Packs Boost.Program_options (its headers, the transitive closure of the boost headers it
# includes, and the static library) and the nlohmann-json headers from this machine into
# .boost/, for a machine that lacks
# libboost-program-options-dev and cannot install it (the GPU machine has Boost headers but no
# program_options library, and no network). scripts/gpu-check.sh uses .boost/ when it exists
# (configure with -DM3_BOOST_BUNDLE=$PWD/.boost). .boost/ is build output: never committed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
lib=/usr/lib/x86_64-linux-gnu/libboost_program_options.a
if [[ ! -f "$lib" ]]; then
  echo "make-boost-bundle: $lib missing: apt-get install libboost-program-options-dev" >&2
  exit 2
fi
out=.boost
rm -rf "$out"
mkdir -p "$out/include" "$out/lib"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo '#include <boost/program_options.hpp>' >"$tmp/po.cpp"
g++ -std=c++17 -M "$tmp/po.cpp" | tr ' \\' '\n\n' | grep '^/usr/include/boost/' | sort -u |
  while read -r h; do
    rel=${h#/usr/include/}
    mkdir -p "$out/include/$(dirname "$rel")"
    cp "$h" "$out/include/$rel"
  done
cp "$lib" "$out/lib/"
# nlohmann-json (header-only) for the JSON reports: the GPU machine lacks nlohmann-json3-dev.
if [[ ! -f /usr/include/nlohmann/json.hpp ]]; then
  echo "make-boost-bundle: /usr/include/nlohmann missing: apt-get install nlohmann-json3-dev" >&2
  exit 2
fi
cp -r /usr/include/nlohmann "$out/include/"
echo "boost bundle: $(find "$out/include" -type f | wc -l) headers, $(du -sh "$out" | cut -f1) in $out/"
