"""What NVML says of GPU 0 before the check measures anything (bench/gpu/check.py, step gpu_idle):
its name, driver, memory, and the compute processes already on it. One JSON line on stdout:

    {"device": str, "driver": str, "memory_total_bytes": int, "memory_used_bytes": int,
     "compute_processes": [{"pid": int, "used_memory_bytes": int | null}, ...]}

Exit status: 0 read, 77 no NVML or no GPU (a line with "skipped" saying why), 1 an NVML error.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no pynvml, no driver: no GPU to read
        print(json.dumps({"skipped": f"NVML unavailable: {type(e).__name__}: {e}"}), flush=True)
        return 77
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            print(json.dumps({"skipped": "NVML reports no GPU"}), flush=True)
            return 77
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)

        def text(value: object) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        procs = [{"pid": int(p.pid),
                  # NVML gives None where the driver hides it (a process of another container)
                  "used_memory_bytes": int(p.usedGpuMemory) if p.usedGpuMemory is not None else None}
                 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        print(json.dumps({"device": text(pynvml.nvmlDeviceGetName(handle)),
                          "driver": text(pynvml.nvmlSystemGetDriverVersion()),
                          "memory_total_bytes": int(mem.total), "memory_used_bytes": int(mem.used),
                          "compute_processes": procs}), flush=True)
        return 0
    except pynvml.NVMLError as e:
        print(f"gpu_procs: NVML: {e}", file=sys.stderr)
        return 1
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
