"""What tf-antman did to this job, told once in the job's own log when it exits.

A job that ran past its memory limit keeps training, slower, with tensors in host memory; without
this line nothing in its log says so. At interpreter exit (after the non-daemon threads have
ended) the job logs, through absl (docs/configuration.md, "What a job's log says at exit"), to its
stderr; in a plain script (Python's logging prints absl's lines):

    WARNING:absl:tf-antman: at exit: peak device memory 1.9 GiB (limit 2.0 GiB); 312.0 MiB served
    from host memory past the limit (4021 allocations, peak 96.0 MiB at once): those steps ran
    slower; paused 0.0 s; throttled 12.4 s (waiting for a compute share below 100%)

and with absl's handler (absl.app.run): `W0514 10:21:07.123456 139872 exit_report.py:<line>] tf-antman: at exit: ...`.

WARNING when anything slowed the job (host memory, pause, throttling), INFO otherwise.
Figures: the allocator's peak in use and bytes served from host memory since the start
(`MemStats.peak_in_use`, `host_bytes_served`, `host_fallbacks`, `host_peak`), the operator
manager's waiting time (`OpStats.idle_inserted_ns`: ops held back to keep the job within its
share), and the time the job was held (`holds` of the runtime, Native or TorchRuntime, holds.py:
its ops at compute share 0, whoever set it, which the operator manager does not count, or the
training thread paused in a step, which the job agent counts on that same clock).
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any

from tf_antman._log import log
from tf_antman.native import NativeError, UnmanagedError
from tf_antman.units import format_bytes


@dataclass(frozen=True, slots=True)
class ExitFigures:
    peak_device_bytes: int
    limit_bytes: int | None  # None: the whole device
    host_bytes_served: int
    host_fallbacks: int
    host_peak_bytes: int
    paused_s: float
    throttled_s: float

    @property
    def slowed(self) -> bool:
        # As the line shows them (one decimal): a WARNING saying "paused 0.0 s; throttled 0.0 s"
        # with nothing from host memory told the user nothing.
        return self.host_fallbacks > 0 or round(self.paused_s, 1) > 0 or round(self.throttled_s, 1) > 0


def figures(native: Any) -> ExitFigures:
    m = native.mem_stats()
    ops = native.op_stats()
    limit = int(m.limit)
    return ExitFigures(
        peak_device_bytes=int(m.peak_in_use),
        limit_bytes=limit if limit < int(m.device_capacity) else None,
        host_bytes_served=int(m.host_bytes_served),
        host_fallbacks=int(m.host_fallbacks),
        host_peak_bytes=int(m.host_peak),
        paused_s=float(native.holds.seconds),
        throttled_s=max(0, int(ops.idle_inserted_ns)) / 1e9,
    )


def describe(f: ExitFigures) -> str:
    limit = "limit: the whole device" if f.limit_bytes is None else f"limit {format_bytes(f.limit_bytes)}"
    parts = [f"peak device memory {format_bytes(f.peak_device_bytes)} ({limit})"]
    if f.host_fallbacks:
        parts.append(f"{format_bytes(f.host_bytes_served)} served from host memory past the limit "
                     f"({f.host_fallbacks} allocations, peak {format_bytes(f.host_peak_bytes)} at once): "
                     "those steps ran slower")
    else:
        parts.append("nothing served from host memory")
    parts.append(f"paused {f.paused_s:.1f} s")
    parts.append(f"throttled {f.throttled_s:.1f} s (waiting for a compute share below 100%)")
    return "at exit: " + "; ".join(parts)


def report(native: Any) -> None:
    """Log the line; never raises (the job is exiting)."""
    try:
        f = figures(native)
        (log.warning if f.slowed else log.info)("%s", describe(f))
    except UnmanagedError as e:  # cuda, and TF made no GPU device: the job ran unmanaged
        log.warning("at exit: no figures: %s", e)
    except NativeError as e:  # e.g. a process that never created its devices: nothing ran here
        log.info("at exit: no figures: %s", e)
    except Exception:  # noqa: BLE001 - a failing report must not change how the job exits
        log.debug("exit report failed", exc_info=True)


_registered: list[Any] = []  # the natives already reported for (activation may run its hooks twice)


def register(native: Any) -> None:
    """Report at exit, once per process: a plain atexit callback, run after the interpreter has
    joined the non-daemon threads (a script that trains in one is still training before that)."""
    if any(n is native for n in _registered):
        return
    _registered.append(native)
    atexit.register(lambda: report(native))


__all__ = ["ExitFigures", "describe", "figures", "register", "report"]
