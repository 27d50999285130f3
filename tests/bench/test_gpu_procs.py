"""The GPU check's first step with its real program (bench/gpu/gpu_procs.py) against a fake NVML:
a `pynvml` module on PYTHONPATH with the functions of nvidia-ml-py that gpu_procs.py calls
(nvmlInit, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetName,
nvmlSystemGetDriverVersion, nvmlDeviceGetMemoryInfo, nvmlDeviceGetComputeRunningProcesses with
objects carrying pid and usedGpuMemory, None where the driver hides it, nvmlShutdown). The model
assumes those names and fields, as nvidia-ml-py (the GPU image's pynvml) has them. A busy GPU
makes check.py refuse in one line before anything else runs. No GPU: CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
GPU_PROCS = REPO / "bench" / "gpu" / "gpu_procs.py"
CHECK = REPO / "bench" / "gpu" / "check.py"

FAKE_PYNVML = '''
import types
PROCS = {procs!r}
class NVMLError(Exception):
    pass
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return "h0"
def nvmlDeviceGetName(h): return b"NVIDIA H100 80GB HBM3"
def nvmlSystemGetDriverVersion(): return "580.159.04"
def nvmlDeviceGetMemoryInfo(h): return types.SimpleNamespace(total=85 << 30, used=2 << 30, free=83 << 30)
def nvmlDeviceGetComputeRunningProcesses(h):
    return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in PROCS]
'''


def fake_nvml(tmp: Path, procs: list[tuple[int, int | None]]) -> dict[str, str]:
    (tmp / "pynvml.py").write_text(FAKE_PYNVML.format(procs=procs))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env["PYTHONPATH"] = str(tmp)
    return env


def test_gpu_procs_lists_compute_processes(tmp_path: Path) -> None:
    env = fake_nvml(tmp_path, [(4242, 3 << 30), (77, None)])
    proc = subprocess.run([sys.executable, "-S", str(GPU_PROCS)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"device": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "memory_total_bytes": 85 << 30,
                   "memory_used_bytes": 2 << 30, "compute_processes": [
                       {"pid": 4242, "used_memory_bytes": 3 << 30}, {"pid": 77, "used_memory_bytes": None}]}


def test_without_nvml_it_says_why_and_exits_77(tmp_path: Path) -> None:
    (tmp_path / "pynvml.py").write_text("def nvmlInit():\n    raise OSError('NVML Shared Library Not Found')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-S", str(GPU_PROCS)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 77
    assert json.loads(proc.stdout) == {"skipped": "NVML unavailable: OSError: NVML Shared Library Not Found"}


def test_check_refuses_a_busy_gpu_with_the_real_program(tmp_path: Path) -> None:
    env = fake_nvml(tmp_path, [(4242, 3 << 30)])
    proc = subprocess.run([sys.executable, "-S", str(CHECK), "--out", str(tmp_path / "out"), "--bin",
                           str(tmp_path / "no_bin")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "out" / "check.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == ["gpu_idle", "summary"]
    assert lines[0]["error"] == "refused: the GPU already has compute processes: pid 4242 (3072 MiB)"
    assert "refused: the GPU already has compute processes: pid 4242 (3072 MiB)" in proc.stderr


def test_an_idle_gpu_goes_on_to_the_next_step(tmp_path: Path) -> None:
    env = fake_nvml(tmp_path, [])
    proc = subprocess.run([sys.executable, "-S", str(CHECK), "--out", str(tmp_path / "out"), "--only", "gpu_idle"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads((tmp_path / "out" / "check.jsonl").read_text().splitlines()[0])
    assert first["status"] == "passed" and first["device"] == "NVIDIA H100 80GB HBM3"
    assert first["compute_processes"] == []
