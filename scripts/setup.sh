#!/usr/bin/env bash
# Installs the Debian packages the build needs (only those missing), then configures and
# builds the project into build/.
#   BUILD_DIR   build directory (default: build)
#   JOBS        parallel build jobs (default: 2)
#   CMAKE_ARGS  extra arguments for the cmake configure step, e.g. "-DM3_CUDA=OFF"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-2}"
# hdf5-tools and gnuplot-nox serve scripts/plot-positions.sh (a dump's error against position
# as a PNG); the build does not need them.
packages=(libeigen3-dev libhdf5-dev libboost-program-options-dev libgtest-dev nlohmann-json3-dev
          cmake g++ ninja-build hdf5-tools gnuplot-nox)

missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=()
  if [[ "$(id -u)" -ne 0 ]]; then sudo=(sudo); fi
  echo "setup: installing missing packages: ${missing[*]}"
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
else
  echo "setup: all packages present"
fi

configure=(cmake -S . -B "$BUILD_DIR")
# An existing build dir keeps the generator it was configured with.
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]] && command -v ninja >/dev/null 2>&1; then
  configure+=(-G Ninja)
fi
read -r -a extra <<<"${CMAKE_ARGS:-}"
configure+=("${extra[@]}")

echo "setup: ${configure[*]}"
"${configure[@]}"
echo "setup: cmake --build $BUILD_DIR -j $JOBS"
cmake --build "$BUILD_DIR" -j "$JOBS"
