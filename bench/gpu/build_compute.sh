#!/usr/bin/env bash
# Builds the compute half of bench/gpu on a GPU machine without TensorFlow or Bazel:
# libantman_core.so (the memory core, op manager and CUDA gate with their C APIs, g++, the same
# export list as //:libantman_core.so) and compute_bench (nvcc), linked to it with an $ORIGIN
# rpath so the pair can be moved together.
#
# Interface (version 1)
#   bench/gpu/build_compute.sh OUT_DIR     build OUT_DIR/libantman_core.so and OUT_DIR/compute_bench
#   source bench/gpu/build_compute.sh      define antman_build_core_lib / antman_build_compute_bench
#
# It reuses bench/gpu/build.sh (memory half): its memory-core object list, nvcc lookup and
# -gencode flags (sm_90 code + compute_80 PTX; NVCC, CXX, CUDA_GENCODE as documented there).
# Exit status: 0 built, 77 skipped (no nvcc here), 1 a build error, 2 usage.

_antman_gpu_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/gpu/build.sh
source "$_antman_gpu_dir/build.sh"
# The op manager and gate sources of //cc/core:op_manager and //cc/core:core_c_api.
_antman_compute_sources=(op_manager antman_ops cuda_gate)

antman_build_core_lib() {
  local out="$1"
  local cxx="${CXX:-g++}"
  local objs
  objs="$(antman_core_objects "$out")" || return 1
  local src
  for src in "${_antman_compute_sources[@]}"; do
    "$cxx" -std=c++17 -O2 -fPIC -Wall -I"$_antman_root" -c "$_antman_root/cc/core/$src.cc" \
      -o "$out/core/$src.o" || return 1
    objs+=$'\n'"$out/core/$src.o"
  done
  # shellcheck disable=SC2086  # one object path a line
  "$cxx" -shared -o "$out/libantman_core.so" $objs \
    -Wl,--version-script="$_antman_root/cc/core/core_exports.lds" -ldl -lpthread || return 1
  echo "built $out/libantman_core.so" >&2
}

antman_build_compute_bench() {
  local out="$1"
  local nvcc
  nvcc="$(antman_nvcc)"
  if [[ ! -x "$nvcc" ]]; then
    echo "SKIP: nvcc not found ($nvcc); set NVCC" >&2
    return 77
  fi
  antman_build_core_lib "$out" || return 1
  # shellcheck disable=SC2046  # the flags are meant to split
  "$nvcc" $(antman_nvcc_flags) -I"$_antman_root" "$_antman_root/bench/gpu/compute_bench.cu" \
    -o "$out/compute_bench" -L"$out" -lantman_core -Xlinker -rpath='$ORIGIN' -lpthread || return 1
  echo "built $out/compute_bench" >&2
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
  fi
  antman_build_compute_bench "$1"
  exit $?
fi
