"""CUDA_DEVICE_ORDER=PCI_BUS_ID wherever a bench matches NVML's GPU index with CUDA's device
number (issue 29): NVML numbers GPUs by PCI bus, CUDA fastest first unless told, so on a host of
mixed GPUs NVML's GPU 0 and CUDA's device 0 could differ. The benches set it for the programs
they start, over an inherited value. No GPU: a fake `pynvml` reports the order its program saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
CHECK = REPO / "bench" / "gpu" / "check.py"

# nvidia-ml-py's names as bench/gpu/gpu_procs.py calls them; the device name is the order seen.
FAKE_PYNVML = '''
import os, types
class NVMLError(Exception):
    pass
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return "h0"
def nvmlDeviceGetName(h): return os.environ.get("CUDA_DEVICE_ORDER", "unset")
def nvmlSystemGetDriverVersion(): return "580.159.04"
def nvmlDeviceGetMemoryInfo(h): return types.SimpleNamespace(total=85 << 30, used=0, free=85 << 30)
def nvmlDeviceGetComputeRunningProcesses(h): return []
'''


def test_the_gpu_checks_programs_get_the_pci_bus_order(tmp_path: Path) -> None:
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(PYTHONPATH=str(tmp_path), CUDA_DEVICE_ORDER="FASTEST_FIRST")
    proc = subprocess.run([sys.executable, "-S", str(CHECK), "--out", str(tmp_path / "out"), "--only", "gpu_idle"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads((tmp_path / "out" / "check.jsonl").read_text().splitlines()[0])
    assert first["device"] == "PCI_BUS_ID"  # what gpu_procs.py, started by check.py, saw


def test_gpu_colocate_jobs_get_the_pci_bus_order() -> None:
    probe = ("import os, sys; sys.path.insert(0, sys.argv[1]); import _gpu_jobs; "
             "print(_gpu_jobs.env_for({'ANTMAN_ENABLE': '1'})['CUDA_DEVICE_ORDER'])")
    env = {**os.environ, "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    proc = subprocess.run([sys.executable, "-c", probe, str(REPO / "bench")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "PCI_BUS_ID"
