#!/usr/bin/env bash
# Builds the memory half of bench/gpu for a GPU machine that has CUDA (nvcc), g++ and Python but
# neither TensorFlow nor Bazel: the memory core's sources (cc/core, no TensorFlow) with g++, and
# bench/gpu/memory_bench.cu with nvcc against them.
#
# Interface (version 1)
#   bench/gpu/build.sh OUT_DIR           build OUT_DIR/memory_bench
#   bench/gpu/build.sh --check OUT_DIR   build, then run `OUT_DIR/memory_bench --quick`
#   source bench/gpu/build.sh            define the functions below and do nothing else
#
#   antman_core_objects OUT_DIR        compile the memory core into OUT_DIR/core/*.o (g++, -fPIC,
#                                      -O2) and print the object paths, one a line; link them
#                                      with -ldl -lpthread
#   antman_build_memory_bench OUT_DIR  build OUT_DIR/memory_bench (calls antman_core_objects)
#   antman_nvcc_flags                  print the nvcc flags used (C++17, -O2, the -gencode list)
#
#   Environment: NVCC (default: `nvcc` on PATH, else /usr/local/cuda/bin/nvcc), CXX (default
#   g++), CUDA_GENCODE (default: sm_90 code for H100/H200 plus compute_80 PTX that newer and
#   Ampere parts JIT).
#
# Exit status of the script: 0 built (and, with --check, the bench passed its checks), 77 skipped
# (no nvcc here, or --check on a machine without a CUDA driver or device: the bench's own 77),
# 1 a build error or a failed check, 2 usage.
# The bench prints one JSON line on stdout (keys: docs/gpu-path.md, "The memory bench").

_antman_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# The memory core: the same sources as //cc/core:memory.
_antman_core_sources=(bfc universal antman_memory backend_emulated backend_cuda)

antman_nvcc() {
  if [[ -n "${NVCC:-}" ]]; then
    echo "$NVCC"
  elif command -v nvcc >/dev/null 2>&1; then
    command -v nvcc
  else
    echo /usr/local/cuda/bin/nvcc
  fi
}

antman_nvcc_flags() {
  local gencode="${CUDA_GENCODE:--gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=compute_80}"
  echo "-std=c++17 -O2 $gencode"
}

antman_core_objects() {
  local out="$1/core"
  local cxx="${CXX:-g++}"
  mkdir -p "$out" || return 1
  local src
  for src in "${_antman_core_sources[@]}"; do
    "$cxx" -std=c++17 -O2 -fPIC -Wall -I"$_antman_root" -c "$_antman_root/cc/core/$src.cc" \
      -o "$out/$src.o" || return 1
    echo "$out/$src.o"
  done
}

antman_build_memory_bench() {
  local out="$1"
  local nvcc
  nvcc="$(antman_nvcc)"
  if [[ ! -x "$nvcc" ]]; then
    echo "SKIP: nvcc not found ($nvcc); set NVCC" >&2
    return 77
  fi
  local objs
  objs="$(antman_core_objects "$out")" || return 1
  # shellcheck disable=SC2046  # the flags and object paths are meant to split
  "$nvcc" $(antman_nvcc_flags) -I"$_antman_root" "$_antman_root/bench/gpu/memory_bench.cu" \
    $objs -o "$out/memory_bench" -ldl -lpthread || return 1
  echo "built $out/memory_bench" >&2
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  check=0
  if [[ "${1:-}" == "--check" ]]; then
    check=1
    shift
  fi
  if [[ $# -ne 1 ]]; then
    echo "usage: $0 [--check] OUT_DIR" >&2
    exit 2
  fi
  antman_build_memory_bench "$1"
  rc=$?
  if [[ $rc -ne 0 ]]; then exit "$rc"; fi
  if [[ $check -eq 1 ]]; then
    "$1/memory_bench" --quick
    exit $?
  fi
  exit 0
fi
