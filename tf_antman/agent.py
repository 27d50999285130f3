"""The job's end of the coordinator protocol (paper §3.2, §4.1): apply controls at step boundaries, report stats.

The training loop calls `step_end()` after every step. There the newest control the coordinator wrote
is applied through an `Actuator` (dynamic memory and compute scaling are triggered at mini-batch
boundaries, paper §4.1), and a new stats document is handed to a writer thread (rate-limited, but at
once after a control so that the coordinator sees its acknowledgement). A control that meets no step
boundary within `control_fallback_s` (a job that never marks steps, or one stuck in a long step) is
applied anyway from the agent's own thread, with a pause put into force as compute share 0, and
reported as applied by the fallback.
Nothing the coordinator writes can raise into the training loop: a refused control is logged once
and reported in stats.json. Details: docs/protocol.md.

No TensorFlow here: the coordinator side imports tf_antman.protocol, and tests run without it.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from tf_antman._log import log
from tf_antman.holds import PAUSED_IN_STEP, HoldClock
from tf_antman.protocol.files import LatestTextWriter
from tf_antman.protocol.layout import (
    checked_job_dir,
    job_dir_from_env,
    stats_path,
    temp_dir,
)
from tf_antman.protocol.lock import AgentLock
from tf_antman.protocol.schema import (
    FINAL_STATES,
    MAX_BYTES,
    MAX_STEP_MS,
    STEP_WINDOW,
    Control,
    DeviceStats,
    Rejection,
    Stats,
)
from tf_antman.protocol.watch import (
    DEFAULT_DEBOUNCE_S,
    DEFAULT_FALLBACK_POLL_S,
    DEFAULT_REREAD_INTERVAL_S,
    ControlWatcher,
)

DEFAULT_MIN_WRITE_INTERVAL_S: Final = 0.05
DEFAULT_PAUSED_HEARTBEAT_S: Final = 0.5
DEFAULT_CONTROL_FALLBACK_S: Final = 1.0  # ANTMAN_CONTROL_FALLBACK_MS (tf_antman/config.py)
SETTABLE_STATES: Final = ("starting", "running", "finished", "failed")  # "paused" belongs to controls


class ShareNotEnforced(RuntimeError):
    """Raised by an actuator's set_compute_share when the job cannot hold a share below 1 (a
    PyTorch job whose op hook could not be built). A control's share is then not in force, and
    stats.json says so (its compute_share stays 1), but the rest of the control is applied: its
    memory limit protects the guarantee job beside it, and refusing the whole control for the
    share withheld the memory too."""


class Actuator(Protocol):
    """Puts settings into force (the native library in a real job). Any exception means "refused"
    (but ShareNotEnforced from set_compute_share, above).

    Called at a step boundary, at start(), or from the agent's fallback thread while the training
    thread is anywhere: every call must be safe from any thread. A share of 0 holds the job's ops at
    their admission (how the fallback pauses a job that reaches no step boundary)."""

    def set_memory_limit(self, device: int, limit_bytes: int) -> None: ...

    def set_compute_share(self, share: float) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class StatsSource(Protocol):
    """Figures reported in stats.json (the native library in a real job).

    device_stats() lists every device of the job; step_peak_bytes / step_min_bytes cover the last
    completed training step (resetting them per step is the source's business).
    """

    def device_stats(self) -> Sequence[DeviceStats]: ...

    def compute_share(self) -> float: ...

    def shares(self) -> tuple[float, float | None]:
        """(share in force, achieved share or None when not measured), from one reading."""
        ...


class JobAgent:
    """One per job directory (it holds the directory's agent lock, lock.py). `step_end` is called from
    the training thread only."""

    def __init__(
        self,
        job_dir: Path | str,
        actuator: Actuator,
        stats_source: StatsSource,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        min_write_interval_s: float = DEFAULT_MIN_WRITE_INTERVAL_S,
        paused_heartbeat_s: float = DEFAULT_PAUSED_HEARTBEAT_S,
        reread_interval_s: float = DEFAULT_REREAD_INTERVAL_S,
        debounce_s: float = DEFAULT_DEBOUNCE_S,
        use_inotify: bool = True,
        fallback_poll_s: float = DEFAULT_FALLBACK_POLL_S,
        observer_factory: Callable[[], Any] | None = None,
        pid: int | None = None,
        fsync_stats: bool = False,
        control_fallback_s: float | None = DEFAULT_CONTROL_FALLBACK_S,
        hold_clock: HoldClock | None = None,
    ) -> None:
        if control_fallback_s is not None and not (math.isfinite(control_fallback_s) and control_fallback_s > 0):
            raise ValueError(f"control_fallback_s must be a number of seconds > 0 or None, got {control_fallback_s!r}")
        self._job_dir = checked_job_dir(Path(job_dir))
        self._actuator = actuator
        self._source = stats_source
        self._clock = clock
        self._wall_clock = wall_clock
        self._min_write_s = min_write_interval_s
        self._heartbeat_s = paused_heartbeat_s
        self._pid = os.getpid() if pid is None else pid
        # Off by default: readers are protected by the rename alone, and fsync costs milliseconds on
        # the training thread; a crash that loses the page cache ends the job (and its stats) anyway.
        self._writer = LatestTextWriter(
            stats_path(self._job_dir),
            fsync=fsync_stats,
            tmp_dir=temp_dir(self._job_dir),
            on_error=self._write_failed,
        )
        self._wake = threading.Event()
        self._watcher = ControlWatcher(
            self._job_dir,
            reread_interval_s=reread_interval_s,
            debounce_s=debounce_s,
            use_inotify=use_inotify,
            fallback_poll_s=fallback_poll_s,
            observer_factory=observer_factory,
            on_change=self._control_arrived,
        )
        self._lock = threading.RLock()  # settings, counters and stats writes (step thread vs set_state/close)
        self._seen_version = 0
        self._started = False
        self._closed = False
        self._state = "starting"
        self._state_after_pause = "running"
        self._paused = False
        self._waiting_in_step = False  # the training thread waits in step_end for a resume
        # The job's one clock of every hold (holds.py, told at exit): the runtime's, or, for a
        # runtime without one (a stand-in), the agent's own, which counts its pauses in a step only.
        self._hold_clock = HoldClock() if hold_clock is None else hold_clock
        self._limits: dict[int, int] = {}
        # The share in force when the job is not held (what a resume restores): the coordinator's
        # or the user's, whichever came last (`user_share`).
        self._share: float | None = None
        self._user_share_at: float | None = None  # time.monotonic(), as a control's received_at
        self._step = 0
        self._window: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last_step_ms: float | None = None
        self._control_seq_applied = 0
        self._applied = 0
        self._rejected = 0
        self._last_rejection: Rejection | None = None
        self._stats_seq = 0
        self._last_write: float | None = None
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()
        # Fallback: controls that wait for a step boundary since `_pending_since` (agent clock).
        self._fallback_s = control_fallback_s
        self._fallback_cv = threading.Condition()
        self._pending_since: float | None = None
        self._fallback_thread: threading.Thread | None = None
        self._held_by_share = False  # paused by the fallback: ops held by compute share 0
        self._applied_fallback = 0
        self._last_applied_by: str | None = None
        self._applying_received_at: float | None = None
        # Last, once nothing else can fail: a directory another process's agent serves raises
        # JobDirBusy, and this agent stops the one thread it started (lock.py).
        try:
            self._dir_lock = AgentLock.acquire(self._job_dir)
        except BaseException:
            self._writer.close()
            raise

    @classmethod
    def from_env(cls, actuator: Actuator, stats_source: StatsSource, **kwargs: Any) -> JobAgent:
        """An agent on the directory named by ANTMAN_JOB_DIR (ProtocolError when unset or missing)."""
        return cls(job_dir_from_env(), actuator, stats_source, **kwargs)

    @property
    def watch_mode(self) -> str:
        return self._watcher.mode

    @property
    def stats_seq(self) -> int:
        return self._stats_seq

    @property
    def control_received_at(self) -> float | None:
        """time.monotonic() when the control being (or last) applied was read from control.json."""
        return self._applying_received_at

    def start(self) -> None:
        """Apply a control already present (e.g. the memory limit of an opportunistic job) and report."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self._watcher.start()
        with self._lock:
            self._guarded("apply", lambda: self._apply_pending("start"))
            self._write_stats()
        if self._fallback_s is not None:
            self._fallback_thread = threading.Thread(
                target=self._fallback_loop, name="tf_antman-control-fallback", daemon=True)
            self._fallback_thread.start()

    def step_end(self, step_seconds: float | None, training: bool = True) -> None:
        """Called after every step; only training steps count and enter the step-time window.
        `step_seconds` None: a step that was not timed (counted, kept out of the window)."""
        if self._closed:
            return
        try:
            with self._lock:
                if training:
                    self._record_step(step_seconds)
                acted = False
                if self._watcher.version != self._seen_version:  # the whole hot path when nothing changed
                    acted = self._apply_pending("step")
                if not self._paused:
                    now = self._clock()
                    if acted or self._last_write is None or now - self._last_write >= self._min_write_s:
                        self._write_stats()
                    return
            self._wait_while_paused()
        except Exception:  # noqa: BLE001 - the training loop must never see the agent's failures
            self._warn_once("step_end", "step_end failed; training continues", exc_info=True)

    def set_state(self, state: str) -> None:
        if state not in SETTABLE_STATES:
            raise ValueError(f"state must be one of {'|'.join(SETTABLE_STATES)}, got {state!r}")
        with self._lock:
            if self._paused:
                self._state_after_pause = state
            else:
                self._state = state
            self._write_stats()

    def close(self, state: str = "finished") -> None:
        """Stop watching, write the final stats and release a step_end blocked by a pause."""
        if state not in FINAL_STATES:
            raise ValueError(f"state must be one of {'|'.join(FINAL_STATES)}, got {state!r}")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._state = state
            self._sync_hold_clock()  # a training thread still blocked in step_end is held no more
        self._wake.set()
        with self._fallback_cv:
            self._fallback_cv.notify_all()
        self._watcher.close()
        if self._fallback_thread is not None and self._fallback_thread is not threading.current_thread():
            self._fallback_thread.join(timeout=5.0)
        with self._lock:
            if self._held_by_share:  # the training loop continues unmanaged, not held at share 0
                self._held_by_share = False
                self._guarded("resume", lambda: self._actuator.set_compute_share(self._share_in_force()))
            self._write_stats()
        self._writer.close()
        self._dir_lock.release()  # the final stats are written: another agent may take the directory

    def user_share(self, share: float) -> None:
        """The user's compute share (`tf_antman.set_compute_share`), in force from now on: newer
        than a control read before it, whose share then does not replace it when that control is
        applied later; while a pause holds the job's ops (share 0) it is what the resume restores,
        instead of lifting the pause."""
        with self._lock:
            if not self._held_by_share or self._closed:
                self._actuator.set_compute_share(share)  # may refuse (raises): nothing recorded then
            self._user_share_at = time.monotonic()
            self._share = share
            self._share_changed()
            if not self._closed:
                self._write_stats()

    def flush_stats(self, timeout: float | None = 5.0) -> bool:
        """Wait until the stats submitted so far are in stats.json (they are written off-thread)."""
        return self._writer.flush(timeout)

    @property
    def hold_clock(self) -> HoldClock:
        """The clock the agent's pauses in a step are counted on (the one it was given, or its own)."""
        return self._hold_clock

    # ---------------------------------------------------------------------------------------------

    def _record_step(self, step_seconds: float | None) -> None:
        ms = None if step_seconds is None else step_seconds * 1000.0
        if ms is not None and not (math.isfinite(ms) and 0.0 <= ms <= MAX_STEP_MS):
            self._warn_once("step_seconds", "step time %r s is not recorded", step_seconds)
            ms = min(max(ms, 0.0), MAX_STEP_MS) if math.isfinite(ms) else None
        self._step += 1
        if ms is not None:
            self._window.append(ms)
            self._last_step_ms = ms
        if self._state == "starting":
            self._state = "running"
        elif self._paused and self._state_after_pause == "starting":
            self._state_after_pause = "running"  # paused from the start: resumes as running

    def _wait_while_paused(self) -> None:
        # Blocks the training thread between steps; controls keep being applied (a paused job may be
        # asked to shrink its memory) and stats stay fresh so the coordinator sees the job is alive.
        with self._lock:
            self._waiting_in_step = True
            self._sync_hold_clock()
            self._write_stats()
        while True:
            with self._lock:
                if not self._paused or self._closed:
                    self._waiting_in_step = False
                    self._sync_hold_clock()
                    return
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()
            with self._lock:
                if self._watcher.version != self._seen_version:
                    self._apply_pending("step")  # the training thread waits at a step boundary
                self._write_stats()

    def _control_arrived(self) -> None:
        # Watcher thread: a new control (or rejection) is waiting; the fallback's clock starts now.
        self._wake.set()
        with self._fallback_cv:
            if self._pending_since is None:
                self._pending_since = self._clock()
            self._fallback_cv.notify_all()

    def _fallback_loop(self) -> None:
        """Applies a control that waited `control_fallback_s` for a step boundary, from this thread.

        While the job's ops are held at share 0 (a pause applied by the fallback, or a share of 0
        from a control, the user or ANTMAN_COMPUTE_SHARE) no step boundary can come, so new controls
        are applied at once and stats are rewritten every `paused_heartbeat_s` (without it a job at
        share 0 looked hung: stats.json aged, and its next control waited the fallback time).
        """
        assert self._fallback_s is not None
        while True:
            with self._fallback_cv:
                if self._closed:
                    return
                since = self._pending_since
                if self._held_at_share_zero():
                    if since is None:
                        self._fallback_cv.wait(self._heartbeat_s)
                elif since is None:
                    self._fallback_cv.wait()
                    continue
                else:
                    remaining = since + self._fallback_s - self._clock()
                    if remaining > 0:
                        self._fallback_cv.wait(remaining)
                        continue
            try:
                with self._lock:
                    if self._closed:
                        return
                    if self._watcher.version != self._seen_version:
                        self._apply_pending("fallback")
                    else:
                        with self._fallback_cv:
                            self._pending_since = None  # a step boundary took it in the meantime
                    self._write_stats()
            except Exception:  # noqa: BLE001 - the fallback must never take the job down
                self._warn_once("fallback", "applying a control from the fallback failed", exc_info=True)

    def _held_at_share_zero(self) -> bool:
        return self._held_by_share or self._share_in_force() == 0.0

    def _share_changed(self) -> None:
        """The fallback thread re-reads whether the job is held at share 0 (it may wait untimed)."""
        with self._fallback_cv:
            self._fallback_cv.notify_all()

    def _apply_pending(self, by: str) -> bool:
        with self._fallback_cv:
            self._pending_since = None
        self._seen_version = self._watcher.version  # read before take(): a later bump is seen next step
        update = self._watcher.take()
        if update is None:
            return False
        if update.rejected:
            self._rejected += update.rejected
            self._last_rejection = update.last_rejection
        if update.control is not None:
            self._applying_received_at = update.received_at
            self._apply(update.control, by)
        return True

    def _apply(self, control: Control, by: str = "step") -> None:
        """Apply every field of `control` or none: on failure the settings before it are restored.

        by: "start" | "step" | "fallback". Only "step" has the training thread at a step boundary,
        where a pause can hold it in step_end; elsewhere a pause holds its ops with compute share 0,
        which only the fallback thread can lift (no step boundary comes at share 0): without one
        (control_fallback_s=None) a pause at start holds the thread at its first step boundary.
        """
        hold_ops = by != "step" and self._fallback_s is not None
        undo: list[Callable[[], None]] = []
        where = "seq"
        try:
            known = self._known_devices()
            for i, entry in enumerate(control.memory_limits):
                where = f"memory_limits[{i}]"
                if known is not None and entry.device not in known:
                    raise LookupError(f"device {entry.device} is not used by this job (devices: {sorted(known)})")
                previous = self._limit_in_force(entry.device)
                self._actuator.set_memory_limit(entry.device, entry.limit_bytes)
                undo.append(lambda d=entry.device, b=previous: self._actuator.set_memory_limit(d, b))
            pausing = control.paused is True and not self._paused
            resuming = control.paused is False and self._paused
            hold = self._held_by_share and not resuming
            share_before = self._share_in_force()
            # A share the user set after this control was read stays (the newest wins, as for limits).
            user_newer = (self._user_share_at is not None and self._applying_received_at is not None
                          and self._user_share_at > self._applying_received_at)
            share = None if user_newer else control.compute_share
            if share is not None:
                where = "compute_share"
                if not hold:  # held at share 0: the new share takes effect on resume
                    try:
                        self._actuator.set_compute_share(share)
                        undo.append(lambda s=share_before: self._actuator.set_compute_share(s))
                    except ShareNotEnforced as err:
                        self._warn_once("share_not_enforced", "compute share %g from control seq %d is not "
                                        "enforced, the rest of the control is: %s", share, control.seq, err)
                        share = None
            if pausing or resuming:
                where = "paused"
                if pausing:
                    self._actuator.pause()
                    if hold_ops:
                        self._actuator.set_compute_share(0.0)
                        undo.append(lambda s=share_before: self._actuator.set_compute_share(s))
                else:
                    self._actuator.resume()
                    if self._held_by_share:
                        self._actuator.set_compute_share(share if share is not None else self._share_in_force())
        except Exception as err:  # noqa: BLE001 - any actuator failure means "refused", never a crash
            self._undo(undo, control.seq)
            rejection = Rejection.clipped(control.seq, where, f"could not be applied: {type(err).__name__}: {err}")
            self._rejected += 1
            self._last_rejection = rejection
            log.warning("control refused (seq %s): %s: %s", control.seq, rejection.field, rejection.reason)
            return
        for entry in control.memory_limits:
            self._limits[entry.device] = entry.limit_bytes
        if share is not None:
            self._share = share
            self._share_changed()
        elif pausing and self._share is None:
            self._share = share_before  # read before a pause set the actuator's share to 0
        if pausing:
            self._held_by_share = hold_ops
        elif resuming:
            self._held_by_share = False
        if control.paused is not None and control.paused != self._paused:
            self._set_paused(control.paused)
        self._control_seq_applied = control.seq
        self._applied += 1
        self._last_applied_by = by
        if by == "fallback":
            self._applied_fallback += 1
            log.info("control seq %d applied by the fallback: no step boundary within %.3f s",
                     control.seq, self._fallback_s)

    def _sync_hold_clock(self) -> None:
        """Tells the hold clock whether the training thread waits in step_end for a resume (call
        under self._lock when that or `_closed` changes): once closed, the agent holds it no more.

        The agent's other holds are at compute share 0 (a pause applied away from a step boundary,
        a coordinator share of 0), put in force by `actuator.set_compute_share(0.0)`: the runtime
        counts those on the same clock (Native.set_share, TorchRuntime.set_share).
        """
        self._hold_clock.set(PAUSED_IN_STEP, self._waiting_in_step and not self._closed)

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        if paused:
            self._state_after_pause = self._state
            self._state = "paused"
        else:
            self._state = self._state_after_pause
        self._wake.set()

    def _undo(self, undo: list[Callable[[], None]], seq: int) -> None:
        for action in reversed(undo):
            try:
                action()
            except Exception:
                log.exception("restoring the settings before control %s failed", seq)

    def _known_devices(self) -> set[int] | None:
        try:
            return {entry.device for entry in self._source.device_stats()}
        except Exception:  # noqa: BLE001 - without figures the actuator alone decides
            return None

    def _limit_in_force(self, device: int) -> int:
        if device in self._limits:
            return self._limits[device]
        with contextlib.suppress(Exception):
            for entry in self._source.device_stats():
                if entry.device == device and entry.limit_bytes is not None:
                    return entry.limit_bytes
        return MAX_BYTES  # "no limit": the actuator interface has no call to remove one

    def _share_in_force(self) -> float:
        if self._share is not None:
            return self._share
        try:
            return self._source.compute_share()
        except Exception:  # noqa: BLE001
            return 1.0

    def _write_stats(self) -> None:
        try:
            devices, share, achieved = self._figures()
            if self._held_by_share:
                share = self._share_in_force()  # the coordinator's share; the pause is in `state`
            window = tuple(self._window)
            stats = Stats(
                seq=self._stats_seq + 1,
                pid=self._pid,
                state=self._state,
                step=self._step,
                last_step_ms=self._last_step_ms,
                step_ms_window=window,
                step_ms_mean=statistics.fmean(window) if window else None,
                step_ms_median=statistics.median(window) if window else None,
                devices=devices,
                compute_share=share,
                achieved_share=achieved,
                control_seq_applied=self._control_seq_applied,
                controls_applied=self._applied,
                controls_rejected=self._rejected,
                last_rejected=self._last_rejection,
                wall_time=self._wall_clock(),
                controls_applied_fallback=self._applied_fallback,
                last_applied_by=self._last_applied_by,
            )
            text = stats.to_json()
        except Exception:  # noqa: BLE001 - e.g. a figure from the stats source out of its range
            self._warn_once("stats", "cannot build the stats document", exc_info=True)
            return
        self._writer.submit(text)
        self._stats_seq += 1
        self._last_write = self._clock()

    def _write_failed(self, err: BaseException) -> None:
        # Called on the writer thread, e.g. when the job directory vanished or the disk is full.
        self._warn_once("write", "cannot write %s: %s", stats_path(self._job_dir), err)

    def _figures(self) -> tuple[tuple[DeviceStats, ...], float, float | None]:
        try:
            share, achieved = self._source.shares()
            return tuple(self._source.device_stats()), share, achieved
        except Exception:  # noqa: BLE001
            self._warn_once("figures", "the stats source failed; reporting no figures", exc_info=True)
            return (), (1.0 if self._share is None else self._share), None

    def _guarded(self, what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except Exception:  # noqa: BLE001
            self._warn_once(what, "%s failed", what, exc_info=True)

    def _warn_once(self, key: str, message: str, *args: object, exc_info: bool = False) -> None:
        with self._warned_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message, *args, exc_info=exc_info)

