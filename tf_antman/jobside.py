"""The job agent wired to the native runtime: controls from the coordinator act on the real
allocator and operator manager, and stats.json reports what they measure."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tf_antman import exit_report
from tf_antman._log import log
from tf_antman.agent import JobAgent
from tf_antman.final_state import FinalState
from tf_antman.protocol import DeviceStats, JobDirBusy

if TYPE_CHECKING:
    from tf_antman.native import Native
    from tf_antman.steps import MemoryLimits, StepTracker


class NativeActuator:
    """Called by the agent at a step boundary, at its start, or from its fallback thread: the
    limit applies at once (the allocator takes it under its own mutex) and the share is an atomic
    the op manager reads at each admission, so every call is safe from any thread."""

    def __init__(self, native: Native, device_id: int, limits: MemoryLimits,
                 received_at: Callable[[], float | None]) -> None:
        self.native = native
        self.device_id = device_id
        self.limits = limits
        self.received_at = received_at  # when the control being applied was read
        self._clipped_from: int | None = None  # the last limit clipped to the capacity (logged once)

    def set_memory_limit(self, device: int, limit_bytes: int) -> None:
        if device != self.device_id:
            raise ValueError(f"this job runs on device {self.device_id}, not {device}")
        capacity = int(self.native.mem_stats().device_capacity)
        if limit_bytes > capacity:
            # Clipped, as ANTMAN_MEMORY_LIMIT is held to ANTMAN_DEVICE_MEMORY: a limit above the
            # device's memory means "the whole device" (docs/protocol.md); stats.json then reports
            # the capacity as the limit in force.
            if limit_bytes != self._clipped_from:
                log.warning("control memory limit %d bytes for device %d is above the device's memory "
                            "(%d bytes): clipped to it", limit_bytes, device, capacity)
            self._clipped_from = limit_bytes
            limit_bytes = capacity
        self.limits.coordinator(limit_bytes, self.received_at())

    def set_compute_share(self, share: float) -> None:
        self.native.set_share(share)

    # Pausing is done by the agent itself: it holds the training thread at the step boundary, or,
    # away from one, sets the share to 0 (which holds ops at their admission).
    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


class NativeStatsSource:
    def __init__(self, native: Native, device_id: int) -> None:
        self.native = native
        self.device_id = device_id

    def device_stats(self) -> list[DeviceStats]:
        m = self.native.mem_stats()
        # Per-step figures cover the step that just ended: StepTracker resets them only after
        # the agent has run (steps.py).
        return [DeviceStats(
            device=self.device_id,
            limit_bytes=int(m.limit),
            in_use_bytes=int(m.in_use),
            reserved_bytes=int(m.reserved),
            step_peak_bytes=int(m.step_peak_in_use),
            step_min_bytes=int(min(m.step_min_in_use, m.step_peak_in_use)),
            host_in_use_bytes=int(m.host_in_use),
            host_peak_bytes=int(m.host_peak),
            host_fallbacks=int(m.host_fallbacks),
        )]

    def compute_share(self) -> float:
        return float(self.native.op_stats().share)

    def shares(self) -> tuple[float, float | None]:
        s = self.native.op_stats()  # one read: the achieved share belongs to the share beside it
        # At 100% ops run directly and are not timed (the hot path is one atomic load).
        return float(s.share), (None if s.share >= 1.0 else float(s.achieved_share_window))


def start_agent(steps: StepTracker) -> JobAgent | None:
    """The job agent on ANTMAN_JOB_DIR, or None: without a job directory, or when the agent cannot
    start (logged once), the job runs without one. Either way the process's end is watched
    (final_state.py): the final state when there is an agent, the exit report on SIGTERM, Ctrl-C
    while ops are held at share 0.

    Never raises: a directory the agent cannot use (read-only, gone since start-up) must not stop
    training. config.py has refused what it could foresee (ANTMAN_JOB_DIR missing or not
    writable) with a ConfigError already.
    """
    launcher = launcher_name()
    if steps.settings.job_dir and launcher is not None:
        # The first process of the job directory takes its agent for good (lock.py); a launcher
        # that imports torch and then starts the trainer would keep it, and the trainer would run
        # unmanaged. It trains nothing: no agent, no exit report here.
        log.info("%s is a launcher (pid %d): the job agent starts in the training process it runs",
                 launcher, os.getpid())
        return None
    agent = _try_agent(steps) if steps.settings.job_dir else None
    native = steps.native
    FinalState(agent, lambda: exit_report.report(native),
               release_hold=lambda: release_hold(native)).install()
    return agent


def release_hold(native: Native) -> None:
    """Ctrl-C while ops are held at compute share 0: let them run (share 1.0), so that the main
    thread returns to Python and raises KeyboardInterrupt (final_state.py)."""
    if float(native.op_stats().share) == 0.0:
        log.warning("interrupted (SIGINT) while ops are held at compute share 0: releasing them "
                    "(share 1.0) so that the interrupt is raised")
        native.set_share(1.0)


# Programs that import the framework and then start the process that trains (torchrun's console
# script, `python -m torch.distributed.run`, Accelerate's and DeepSpeed's launchers).
LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "deepspeed"})
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                              "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner"})


def launcher_name() -> str | None:
    """The launcher this process runs, or None: a script named in LAUNCHER_SCRIPTS, or a module
    run with `python -m` named in LAUNCHER_MODULES."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    module = spec.name if spec is not None else module_run_with_m(getattr(sys, "orig_argv", ()))
    if module in LAUNCHER_MODULES:
        return f"python -m {module}"
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script if script in LAUNCHER_SCRIPTS else None


