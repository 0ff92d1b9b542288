#!/usr/bin/env bash
# Sets up and builds dattn on Debian 12: installs the Debian packages the build needs (only the
# missing ones, so a second run installs nothing), then configures and builds with CMake.
#   bash launch/setup.sh [extra cmake configure arguments, e.g. -DDATTN_WITH_CUDA=OFF]
# Environment: BUILD_DIR (default: build, relative to the repository root), BUILD_TYPE (default
# Release). Works from any directory.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-build}
[[ $build_dir = /* ]] || build_dir=$repo/$build_dir
build_type=${BUILD_TYPE:-Release}

say() { echo "dattn setup: $*"; }
die() { echo "dattn setup: error: $*" >&2; exit 1; }

# ---------------------------------------------------------------- Debian packages
# The compiler and build tools (ccache: a rebuild, or another checkout's build, reuses what was
# compiled before), Open MPI, Boost.Program_options (the CLI), nlohmann's JSON (the benchmarks'
# JSON files), Boost.Context (the fibers of the CUDA emulation's threads, tests/emu),
# GoogleTest/GoogleMock, OpenBLAS with its pthread variant (the CPU tile GEMMs; without it the
# reference BLAS is used, ~50x slower), oneDNN (the tile GEMMs on AVX-512, AVX512-BF16 and AMX)
# with the OpenCL loader's headers, which its CMake package requires (only a recommendation of
# libdnnl-dev, which --no-install-recommends skips: without them configure fails), clang-format for the format check, clang with its sanitizer and libFuzzer runtimes and its
# OpenMP (the fuzz build, DATTN_FUZZ), and, for Debian's /usr/bin/python3, matplotlib for the
# charts of launch/plot.py and what the Python binding (python/) builds and is tested with: its
# headers, pybind11, numpy, torch (CPU) and mpi4py (built on Debian's Open MPI, dattn's: the
# tests of dattn.from_comm), and venv for launch/pypi_venv.sh.
packages=(cmake g++ make ccache libopenmpi-dev openmpi-bin libboost-program-options-dev
          nlohmann-json3-dev libboost-context-dev libgtest-dev libgmock-dev libopenblas-dev
          libopenblas0-pthread libdnnl-dev ocl-icd-opencl-dev clang-format clang libclang-rt-dev libomp-dev
          python3-matplotlib python3-dev python3-venv pybind11-dev python3-numpy python3-torch python3-mpi4py)
# Thrust (kernels/movement, OMP backend): the CUDA toolkit's CCCL when it is there, else Debian's.
if [[ ! -f /usr/local/cuda/include/cccl/thrust/version.h ]]; then
  packages+=(libthrust-dev libcub-dev)
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  say "not a Debian system (no dpkg-query): skipping package install; needs ${packages[*]}"
else
  missing=()
  for p in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ $status = "install ok installed" ]] || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    say "packages: all ${#packages[@]} installed"
  else
    sudo=()
    if ((EUID != 0)); then
      command -v sudo >/dev/null 2>&1 || die "not root and no sudo: install ${missing[*]}"
      sudo=(sudo)
    fi
    log=$(mktemp "${TMPDIR:-/tmp}/dattn-setup-apt.XXXXXX.log")
    say "installing ${missing[*]} (log: $log)"
    if ! { "${sudo[@]}" apt-get update -q &&
           "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
         >"$log" 2>&1 </dev/null; then
      echo "dattn setup: apt-get failed; last lines of $log:" >&2
      tail -n 40 "$log" >&2
      exit 1
    fi
    rm -f "$log"
  fi
fi

# ---------------------------------------------------------------- configure and build
cmake_args=(-S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE="$build_type")
# ccache for every compiler; paths inside the checkout count as relative, so that a fresh clone
# elsewhere (CI's) hits what this one compiled.
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$repo} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
  cmake_args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
               -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# CMake finds nvcc on PATH by itself; the toolkit's usual place is not on PATH in a fresh shell.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  cmake_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi

say "configuring ($build_type) in $build_dir"
cmake "${cmake_args[@]}" "$@"

jobs=$(nproc 2>/dev/null || echo 2)
say "building with $jobs jobs"
cmake --build "$build_dir" -j"$jobs"
say "done: programs in $build_dir/bin"
