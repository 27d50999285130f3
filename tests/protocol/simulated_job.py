"""A pure-Python stand-in for the native library: an actuator and a stats source in one object.

Used by tests and by bench/control_latency.py, where no allocator exists; kept out of the wheel
(no job uses it). It records every setting it receives (with the time it took effect) and reports
the settings in force back as figures, as the native library does, so a test can check both sides
of the protocol against one object.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tf_antman.protocol.schema import MAX_BYTES, DeviceStats


@dataclass(frozen=True)
class Applied:
    """One call the simulated actuator received."""

    at: float  # clock() when the setting took effect
    what: str  # "memory_limit" | "compute_share" | "pause" | "resume"
    device: int | None = None
    value: float | int | None = None


class SimulatedJob:
    """Actuator + StatsSource for `devices` devices, with optional faults for tests."""

    def __init__(
        self,
        devices: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        in_use_bytes: int = 0,
        fail_when: Callable[[str, int | None, float | int | None], str | None] | None = None,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._fail_when = fail_when
        self.limits: dict[int, int | None] = {d: None for d in range(devices)}
        self.in_use: dict[int, int] = {d: in_use_bytes for d in range(devices)}
        self.share = 1.0
        self.achieved: float | None = None
        self.paused = False
        self.host_fallbacks = 0
        self.log: list[Applied] = []

    # Actuator -----------------------------------------------------------------------------------

    def set_memory_limit(self, device: int, limit_bytes: int) -> None:
        self._check("memory_limit", device, limit_bytes)
        if device not in self.limits:
            raise ValueError(f"device {device} is not used by this job (devices: {sorted(self.limits)})")
        with self._lock:
            self.limits[device] = limit_bytes
            self.log.append(Applied(self._clock(), "memory_limit", device, limit_bytes))

    def set_compute_share(self, share: float) -> None:
        self._check("compute_share", None, share)
        with self._lock:
            self.share = share
            self.log.append(Applied(self._clock(), "compute_share", None, share))

    def pause(self) -> None:
        self._check("pause", None, None)
        with self._lock:
            self.paused = True
            self.log.append(Applied(self._clock(), "pause"))

    def resume(self) -> None:
        self._check("resume", None, None)
        with self._lock:
            self.paused = False
            self.log.append(Applied(self._clock(), "resume"))

    # StatsSource --------------------------------------------------------------------------------

    def device_stats(self) -> tuple[DeviceStats, ...]:
        with self._lock:
            out = []
            for device, limit in sorted(self.limits.items()):
                in_use = self.in_use[device]
                # Above the limit the excess lives in host memory (universal memory, paper §3.1.1).
                on_device = in_use if limit is None else min(in_use, limit)
                host = min(in_use - on_device, MAX_BYTES)
                out.append(
                    DeviceStats(
                        device=device,
                        limit_bytes=limit,
                        in_use_bytes=on_device,
                        reserved_bytes=on_device,
                        step_peak_bytes=on_device,
                        step_min_bytes=on_device,
                        host_in_use_bytes=host,
                        host_peak_bytes=host,
                        host_fallbacks=self.host_fallbacks,
                    )
                )
            return tuple(out)

    def compute_share(self) -> float:
        with self._lock:
            return self.share

    def shares(self) -> tuple[float, float | None]:
        with self._lock:
            return self.share, self.achieved

    def _check(self, what: str, device: int | None, value: float | None) -> None:
        if self._fail_when is not None:
            reason = self._fail_when(what, device, value)
            if reason is not None:
                raise RuntimeError(reason)
