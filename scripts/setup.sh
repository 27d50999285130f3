#!/usr/bin/env bash
# Sets up a fresh machine (run as root): Bazel, a virtualenv with the pinned TensorFlow, the
# native libraries, and a development hook so `python` in .venv activates tf-antman from this
# checkout when ANTMAN_* is set. Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if ! command -v bazel >/dev/null 2>&1; then
  echo "== installing Debian's bazel-bootstrap"
  if [ "$(id -u)" -ne 0 ]; then echo "need root for apt-get (or install bazel-bootstrap yourself)" >&2; exit 1; fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap
fi

if [ ! -x .venv/bin/python ]; then
  # Debian/Ubuntu ship venv's pip bootstrap (ensurepip) in a package of its own.
  if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    echo "== installing python3-venv (python3 has no ensurepip)"
    if [ "$(id -u)" -ne 0 ]; then echo "need root for apt-get (or install python3-venv yourself)" >&2; exit 1; fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
  fi
  echo "== creating .venv"
  python3 -m venv .venv
fi
# Every package of requirements-dev.txt, ray included (tests/cluster skips without it).
if ! .venv/bin/python -c "import tensorflow, tf_keras, numpy, pynvml, watchdog, absl, pytest, matplotlib, prometheus_client, ray" >/dev/null 2>&1 \
   || ! [ -x .venv/bin/ruff ]; then
  echo "== installing Python packages (tensorflow==2.21.0 ...)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements-dev.txt
fi

# PyTorch's real-torch tests (tests/torch) and the compile check of the extensions' CUDA branch
# run on a CUDA build of torch in a side venv, never in .venv (TensorFlow's): PyPI's torch for
# Linux x86-64 is that build (+cu130: its CUDA headers match the machine's nvcc 13), about 5.5 GB
# and a minute to install from the local wheel cache (docs/pytorch.md).
TORCH_PIN=torch==2.14.1
if ! .torchvenv/bin/python -c "import torch, ninja, numpy, watchdog, absl, pytest; assert torch.__version__.startswith('2.14.1')" >/dev/null 2>&1; then
  echo "== creating .torchvenv ($TORCH_PIN, for tests/torch)"
  python3 -m venv .torchvenv
  .torchvenv/bin/pip install -q "$TORCH_PIN" ninja numpy watchdog absl-py pytest
fi

echo "== building native libraries with Bazel"
TF_ANTMAN_PYTHON=$ROOT/.venv/bin/python .venv/bin/python setup.py -q build_native

# Development hook: the checkout on sys.path and the same autoload line the wheel installs.
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
{ echo "$ROOT"; .venv/bin/python -c "import sys; sys.path.insert(0, '$ROOT'); from tf_antman.importhook import PTH_LINE; print(PTH_LINE, end='')"; } > "$SITE/tf_antman-dev.pth"
# The scheduler's command on the PATH (the dev hook installs no console scripts): .venv/bin for
# this checkout, and /usr/local/bin when run as root, for every user of the machine.
printf '#!/bin/sh\nexec "%s/.venv/bin/python" -m scheduler_lite "$@"\n' "$ROOT" > .venv/bin/scheduler-lite
chmod 755 .venv/bin/scheduler-lite
if [ "$(id -u)" -eq 0 ] && [ -d /usr/local/bin ]; then ln -sf "$ROOT/.venv/bin/scheduler-lite" /usr/local/bin/scheduler-lite; fi
echo "== ready: .venv/bin/python (tf-antman from $ROOT), scheduler-lite on the PATH"
