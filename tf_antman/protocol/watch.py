"""Notices new control files and hands the newest valid one to the training step thread.

A watchdog (inotify) observer on the job directory wakes a reader thread when control.json is renamed
into place (or written in place); a periodic re-read catches anything inotify missed (network file
systems, events dropped on queue overflow). Events are debounced so a burst of writes is read once.
The step thread only compares an integer (`version`) on its hot path and calls `take()` when it moved.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from tf_antman._log import log
from tf_antman.protocol.errors import ProtocolError
from tf_antman.protocol.files import FileIdentity, read_snapshot
from tf_antman.protocol.layout import CONTROL_FILE, control_path
from tf_antman.protocol.schema import (
    MAX_CONTROL_BYTES,
    Control,
    Rejection,
    parse_control,
    seq_hint,
)

DEFAULT_REREAD_INTERVAL_S: Final = 1.0
DEFAULT_DEBOUNCE_S: Final = 0.001
DEFAULT_MAX_DEBOUNCE_S: Final = 0.05
DEFAULT_FALLBACK_POLL_S: Final = 0.1

WatchMode = Literal["inotify", "polling", "stopped"]


@dataclass(frozen=True)
class ControlUpdate:
    """What arrived since the previous `take()`.

    control: the newest valid control, or None. Older valid controls that it superseded before the step
    thread took them are dropped on purpose (their seq is lower; only the newest matters).
    last_rejection / rejected: the latest refused file and how many were refused in total since then.
    received_at: time.monotonic() when `control` was read (None without a control); the job uses it to
    order a control against a user's own request (the newer wins).
    """

    control: Control | None
    last_rejection: Rejection | None
    rejected: int
    received_at: float | None = field(default=None, compare=False)


class ControlWatcher:
    """Watches `<job_dir>/control.json`. Thread-safe; one instance per job."""

    def __init__(
        self,
        job_dir: Path,
        *,
        reread_interval_s: float = DEFAULT_REREAD_INTERVAL_S,
        debounce_s: float = DEFAULT_DEBOUNCE_S,
        max_debounce_s: float = DEFAULT_MAX_DEBOUNCE_S,
        fallback_poll_s: float = DEFAULT_FALLBACK_POLL_S,
        use_inotify: bool = True,
        observer_factory: Callable[[], Any] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        for name, value in (
            ("reread_interval_s", reread_interval_s),
            ("debounce_s", debounce_s),
            ("max_debounce_s", max_debounce_s),
            ("fallback_poll_s", fallback_poll_s),
        ):
            if not 0.0 <= value <= 86_400.0:
                raise ProtocolError(name, f"must be a number of seconds in [0, 86400], got {value!r}")
        if reread_interval_s == 0.0 or fallback_poll_s == 0.0:
            raise ProtocolError("reread_interval_s", "intervals must be above 0 seconds")
        self._path = control_path(job_dir)
        self._job_dir = job_dir
        self._reread_s = reread_interval_s
        self._debounce_s = debounce_s
        self._max_debounce_s = max_debounce_s
        self._fallback_poll_s = fallback_poll_s
        self._use_inotify = use_inotify
        self._observer_factory = observer_factory
        self._on_change = on_change

        self._lock = threading.Lock()  # guards the hand-off slots below
        self._read_lock = threading.Lock()  # one reader at a time: keeps `_last_identity` consistent
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer: Any = None
        self._events: _ControlEvents | None = None
        self._mode: WatchMode = "stopped"
        self._fell_back = False

        self._last_identity: FileIdentity | None = None
        self._max_seq = 0
        self._pending: Control | None = None
        self._received_at = 0.0
        self._last_rejection: Rejection | None = None
        self._rejected = 0
        self.version = 0  # bumped under _lock whenever take() has something new; read lock-free
        self.reads_by_event = 0
        self.reads_by_poll = 0

    @property
    def mode(self) -> WatchMode:
        return self._mode

    @property
    def poll_interval_s(self) -> float:
        # Polling by choice keeps the configured interval; polling because inotify failed is the only
        # way left to notice changes, so it polls faster.
        return min(self._reread_s, self._fallback_poll_s) if self._fell_back else self._reread_s

    def start(self) -> None:
        """Read control.json once (synchronously), then watch it from a background thread."""
        if self._thread is not None:
            return
        self.check_now()
        self._mode = "polling"
        if self._use_inotify:
            try:
                self._observer = self._start_observer()
                self._mode = "inotify"
            except Exception as err:  # noqa: BLE001 - e.g. OSError(ENOSPC) when inotify watches run out
                self._fell_back = True
                log.warning(
                    "cannot watch %s with inotify (%s); polling every %.3f s instead",
                    self._job_dir,
                    err,
                    min(self._reread_s, self._fallback_poll_s),
                )
        self._thread = threading.Thread(target=self._run, name="tf_antman-control-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._observer is not None:
            inotify_log = logging.getLogger("watchdog.observers.inotify")
            inotify_log.addFilter(_drop_stop_race)
            try:
                self._observer.stop()  # stops and joins its emitter threads before it returns
                self._observer.join(timeout=5.0)
            except Exception as err:  # noqa: BLE001 - closing must not fail the job
                log.warning("stopping the file observer failed: %s", err)
            finally:
                inotify_log.removeFilter(_drop_stop_race)
            self._observer = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._mode = "stopped"

    def take(self) -> ControlUpdate | None:
        """Everything new since the previous take, or None."""
        with self._lock:
            if self._pending is None and self._rejected == 0:
                return None
            update = ControlUpdate(
                self._pending, self._last_rejection, self._rejected,
                self._received_at if self._pending is not None else None,
            )
            self._pending = None
            self._rejected = 0
            return update

    def check_now(self) -> bool:
        """Read control.json now; True when something new was handed off."""
        with self._read_lock:
            snapshot = read_snapshot(self._path, MAX_CONTROL_BYTES)
            if snapshot is None or snapshot.identity == self._last_identity:
                return False  # absent (settings in force stay) or the file already handled
            self._last_identity = snapshot.identity
            if snapshot.error is not None:
                self._publish_rejection(Rejection.clipped(None, snapshot.error.field, snapshot.error.reason))
                return True
            assert snapshot.text is not None
            try:
                control = parse_control(snapshot.text)
            except ProtocolError as err:
                self._publish_rejection(Rejection.clipped(seq_hint(snapshot.text), err.field, err.reason))
                return True
            if control.seq <= self._max_seq:
                self._publish_rejection(
                    Rejection.clipped(control.seq, "seq",
                                      f"must be greater than {self._max_seq}, the last seq received")
                )
                return True
            self._max_seq = control.seq
            with self._lock:
                self._pending = control
                self._received_at = time.monotonic()
                self.version += 1
        self._notify()
        return True

    def _publish_rejection(self, rejection: Rejection) -> None:
        # Logged here, once per distinct file: the periodic re-read of the same file is deduplicated.
        log.warning(
            "control refused (seq %s): %s: %s", rejection.seq, rejection.field, rejection.reason
        )
        if rejection.seq is not None:
            self._max_seq = max(self._max_seq, rejection.seq)
        with self._lock:
            self._last_rejection = rejection
            self._rejected += 1
            self.version += 1
        self._notify()

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _start_observer(self) -> Any:
        if self._observer_factory is not None:
            observer = self._observer_factory()
        else:
            observer = _default_observer()
        self._events = _ControlEvents(self._wakeup)
        observer.schedule(self._events, str(self._job_dir), recursive=False, event_filter=_event_types())
        observer.start()
        return observer

    def _run(self) -> None:
        while not self._stop.is_set():
            fired = self._wakeup.wait(self.poll_interval_s)
            self._wakeup.clear()
            if self._stop.is_set():
                return
            whole_file = self._events.take_whole_file() if self._events is not None else False
            if fired and self._debounce_s > 0 and not whole_file:
                # In-place writes arrive as a series of modify events: wait for them to settle.
                deadline = time.monotonic() + self._max_debounce_s
                while self._wakeup.wait(self._debounce_s) and time.monotonic() < deadline:
                    self._wakeup.clear()
                    if self._stop.is_set():
                        return
            if fired:
                self.reads_by_event += 1
            else:
                self.reads_by_poll += 1
            try:
                self.check_now()
            except Exception:
                log.exception("reading %s failed", self._path)


_STOP_RACE = "InotifyEmitter.queue_events() called when the thread is inactive"


def _drop_stop_race(record: logging.LogRecord) -> bool:
    """watchdog (7.x) logs an ERROR from its emitter thread when stop() takes the inotify handle
    away between the thread's "keep running?" check and its read: its own race, harmless (nothing
    is lost, the thread ends), seen at about 1 exit in 30. A job's log must not show an error for
    it, so the message is dropped while we stop the observer, and only that message."""
    return not record.getMessage().startswith(_STOP_RACE)


def _default_observer() -> Any:
    try:
        from watchdog.observers.inotify import InotifyObserver
    except Exception:  # noqa: BLE001 - not Linux: the platform's observer
        from watchdog.observers import Observer

        return Observer()
    # Full events: a rename from an unwatched directory (.tmp/) is then reported as "moved", not
    # "created", so it can skip the debounce that an in-place write needs.
    return InotifyObserver(generate_full_events=True)


# Events that can change what control.json holds. Opens and read-only closes are left out: the
# watcher's own reads would otherwise wake it again, forever.
_CHANGE_EVENTS: Final = frozenset({"created", "modified", "moved", "deleted", "closed"})


def _event_types() -> list[Any]:
    from watchdog import events

    return [
        events.FileCreatedEvent,
        events.FileModifiedEvent,
        events.FileMovedEvent,
        events.FileDeletedEvent,
        events.FileClosedEvent,
        events.DirCreatedEvent,
        events.DirMovedEvent,
        events.DirDeletedEvent,
    ]


class _ControlEvents:
    """watchdog handler: a change event naming control.json wakes the reader thread."""

    def __init__(self, wakeup: threading.Event) -> None:
        self._wakeup = wakeup
        self._whole_file = False

    def take_whole_file(self) -> bool:
        """True when a rename put a complete file in place since the last call (no debounce needed)."""
        seen, self._whole_file = self._whole_file, False
        return seen

    def dispatch(self, event: Any) -> None:
        if event.event_type not in _CHANGE_EVENTS:
            return
        for path in (event.src_path, getattr(event, "dest_path", "")):
            if path and os.path.basename(os.fsdecode(path)) == CONTROL_FILE:
                if event.event_type == "moved":
                    self._whole_file = True
                self._wakeup.set()
                return
