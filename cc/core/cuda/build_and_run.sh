#!/usr/bin/env bash
# Builds the GPU test of the memory core (the core's sources with g++, the test with nvcc) into
# OUT_DIR and runs it. Exit status: the test's (0 pass, 1 fail, 77 skipped: no GPU, driver or nvcc).
#   cc/core/cuda/build_and_run.sh OUT_DIR [--build-only]
# NVCC overrides the compiler (default /usr/local/cuda/bin/nvcc).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUT_DIR [--build-only]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
out="$1"
nvcc="${NVCC:-/usr/local/cuda/bin/nvcc}"
if [[ ! -x "$nvcc" ]]; then
  echo "SKIP: nvcc not found at $nvcc" >&2
  exit 77
fi
mkdir -p "$out"

objs=()
for src in bfc universal antman_memory backend_emulated backend_cuda; do
  g++ -std=c++17 -O2 -fPIC -Wall -I"$root" -c "$root/cc/core/$src.cc" -o "$out/$src.o"
  objs+=("$out/$src.o")
done
# sm_90 machine code for H100/H200, compute_80 PTX so newer and Ampere parts JIT it.
"$nvcc" -std=c++17 -O2 -I"$root" \
  -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=compute_80 \
  "$root/cc/core/cuda/cuda_memory_test.cu" "${objs[@]}" -o "$out/cuda_memory_test" -ldl -lpthread
echo "built $out/cuda_memory_test"

if [[ "${2:-}" == "--build-only" ]]; then
  exit 0
fi
exec "$out/cuda_memory_test"
