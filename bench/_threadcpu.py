"""Kernel accounting of a TF job's device work on the emulated device, per thread.

On the emulated device TF's kernels run on its inter-op threads (named "tf_Compute") and the
intra-op (Eigen) threads it starts; Python's own threads (the main loop, tf-antman's agent, the
bench's phase thread) only dispatch and wait. The kernel's per-thread scheduler statistics
(/proc/self/task/TID/schedstat: nanoseconds on a CPU, nanoseconds runnable but waiting for one)
of every thread that is *not* a Python thread are therefore the job's device work, measured by
the kernel and not by the op manager whose share they judge. An op held by the manager sleeps
on a condition variable: neither on a CPU nor runnable, so it adds nothing here.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadTimes:
    on_cpu_s: float  # ran on a CPU
    runnable_s: float  # ran, or was ready to run and waited for a CPU (the device "in use")


_python_tids: set[int] = set()  # every Python thread seen: a joined thread lingers in /proc a while


def _register(frame: object, event: str, arg: object) -> None:
    """Runs once at the start of every thread started from `threading` (threading.settrace),
    so a Python thread is known even if it starts and ends between two samples."""
    _python_tids.add(threading.get_native_id())
    sys.settrace(None)  # one call is all we need: no tracing cost afterwards


threading.settrace(_register)


def device_thread_times() -> ThreadTimes:
    """Summed over the process's live threads that Python did not start (TF's kernels run there)."""
    _python_tids.update(t.native_id for t in threading.enumerate() if t.native_id is not None)
    run = wait = 0
    for name in os.listdir("/proc/self/task"):
        if int(name) in _python_tids:
            continue
        try:
            with open(f"/proc/self/task/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):  # exited, not reaped yet
                    continue
            with open(f"/proc/self/task/{name}/schedstat") as f:
                fields = f.read().split()
        except OSError:  # the thread ended between listdir and open
            continue
        run += int(fields[0])
        wait += int(fields[1])
    return ThreadTimes(run / 1e9, (run + wait) / 1e9)


def machine_busy_s() -> float:
    """CPU-seconds every CPU of the machine spent busy since boot (/proc/stat, all processes)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is in user


def process_cpu_s(pid: int) -> float:
    """CPU-seconds of another process (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
