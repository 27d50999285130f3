#!/usr/bin/env bash
# The one test command (README; .ci/run calls it): sets up what is missing, then lint, the C++
# unit tests under Bazel, and every Python test (TensorFlow jobs, scheduler, simulator, wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TF_ANTMAN_PYTHON=$PWD/.venv/bin/python

echo "== ruff"
.venv/bin/ruff check tf_antman scheduler_lite tests bench examples setup.py

echo "== C++ unit tests (bazel test //cc/...)"
bazel test //cc/...

echo "== Python tests"
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
