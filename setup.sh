#!/usr/bin/env bash
# Installs loom's dependencies (Debian packages, as root, idempotent) and builds it into build/.
#   bash setup.sh            # install + configure + build (Release)
#   LOOM_SKIP_INSTALL=1 bash setup.sh   # build only
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
packages=(
  g++ cmake make pkg-config
  mpich libmpich-dev
  libhdf5-mpich-dev hdf5-tools
  libboost-program-options-dev
  libtrilinos-kokkos-dev
  libopenblas-dev libdnnl-dev
  nlohmann-json3-dev
  libsentencepiece-dev sentencepiece python3-sentencepiece python3.11-doc
  googletest libgtest-dev libbenchmark-dev
  python3-torch python3-h5py python3-numpy
  jube python3-matplotlib
  clang-format
)
if [ "${LOOM_SKIP_INSTALL:-0}" != 1 ]; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
      echo "setup.sh: these Debian packages are missing and installing them needs root: ${missing[*]}" >&2
      exit 1
    fi
    echo "setup.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "setup.sh: all Debian packages present"
  fi
fi
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S "$here" -B "$here/build" -DCMAKE_BUILD_TYPE="${LOOM_BUILD_TYPE:-Release}" ${LOOM_CMAKE_ARGS:-}
cmake --build "$here/build" -j "$jobs"
