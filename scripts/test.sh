#!/usr/bin/env bash
# The one test command (README; .ci/run calls it): sets up what is missing, then lint, the C++
# unit tests under Bazel, and every Python test (TensorFlow jobs, scheduler, simulator, wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TF_ANTMAN_PYTHON=$PWD/.venv/bin/python
# PyTorch jobs in tests run on .torchvenv's CUDA build of torch, on the CPU (setup.sh).
export TF_ANTMAN_TORCH_PYTHON=$PWD/.torchvenv/bin/python
# As root (CI), the multi-user tests must run, not skip: they fail if the test users they create
# find no interpreter they may run (tests/scheduler/test_multiuser.py, docs/security.md).
if [ "$(id -u)" -eq 0 ]; then export SCHEDULER_LITE_MULTIUSER=required; fi

echo "== ruff"
.venv/bin/ruff check tf_antman scheduler_lite tests bench examples setup.py

echo "== C++ unit tests (bazel test //cc/...)"
bazel test //cc/...

# The tests that import torch in their own process (they skip in .venv, which has none), before
# the main run so that its summary stays the last line; .torchvenv/bin on the PATH for ninja (the
# op hook's build).
echo "== PyTorch tests in .torchvenv"
PATH=$PWD/.torchvenv/bin:$PATH .torchvenv/bin/python -m pytest -q -p no:cacheprovider tests/torch/test_real_torch.py tests/torch/test_real_torch_allocator.py

echo "== Python tests"
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
