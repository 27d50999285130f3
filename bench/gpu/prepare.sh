#!/usr/bin/env bash
# Builds on the development machine everything the one GPU check (bench/gpu/check.py) needs that
# does not have to match the GPU machine, into one folder that the device call carries:
#
#   OUT/memory_bench, OUT/compute_bench, OUT/libantman_core.so   the bench binaries (nvcc 13, g++;
#                                                                 compute_bench finds the library
#                                                                 beside it: rpath $ORIGIN)
#   OUT/native/libantman_torch.so, OUT/native/libantman_core.so  what tf_antman loads from
#                                                                 tf_antman/_native (the command
#                                                                 copies them there)
#   OUT/wheels/watchdog-*.whl                                    what the GPU image lacks (pip
#                                                                 download; absl-py, pynvml
#                                                                 (nvidia-ml-py), ninja are there)
#
# Only the op hook is built there (against that machine's torch, timed by check.py).
#
# Interface (version 1)
#   bench/gpu/prepare.sh [OUT]                  everything (default OUT: out/gpu_check)
#   bench/gpu/prepare.sh --bench-only OUT       the bench binaries alone (check.py's fallback on
#                                               a machine where they were not carried)
#   Environment: PYTHON (default .venv/bin/python, else python3) for pip download; NVCC, CXX,
#   CUDA_GENCODE as in bench/gpu/build.sh (sm_90 code for H100/H200 + compute_80 PTX).
# Exit status: 0 built, 77 no nvcc, 1 a build or download error, 2 usage.
# Prints the carried folder's size at the end (the device call carries at most 64 MiB in all).

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck source=bench/gpu/build_torch.sh
source "$here/build_torch.sh"

bench_only=0
if [[ "${1:-}" == "--bench-only" ]]; then
  bench_only=1
  shift
fi
if [[ $# -gt 1 ]]; then
  echo "usage: $0 [--bench-only] [OUT]" >&2
  exit 2
fi
out="${1:-$root/out/gpu_check}"
mkdir -p "$out" || exit 1

start=$SECONDS
antman_build_memory_bench "$out" || exit $?
antman_build_compute_bench "$out" || exit $?
rm -rf "${out:?}/core"
echo "bench binaries: $((SECONDS - start)) s" >&2
if [[ $bench_only -eq 1 ]]; then exit 0; fi

mkdir -p "$out/native" || exit 1
antman_build_torch_lib "$out/native" || exit 1
antman_build_core_lib "$out/native" || exit 1
rm -rf "${out:?}/native/core" "${out:?}/native/torch"

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
mkdir -p "$out/wheels" || exit 1
rm -f "$out/wheels/"*.whl
# The GPU image's Python is 3.12 on x86-64 (docs/BENCHMARKS.md); one version of each wheel.
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out/wheels" watchdog==7.1.0 || exit 1
du -sh "$out" >&2
