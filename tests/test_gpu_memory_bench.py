"""bench/gpu memory half: builds with nvcc from the core's sources (no Bazel, no TensorFlow) and
either skips (exit 77, no CUDA driver or device) or passes its checks with the JSON keys that
bench/gpu/check.py reads (step memory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "bench" / "gpu" / "build.sh"
KEYS = ("shrink_gib_per_ms", "shrink_inflight_gib_per_ms", "shrink_inflight_kernel_running_after",
        "limit_overshoot_bytes", "host_fallback_ok", "host_fallback_slowdown")


def _nvcc() -> str | None:
    return os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_memory_bench_builds_and_runs_or_skips(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(BUILD), "--check", str(tmp_path)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode in (0, 77), proc.stderr[-3000:]
    assert (tmp_path / "memory_bench").exists()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert result["bench"] == "gpu_memory" and result["version"] == 1
    if proc.returncode == 77:
        assert "no CUDA device or driver" in result["skipped"]
        return
    for key in KEYS:
        assert key in result
    assert result["limit_overshoot_bytes"] == 0
    assert result["host_fallback_ok"] is True
    assert result["checks_ok"] is True
