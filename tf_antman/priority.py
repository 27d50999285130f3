"""The job's device priority (ANTMAN_DEVICE_PRIORITY): the paper's opportunistic jobs run "at a
low priority"; this is where a job takes that priority on its device.

On the emulated device the device *is* the host's cores, so low priority is the kernel's lowest
CPU class: every thread of the job runs under SCHED_IDLE, and the scheduler gives it a core only
when no normal thread wants one. The op manager's share still bounds how much of the device the
job may use; the priority decides who yields at the instant two jobs' kernels want the same core,
which the share cannot (measured in docs/BENCHMARKS.md, "Compute scaling": with it, an
opportunistic job at a 5% share no longer slows a guarantee job by twice its own CPU use).

SCHED_IDLE is one-way for an unprivileged process (sched(7): leaving it needs CAP_SYS_NICE or an
RLIMIT_NICE of 20), so scheduler_lite asks for it only for jobs that are never upgraded.

Threads inherit their creator's policy, so setting every thread that exists at activation (before
TensorFlow or PyTorch start their thread pools) covers the ones created later too.
"""

from __future__ import annotations

import os

from tf_antman._log import log
from tf_antman.config import Settings

_TASKS = "/proc/self/task"


def _idle_every_thread(policy: int) -> int:
    """Puts every thread of this process under `policy`; returns how many it changed. Repeats
    until a pass finds none left: a thread started during a pass by a thread not yet changed
    inherited the old policy."""
    changed = 0
    for _ in range(8):
        found = 0
        for name in os.listdir(_TASKS):
            tid = int(name)
            try:
                if os.sched_getscheduler(tid) == policy:
                    continue
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except ProcessLookupError:  # the thread ended meanwhile
                continue
            found += 1
        changed += found
        if not found:
            break
    return changed


def apply(settings: Settings) -> str:
    """Takes the priority the settings ask for; returns what is in force, for the log. Never
    raises: a priority that cannot be had leaves the job at normal priority, with a warning."""
    if settings.device_priority != "low":
        return "normal"
    if settings.device != "emulated":
        log.warning("ANTMAN_DEVICE_PRIORITY=low is not applied on device %s: only the emulated "
                    "device has a low priority (GPU stream priorities are not used)", settings.device)
        return "normal (low is for the emulated device only)"
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None or not hasattr(os, "sched_setscheduler") or not os.path.isdir(_TASKS):
        log.warning("ANTMAN_DEVICE_PRIORITY=low is not applied: this system has no SCHED_IDLE")
        return "normal (no SCHED_IDLE here)"
    try:
        changed = _idle_every_thread(policy)
    except OSError as e:
        log.warning("ANTMAN_DEVICE_PRIORITY=low is not fully applied: %s", e)
        return f"normal or mixed ({e.strerror or e})"
    log.info("device priority low: %d thread(s) of the job under SCHED_IDLE, and every thread "
             "they start", changed)
    return "low"


__all__ = ["apply"]
