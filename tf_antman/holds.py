"""How long the job was held, whatever held it: told at exit (exit_report.py, "paused").

Two things hold a job: its ops at compute share 0 (the start-up ANTMAN_COMPUTE_SHARE=0,
`tf_antman.set_compute_share(0)`, a coordinator share of 0, a pause the job agent applied away
from a step boundary), and the training thread waiting in a step for a resume (a pause applied at a
step boundary). Each is a *reason*; the job is held while at least one reason is, so overlapping
holds count once. The job's one clock is its runtime's (`Native.holds`, `TorchRuntime.holds`), which
counts SHARE_ZERO in its set_share; the job agent is given it and counts PAUSED_IN_STEP there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SHARE_ZERO = "share 0"
PAUSED_IN_STEP = "paused in a step"


class HoldClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reasons: set[str] = set()
        self._since: float | None = None
        self._total = 0.0

    def set(self, reason: str, held: bool) -> None:
        with self._lock:
            was_held = bool(self._reasons)
            if held:
                self._reasons.add(reason)
            else:
                self._reasons.discard(reason)
            now = self._clock()
            if self._reasons and not was_held:
                self._since = now
            elif was_held and not self._reasons and self._since is not None:
                self._total += now - self._since
                self._since = None

    @property
    def held(self) -> bool:
        with self._lock:
            return bool(self._reasons)

    @property
    def seconds(self) -> float:
        """Seconds held so far (a hold still in force counts up to now)."""
        with self._lock:
            return self._total + (0.0 if self._since is None else self._clock() - self._since)
