"""bench/gpu compute half: `prepare.sh --bench-only` builds libantman_core.so and compute_bench
with nvcc (no Bazel, no TensorFlow), the library exports only the C APIs, and without a GPU the
one GPU check (bench/gpu/check.py) skips with exit 77 and says why in each step's line instead of
failing."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "bench" / "gpu" / "check.py"
PREPARE = REPO / "bench" / "gpu" / "prepare.sh"


def _nvcc() -> str | None:
    return os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _gpu_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed"),
    pytest.mark.skipif(not (REPO / "bench" / "gpu" / "build.sh").exists(),
                       reason="bench/gpu/build.sh (memory half, branch mem) is not merged yet"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench_gpu")
    proc = subprocess.run(["bash", str(PREPARE), "--bench-only", str(out)], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["compute_bench", "libantman_core.so", "memory_bench"]
    return out


def test_core_library_exports_only_the_c_apis(built: Path) -> None:
    nm = subprocess.run(["nm", "-D", "--defined-only", str(built / "libantman_core.so")],
                        capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in nm.stdout.splitlines() if line.strip()]
    assert names, "nothing exported"
    assert all(n.startswith(("antman_mem_", "antman_opm_", "antman_gate_", "antman_core_"))
               for n in names), names
    for needed in ("antman_gate_begin", "antman_opm_admit", "antman_mem_alloc"):
        assert needed in names


def test_compute_bench_runs_or_skips(built: Path) -> None:
    proc = subprocess.run([str(built / "compute_bench"), "probe"], capture_output=True, text=True,
                          timeout=120)
    if _gpu_present() and proc.returncode == 0:
        return  # a GPU machine: check.py measures there
    assert proc.returncode == 77, proc.stderr
    assert "no CUDA device or driver" in json.loads(proc.stdout)["skipped"]


def test_compute_bench_refuses_bad_arguments_naming_them(built: Path) -> None:
    bench = str(built / "compute_bench")
    for args, message in [(["guarantee", "--iters", "0", "--kernels", "5"], "--iters: 0 is outside"),
                          (["guarantee", "--iters", "5", "--kernels", "0"], "--kernels: 0 is outside"),
                          (["opportunist", "--iters", "5", "--share", "1.5"], "--share: 1.5 is outside"),
                          (["share", "--kernel-us", "2"], "--kernel-us: 2 is outside"),
                          (["share", "--host-us", "-1"], "--host-us: -1 is outside"),
                          (["turbo"], "usage:")]:
        proc = subprocess.run([bench, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr


def test_check_skips_without_a_gpu_saying_why(built: Path, tmp_path: Path) -> None:
    if _gpu_present():
        pytest.skip("a CUDA driver is present: check.py would measure")
    proc = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path), "--bin", str(built)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 77, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "check.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in lines}
    assert steps["binaries"]["status"] == "skipped" and "no CUDA device or driver" in steps["binaries"]["reason"]
    for name in ("memory", "compute_long", "compute_short", "op_hook_build", "torch_smoke", "interference",
                 "colocate"):
        assert steps[name]["status"] == "skipped" and "no CUDA device" in steps[name]["reason"], steps[name]
    assert lines[-1]["step"] == "summary" and lines[-1]["ran"] == [] and lines[-1]["ok"] is True
