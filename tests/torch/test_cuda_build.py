"""The CUDA branch of every PyTorch extension tf-antman builds at run time compiles (compile only:
no GPU here) against a CUDA build of torch and the machine's CUDA headers.

A job on a GPU builds these sources with torch.utils.cpp_extension and ANTMAN_WITH_CUDA; the CPU
tests build them without it, so without this test a CUDA-only compile error would first show on
a lent GPU machine. The torch comes from $TF_ANTMAN_TORCH_PYTHON (scripts/test.sh points it at
.torchvenv, PyPI's CUDA build of torch 2.14.1); the CUDA headers from $CUDA_HOME, else
/usr/local/cuda. Skipped, with the reason, where either is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.torch.python_with_torch import torch_python

# Every C++ source under tf_antman/torch that a job compiles with ANTMAN_WITH_CUDA.
SOURCES = sorted((REPO / "tf_antman" / "torch").glob("*.cpp"))

# What torch.utils.cpp_extension passes for a CUDA extension, read from the torch in use.
FLAGS_PROBE = """
import sysconfig, torch
from torch.utils import cpp_extension as c
if not torch.version.cuda:
    raise SystemExit("torch " + torch.__version__ + " is a CPU-only build (no CUDA headers)")
paths = c.include_paths(device_type="cuda") + [sysconfig.get_paths()["include"]]
print(" ".join(["-I" + p for p in paths] + ["-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI)]))
"""


def cuda_home() -> Path | None:
    home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    return home if (home / "include" / "cuda_runtime_api.h").is_file() else None


@pytest.fixture(scope="module")
def flags() -> list[str]:
    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    home = cuda_home()
    if home is None:
        pytest.skip("no CUDA headers: set CUDA_HOME to a CUDA toolkit (cuda_runtime_api.h)")
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    probe = subprocess.run([python, "-c", FLAGS_PROBE], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "CUDA_HOME": str(home)})
    if probe.returncode != 0:
        pytest.skip(f"{python}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return probe.stdout.split()


def test_there_are_extension_sources() -> None:
    assert [p.name for p in SOURCES if p.name == "op_hook.cpp"], SOURCES


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_the_cuda_branch_compiles(source: Path, flags: list[str], tmp_path: Path) -> None:
    # As cpp_extension compiles a job's build (C++20, NDEBUG: compute.py), at -O0: compile only.
    # torch 2.11's cpp_extension uses C++17, which 2.14.1's headers refuse: that and other
    # releases are checked by hand with scripts/check_torch_headers.sh (docs/pytorch.md).
    cmd = ["g++", "-std=c++20", "-fPIC", "-O0", "-DNDEBUG", "-DANTMAN_WITH_CUDA",
           "-DTORCH_EXTENSION_NAME=antman_ci_build", "-DTORCH_API_INCLUDE_EXTENSION_H", *flags,
           "-c", str(source), "-o", str(tmp_path / "out.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
