"""Every CUDA source of the repository compiles with nvcc (CI has nvcc but no GPU, so this is
what CI can check of them; they run on a GPU machine, docs/gpu-path.md). Skipped without nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

NVCC = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
# The architectures of cc/core/cuda/build_and_run.sh: sm_90 code, compute_80 PTX.
ARCH = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_80,code=compute_80"]
# Not ours: environments (.venv, .torchvenv: torch ships .cu templates that are not meant to build
# alone), build trees and git's own folder. Any dot-folder at the top is one of those.
SKIP_DIRS = {"node_modules", "out"}


def cuda_sources() -> list[Path]:
    found = []
    for path in sorted(REPO.rglob("*.cu")):
        rel = path.relative_to(REPO)
        top = rel.parts[0]
        if top in SKIP_DIRS or top.startswith((".", "bazel-")):
            continue
        found.append(rel)
    return found


def test_repository_has_cuda_sources() -> None:
    # Guards the glob: if it silently matched nothing, the test below would check nothing.
    assert Path("cc/core/cuda/cuda_memory_test.cu") in cuda_sources()


@pytest.mark.skipif(not Path(NVCC).exists(), reason=f"nvcc not found ({NVCC})")
@pytest.mark.parametrize("source", cuda_sources(), ids=str)
def test_nvcc_compiles(source: Path, tmp_path: Path) -> None:
    proc = subprocess.run([NVCC, "-std=c++17", "-O2", f"-I{REPO}", *ARCH, "-c", str(REPO / source),
                           "-o", str(tmp_path / "out.o")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed on {source}:\n{proc.stderr[-3000:]}"