def module_run_with_m(orig_argv: Sequence[str]) -> str | None:
    """MODULE of `python [options] -m MODULE ...` in the interpreter's own command line, or None.
    Read there because `-m` imports the module's parent packages first (torch, for
    torch.distributed.run), and activation runs inside that import, before `__main__` and
    `sys.argv` say what runs."""
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)
            continue
        if arg in ("-", "--") or not arg.startswith("-"):
            return None  # a script, or stdin
        if arg.startswith("--"):
            continue
        flags = arg[1:]  # short options, possibly clustered: -um MODULE, -Wignore, -mMODULE
        for i, flag in enumerate(flags):
            if flag == "c":
                return None
            if flag == "m":
                return flags[i + 1:] or next(args, None)
            if flag in "WX":
                if i == len(flags) - 1:
                    next(args, None)  # its value is the next argument
                break  # or the rest of this one
    return None


def _try_agent(steps: StepTracker) -> JobAgent | None:
    settings = steps.settings
    try:
        agent = _new_agent(steps)
    except JobDirBusy:
        log.warning("the job agent of %s runs in another process (the pid in its stats.json): this "
                    "process (pid %d) runs without one: it writes no stats and takes no controls; its "
                    "device memory is bounded by its start-up settings only (one agent a job: a job of "
                    "several training processes, or one started by a wrapper script that imported the "
                    "framework first, is managed in its first process only)", settings.job_dir, os.getpid())
        return None
    except Exception as err:  # noqa: BLE001 - OSError, ProtocolError, or anything else: never a traceback
        log.warning("cannot start the job agent on %s (%s: %s): the job runs without it: no stats.json, "
                    "no controls", settings.job_dir, type(err).__name__, err)
        return None
    log.info("job agent on %s (change detection: %s)", settings.job_dir, agent.watch_mode)
    return agent


def _new_agent(steps: StepTracker) -> JobAgent:
    settings = steps.settings
    device = settings.device_id
    holder: list[JobAgent] = []
    actuator = NativeActuator(steps.native, device, steps.limits,
                              lambda: holder[0].control_received_at if holder else None)
    agent = JobAgent(settings.job_dir or "", actuator, NativeStatsSource(steps.native, device),
                     min_write_interval_s=settings.stats_interval_ms / 1000.0,
                     control_fallback_s=settings.control_fallback_ms / 1000.0,
                     hold_clock=getattr(steps.native, "holds", None))
    holder.append(agent)
    try:
        agent.start()
    except BaseException:
        with contextlib.suppress(Exception):
            agent.close("failed")  # stops its threads and gives the directory's lock back
        raise
    return agent
