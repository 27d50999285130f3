"""bench/gpu/build_torch.sh: the two native libraries of a PyTorch job, built with g++ alone (as on
a GPU machine without Bazel), export only their C APIs and serve the shim's calls as the Bazel
builds do: the allocator shim's C functions driven through ctypes, as PyTorch calls them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "bench" / "gpu" / "build_torch.sh"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native")
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["libantman_core.so", "libantman_torch.so"]
    return out


def exported(lib: Path) -> list[str]:
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in nm.stdout.splitlines() if line.strip()]


def test_only_the_c_apis_are_exported(built: Path) -> None:
    torch_names = exported(built / "libantman_torch.so")
    assert "antman_torch_malloc" in torch_names and "antman_torch_free" in torch_names
    assert all(n.startswith(("antman_torch_", "antman_mem_")) for n in torch_names), torch_names
    core_names = exported(built / "libantman_core.so")
    assert "antman_gate_begin" in core_names and "antman_opm_admit" in core_names
    assert all(n.startswith(("antman_mem_", "antman_opm_", "antman_gate_", "antman_core_")) for n in core_names)


def test_the_g_plus_plus_shim_serves_falls_back_and_refuses(built: Path) -> None:
    from tf_antman.torch import _shim

    mib = 1 << 20
    path = built / "libantman_torch.so"
    mem = _shim.create(_shim.load(path), path, "emulated", 0, 64 * mib, 16 * mib, 16 * mib)
    a = mem.malloc(12 * mib)
    b = mem.malloc(12 * mib)  # past the 16 MiB limit: the host arena, not a refusal
    assert a and b and mem.is_host(a) == 0 and mem.is_host(b) == 1
    assert mem.malloc(32 * mib) == 0 and mem.failures() == 1  # neither can serve it: NULL, counted
    for p in (a, b):
        mem.free(p, 12 * mib)
    s = mem.mem_stats()
    assert s.in_use == 0 and s.host_in_use == 0 and mem.check_invariants() == ""
