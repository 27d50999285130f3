"""Mini-batch boundaries: where limit changes take effect and statistics are taken.

Only *training* steps count (a Keras train batch, a Session.run that runs an optimizer update,
or a step the user marks); evaluation, prediction, initialisation and checkpoint runs do not.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tf_antman._log import log

if TYPE_CHECKING:
    from tf_antman.config import Settings
    from tf_antman.native import Native

WINDOW = 64  # recent training step times kept for the public API

# --- Marked work: no double counting -------------------------------------------------------------
# A step marked by the user (`tf_antman.step()`) or by a wrapped Keras `fit`/`train_on_batch` counts
# once: the hooks inside it (train_on_batch, Session.run, a Session callable) do not count again on
# the thread that marked it (docs/steps.md).

_local = threading.local()


def inside_marked_step() -> bool:
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def marked_step() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


class MemoryLimits:
    """The device-memory limit has two writers; the one *received* last wins.

    - the user: `tf_antman.set_memory_limit()`, a request held here and put into force at the
      next step boundary, before the job agent writes that boundary's stats.json (so the stats
      report the limit in force from this boundary on, not the one before it);
    - the coordinator: a control.json limit, applied by the job agent at a step boundary or by
      its fallback (`coordinator()`), stamped with the time the job read the control.

    A coordinator limit received after a pending user request replaces that request (so the
    boundary does not put the older request on top of it); a user request made after the
    coordinator's control was received wins over that control, also when the control is applied
    at the same boundary, after the request (the request's time is kept until the boundary ends).
    """

    def __init__(self, native: Native, clock: Callable[[], float] = time.monotonic) -> None:
        self._native = native
        self._clock = clock
        self._lock = threading.Lock()
        self._requested: int | None = None  # a user request not in force yet
        self._user_requested_at: float | None = None  # the newest user request's time, until its boundary ends

    def request(self, limit: int) -> None:
        with self._lock:
            # The allocator holds it as its pending limit too (memory_stats()["pending_limit"]);
            # its step_boundary applies it again at the boundary's end: the same value, a no-op.
            self._native.request_limit(limit)
            self._requested = limit
            self._user_requested_at = self._clock()

    def coordinator(self, limit: int, received_at: float | None) -> None:
        with self._lock:
            user_at = self._user_requested_at
            if user_at is not None and received_at is not None and user_at > received_at:
                return  # a newer user request wins (pending, or put into force at this boundary)
            self._native.set_limit_now(limit)
            if user_at is not None:  # the allocator's pending limit is the older request: the
                self._native.request_limit(limit)  # boundary's end re-applies this, not that
            self._requested = self._user_requested_at = None  # the older request is replaced

    def boundary_begins(self) -> None:
        """A step ended: the pending user request goes into force now, before the agent runs."""
        if self._requested is None:  # the common case, read without the lock (on every step)
            return
        with self._lock:
            if self._requested is not None:
                self._native.set_limit_now(self._requested)
                self._requested = None

    def boundary_ends(self) -> None:
        with self._lock:
            self._native.step_boundary()  # resets per-step figures (after the agent has read them)
            if self._requested is None:  # a request made during this boundary waits for the next
                self._user_requested_at = None


class StepTracker:
    def __init__(self, native: Native, settings: Settings) -> None:
        self.native = native
        self.settings = settings
        self.limits = MemoryLimits(native)
        self.steps = 0
        self.window: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.agent: Any = None
        self._agent_tried = False
        self._last_end: float | None = None
        self._lock = threading.Lock()  # step_end may come from a Session.run in any thread

    def start_agent(self, start: Callable[[StepTracker], Any]) -> None:
        """Once per process: the agent on ANTMAN_JOB_DIR, and the watch of the process's end
        (`start` is jobside.start_agent, handed in by the activation: jobside imports this
        module); the agent stays None without a job directory or when it cannot start (jobside
        logs why)."""
        if self._agent_tried:
            return
        self._agent_tried = True
        self.agent = start(self)

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
            self.limits.boundary_begins()
            if seconds is not None:
                self.window.append(seconds)
            if self.agent is not None:
                try:
                    # None: the first step, not timed; counted, kept out of the window.
                    self.agent.step_end(seconds, training=True)
                except Exception:  # noqa: BLE001 - the coordinator link must never stop training
                    log.exception("job agent failed at a step boundary; training goes on")
                # The next untimed step starts now, not before the agent: a pause holds the
                # thread in step_end, and that time is not the next step's (a 2 s pause read as a
                # 2 s step to the coordinator, for the PyTorch hook and a bare step_end()).
                self._last_end = time.perf_counter()
            self.limits.boundary_ends()

    @contextlib.contextmanager
    def step(self, training: bool = True) -> Iterator[None]:
        if inside_marked_step():  # nested in a marked step: the outer one counts this work
            yield
            return
        t0 = time.perf_counter()
        with marked_step():
            yield
        self.step_end(time.perf_counter() - t0, training=training)
