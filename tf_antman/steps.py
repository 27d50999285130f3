"""Mini-batch boundaries: where limit changes take effect and statistics are taken.

Only *training* steps count (a Keras train batch, a Session.run that runs an optimizer update,
or a step the user marks); evaluation, prediction, initialisation and checkpoint runs do not.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tf_antman._log import log

if TYPE_CHECKING:
    from tf_antman.config import Settings
    from tf_antman.native import Native

WINDOW = 64  # recent training step times kept for the public API


class StepTracker:
    def __init__(self, native: Native, settings: Settings) -> None:
        self.native = native
        self.settings = settings
        self.steps = 0
        self.window: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.agent: Any = None
        self._last_end: float | None = None
        self._lock = threading.Lock()  # step_end may come from a Session.run in any thread

    def start_agent(self) -> None:
        if not self.settings.job_dir or self.agent is not None:
            return
        from tf_antman.jobside import start_agent

        self.agent = start_agent(self)

    def step_end(self, seconds: float | None = None, training: bool = True) -> None:
        """Marks the end of a mini-batch. `seconds`: its duration; None = time since the last
        step end (the first one is then not timed)."""
        now = time.perf_counter()
        with self._lock:
            if seconds is None and self._last_end is not None:
                seconds = now - self._last_end
            self._last_end = now
            if not training:
                return
            self.steps += 1
            if seconds is not None:
                self.window.append(seconds)
            if self.agent is not None:
                try:
                    self.agent.step_end(seconds if seconds is not None else 0.0, training=True)
                except Exception:  # noqa: BLE001 - the coordinator link must never stop training
                    log.exception("job agent failed at a step boundary; training goes on")
            self.native.step_boundary()

    @contextlib.contextmanager
    def step(self, training: bool = True) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.step_end(time.perf_counter() - t0, training=training)
