#!/usr/bin/env bash
# Checks that tf-antman's PyTorch extensions (tf_antman/torch/*.cpp: the op hook and the CUDA
# allocator) build against another release of torch than CI's, without installing it anywhere:
#
#   scripts/check_torch_headers.sh 2.11.0
#
# Downloads PyPI's Linux x86-64 wheel of that torch (the CUDA build; --no-deps, about 0.5-1 GB)
# into a cache folder, unpacks only its headers, its cpp_extension.py (to read the C++ standard
# it compiles extensions with), and its shared libraries (to check every torch symbol the
# extensions use is exported: a compile alone would not see a symbol libtorch keeps hidden, which
# fails only at import on the GPU machine). Then compiles each source's CUDA branch
# (-DANTMAN_WITH_CUDA) as torch.utils.cpp_extension would (tests/torch/test_cuda_build.py's flags,
# with this release's -std and C++ ABI), compile only, and prints one line per extension.
#
# Not part of CI (the download). Needs g++, the CUDA headers ($CUDA_HOME, else /usr/local/cuda),
# a Python with pip ($PYTHON, else .venv's, else python3; its version picks the wheel and its
# Python.h is used), nm and unzip. Cache: $TF_ANTMAN_TORCH_HEADERS_CACHE, else
# /tmp/tf-antman-torch-headers (one folder per version; remove it to download again).
# Exit status: 0 when every extension compiles and links, 1 when one does not, 2 on a usage or
# set-up error. Results of past runs: docs/pytorch.md, "Versions".
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

VERSION=${1:-}
if [[ ! $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: $0 VERSION   (a torch release on PyPI, as 2.11.0; got '${VERSION}')" >&2
  exit 2
fi
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
CUDA=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$CUDA/include/cuda_runtime_api.h" ]; then
  echo "no CUDA headers in $CUDA/include: set CUDA_HOME to a CUDA toolkit" >&2
  exit 2
fi
for tool in g++ nm unzip c++filt; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed" >&2; exit 2; }
done
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYINC=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
CACHE=${TF_ANTMAN_TORCH_HEADERS_CACHE:-/tmp/tf-antman-torch-headers}/$VERSION-py$PYVER
mkdir -p "$CACHE"

wheel=$(ls "$CACHE"/torch-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "== downloading torch $VERSION (Python $PYVER, Linux x86-64) into $CACHE" >&2
  # --isolated and no config file: a machine's pip configuration may cap torch's version
  # (a constraints file) or point at another index; this check wants PyPI's wheel as released.
  PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download --isolated --quiet --no-deps \
    --only-binary=:all: --implementation cp --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$CACHE" "torch==$VERSION"
  wheel=$(ls "$CACHE"/torch-"$VERSION"-*.whl | head -1)
fi
if [ ! -d "$CACHE/torch/include" ]; then
  echo "== unpacking headers and libraries of $(basename "$wheel")" >&2
  unzip -q -o "$wheel" 'torch/include/*' 'torch/version.py' 'torch/utils/cpp_extension.py' \
    'torch/lib/libc10*.so' 'torch/lib/libtorch*.so' -d "$CACHE"
fi
T=$CACHE/torch
build=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$T/version.py")

# The C++ standard this release's cpp_extension compiles extensions with (c++17 in 2.11, c++20
# in 2.12 to 2.14): the flag it adds to every non-Windows compile.
STD=$(grep -o "'-fPIC', '-std=c++[0-9]*'" "$T/utils/cpp_extension.py" | head -1 \
  | grep -o 'c++[0-9]*' || true)
STD=${STD:-c++17}
# The C++ ABI libtorch was built with (PyPI's wheels: the new one since 2.7, the old one before,
# when cpp_extension passed -D_GLIBCXX_USE_CXX11_ABI=0 read from torch._C): which std::string
# c10's assertion helper takes. Any __cxx11 symbol would not do: 2.6's old-ABI libc10 has some.
# (grep -c, not -q: -q would stop reading early and pipefail then count nm's SIGPIPE as "no".)
ABI=0
if [ "$(nm -D --defined-only "$T/lib/libc10.so" \
      | grep -c '_ZN3c106detail23torchInternalAssertFail.*__cxx11')" -gt 0 ]; then ABI=1; fi

# Every symbol the extensions may take from outside: torch's libraries, the C++ and C runtimes,
# the CUDA runtime. Python's own (Py*, _Py*) come from the interpreter that imports the module;
# _GLOBAL_OFFSET_TABLE_ and __dso_handle from the linker.
defined=$CACHE/defined-symbols.txt
libs=("$T"/lib/*.so)
for lib in libstdc++.so.6 libc.so.6 libm.so.6 libgcc_s.so.1 ld-linux-x86-64.so.2; do
  path=$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ {print $NF; exit}')
  [ -n "$path" ] || path=$(g++ -print-file-name="$lib")
  if [ -f "$path" ]; then libs+=("$path"); fi
done
libs+=("$CUDA"/lib64/libcudart.so*)
for lib in "${libs[@]}"; do
  nm -D --defined-only "$lib" 2>/dev/null | awk '{print $NF}' | sed 's/@.*//'
done | sort -u > "$defined"

status=0
mkdir -p "$CACHE/obj"
for source in "$REPO"/tf_antman/torch/*.cpp; do
  name=$(basename "$source")
  obj=$CACHE/obj/${name%.cpp}.o
  log=$CACHE/obj/${name%.cpp}.log
  # As tests/torch/test_cuda_build.py (cpp_extension's flags for a job's build, at -O0).
  if ! g++ -std="$STD" -fPIC -O0 -DNDEBUG -DANTMAN_WITH_CUDA \
      -DTORCH_EXTENSION_NAME=antman_header_check -DTORCH_API_INCLUDE_EXTENSION_H \
      -D_GLIBCXX_USE_CXX11_ABI=$ABI \
      -isystem "$T/include" -isystem "$T/include/torch/csrc/api/include" \
      -isystem "$CUDA/include" -isystem "$PYINC" \
      -c "$source" -o "$obj" > "$log" 2>&1; then
    first=$(grep -m1 'error' "$log" || tail -1 "$log")
    echo "torch $build: $name: DOES NOT COMPILE (-std=$STD, ABI $ABI): $first [all: $log]"
    status=1
    continue
  fi
  missing=$(nm -u "$obj" | awk '$1 == "U" {print $2}' | sed 's/@.*//' \
    | grep -v -e '^_\?Py' -e '^_GLOBAL_OFFSET_TABLE_$' -e '^__dso_handle$' \
    | sort -u | comm -23 - "$defined" | c++filt || true)
  if [ -n "$missing" ]; then
    echo "torch $build: $name: compiles (-std=$STD, ABI $ABI) but $(echo "$missing" | wc -l)" \
      "symbol(s) are in none of torch's libraries: $(echo "$missing" | head -3 | tr '\n' ';')"
    status=1
  else
    echo "torch $build: $name: compiles (-std=$STD, ABI $ABI, CUDA branch), every symbol it" \
      "uses is exported by torch's libraries or the C++/CUDA runtimes"
  fi
done
exit $status
