#!/usr/bin/env bash
# Builds the two native libraries a PyTorch job under tf-antman loads, with g++ alone (no Bazel,
# no TensorFlow, no CUDA headers), for a GPU machine that runs bench/gpu_colocate.py from a
# checkout: libantman_torch.so (the CUDAPluggableAllocator shim over the memory core, the same
# sources and export list as //cc/torch:libantman_torch.so) and libantman_core.so (memory core,
# op manager and CUDA event gate, as //:libantman_core.so).
#
# Interface (version 1)
#   bench/gpu/build_torch.sh OUT_DIR    build OUT_DIR/libantman_torch.so and OUT_DIR/libantman_core.so
#                                       (OUT_DIR = tf_antman/_native: where tf_antman loads them)
#
# Objects go to OUT_DIR/core/ (the memory core's, shared by both libraries: bench/gpu/build.sh's
# antman_core_objects) and OUT_DIR/torch/. Environment: CXX (default g++).
# Exit status: 0 built, 1 a build error, 2 usage.

_antman_gpu_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/gpu/build_compute.sh
source "$_antman_gpu_dir/build_compute.sh"

antman_build_torch_lib() {
  local out="$1"
  local cxx="${CXX:-g++}"
  local objs
  objs="$(antman_core_objects "$out")" || return 1
  mkdir -p "$out/torch" || return 1
  local src torch_objs=""
  # The same sources as //cc/torch:allocator_shim and :stream_ordered.
  for src in allocator_shim stream_ordered cuda_events torch_stats; do
    "$cxx" -std=c++17 -O2 -fPIC -Wall -I"$_antman_root" -c "$_antman_root/cc/torch/$src.cc" \
      -o "$out/torch/$src.o" || return 1
    torch_objs="$torch_objs $out/torch/$src.o"
  done
  # shellcheck disable=SC2086  # one object path a line
  "$cxx" -shared -o "$out/libantman_torch.so" $objs $torch_objs \
    -Wl,--version-script="$_antman_root/cc/torch/exports.lds" -ldl -lpthread || return 1
  echo "built $out/libantman_torch.so" >&2
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
  fi
  mkdir -p "$1" || exit 1
  antman_build_torch_lib "$1" || exit 1
  antman_build_core_lib "$1" || exit 1
  rm -rf "${1:?}/core" "${1:?}/torch"
  exit 0
fi
