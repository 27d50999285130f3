"""The last state a job writes to stats.json, from how its process ends (docs/protocol.md).

- `finished`: the interpreter exits normally, or through `sys.exit(0)` / `sys.exit()`;
- `failed`: an exception nobody caught in the main thread (KeyboardInterrupt included), or a
  non-zero `sys.exit(n)` / `exit(n)` / `quit(n)` (absl's `app.run` and argparse exit that way);
- `terminated`: SIGTERM, which scheduler_lite sends to cancel or migrate a job.

When: from a plain `atexit` callback, which the interpreter runs after it has joined every
non-daemon thread: a script that trains in a thread of its own ends when that thread does, not
when its main thread returns. An uncaught exception is read there from `sys.last_value`, which
the interpreter sets before it prints the traceback (whatever `sys.excepthook` the script
installed); a non-zero exit status from the `sys.exit` / `exit` / `quit` wrappers of
`exit_status.py`, installed at interpreter start by the .pth hook (so that `from sys import exit`
gets them too).

What cannot be seen from Python: `raise SystemExit(n)` written directly (the interpreter turns
it into the exit status in C, after the last Python code ran: it ends "finished"), an exit
function bound before tf-antman started without the .pth hook (`from sys import exit` before
`tf_antman.enable()`), and `os._exit()` or SIGKILL (no final document at all). The exit status
stays the authority; scheduler_lite records it.

Signals, on every active job (with or without a job agent):

- SIGTERM: only when its disposition is the default (SIG_DFL) at start-up; a script with its own
  handler (or SIG_IGN) keeps it, and a handler the script installs later replaces this one. The
  handler writes the final stats (when there is an agent) and the exit report, then restores
  SIG_DFL and raises SIGTERM again, so the process still dies of it (exit status -15, or 143 from
  a shell).
- SIGINT (Ctrl-C): Python's handler raises KeyboardInterrupt in the main thread, but only once
  that thread runs Python again; one whose op is held at compute share 0 never would. When SIGINT
  arrives while the share is 0, the hold is released (`release_hold`, share 1.0) so that the op
  returns and KeyboardInterrupt is raised as in stock TensorFlow.

The work is done on a thread of its own, woken through Python's signal wakeup fd as the signal
arrives (the main thread may be interrupted while it holds a lock the work needs, or be stuck in
an op, where a Python handler would not run until the op returns). If the process already has a
wakeup fd (asyncio), only the SIGTERM handler is installed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from tf_antman import exit_status
from tf_antman._log import log

# How long the process may take to die of the re-raised SIGTERM before it exits by itself.
_DIE_TIMEOUT_S = 5.0


class FinalState:
    """Watches how the process ends and closes `agent` with the matching state.

    `agent` is a JobAgent (its `close(state)`), or None for a job without one (no job directory,
    or another process's agent serves it): then only the signals are watched. `report()` logs the
    exit report, called on SIGTERM only (at a normal exit exit_report.py's own hook logs it).
    `release_hold()` lets ops held at compute share 0 run again (SIGINT, above).
    """

    def __init__(self, agent: Any | None, report: Callable[[], None],
                 release_hold: Callable[[], None] | None = None) -> None:
        self._agent = agent
        self._report = report
        self._release_hold = release_hold
        self._ending = threading.Lock()
        self._ended = False
        self._handler: Callable[[int, Any], None] | None = None
        self._wakeup_fds: tuple[int, int] | None = None  # (read, write) of signal.set_wakeup_fd

    def install(self) -> None:
        exit_status.watch_exit_calls()  # done at interpreter start already by the .pth hook
        self._watch_signals()
        # A plain atexit callback: the interpreter runs them after threading._shutdown() has
        # joined the non-daemon threads (threading._register_atexit's run before that join, while
        # a script's training thread may still be training).
        atexit.register(self._close_at_exit)
        os.register_at_fork(after_in_child=self._forked)

    def _close_at_exit(self) -> None:
        self._end("failed" if exit_status.failed() else "finished", report=False)

    # --- signals --------------------------------------------------------------------------------

    def _watch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # signal.signal() works on the main thread only (TensorFlow imported from another).
            log.debug("started off the main thread: SIGTERM and SIGINT are not watched")
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._handler = self._on_sigterm
            signal.signal(signal.SIGTERM, self._handler)
        # else: the script's own handler, or SIG_IGN: theirs to keep
        self._start_wakeup_reader()

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        # Python runs this on the main thread between two bytecodes, maybe inside a lock the work
        # below needs: hand it to a thread and return at once.
        threading.Thread(target=self._terminate, name="tf_antman-sigterm", daemon=True).start()

    def _start_wakeup_reader(self) -> None:
        read_fd, write_fd = os.pipe()  # both close-on-exec (PEP 446)
        os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:  # someone else's wakeup fd (asyncio...): keep it, rely on the handler
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup_fds = (read_fd, write_fd)
        threading.Thread(target=self._read_wakeups, args=(read_fd,), name="tf_antman-signal-wakeup",
                         daemon=True).start()

    def _read_wakeups(self, read_fd: int) -> None:
        # Each signal that has a Python handler writes its number here, from the C-level handler,
        # even while the main thread is stuck in a TensorFlow op.
        while True:
            try:
                data = os.read(read_fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                self._interrupted()
            if (signal.SIGTERM in data and self._handler is not None
                    and signal.getsignal(signal.SIGTERM) is self._handler):
                self._terminate()

    def _interrupted(self) -> None:
        """SIGINT with a Python handler: let an op held at share 0 return, so that the handler
        runs (KeyboardInterrupt by default) in the main thread."""
        if self._release_hold is None or self._ended:
            return
        try:
            self._release_hold()
        except Exception:  # noqa: BLE001 - the interrupt must not fail in this thread
            log.debug("releasing ops held at share 0 on SIGINT failed", exc_info=True)

    def _forked(self) -> None:
        """In a forked child (multiprocessing's default start method on Linux): it shares the
        job's agent lock but is not the agent's process, so it writes no final state; and its
        SIGTERM (multiprocessing's terminate()) must end it as by default, not reach the parent's
        wakeup reader through the pipe they share."""
        self._ending = threading.Lock()  # another thread may have held it at the fork
        self._ended = True
        with contextlib.suppress(ValueError, OSError):
            if self._handler is not None and signal.getsignal(signal.SIGTERM) is self._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self._wakeup_fds is not None:
                previous = signal.set_wakeup_fd(-1)
                if previous not in (-1, self._wakeup_fds[1]):
                    signal.set_wakeup_fd(previous)  # someone else's since: theirs to keep
                for fd in self._wakeup_fds:
                    os.close(fd)
        self._wakeup_fds = None

    def _terminate(self) -> None:
        try:
            self._end("terminated", report=True)
        finally:
            _die_of(signal.SIGTERM)

    # --- the one final write --------------------------------------------------------------------

    def _end(self, state: str, report: bool) -> None:
        """Closes the agent with `state`, once per process: the first way to end wins, and a
        second one waits here until the first has written (SIGTERM then kills the process)."""
        with self._ending:
            if self._ended:
                return
            self._ended = True
            try:
                if self._agent is not None:
                    self._agent.close(state)
                if report:
                    self._report()
            except Exception:  # noqa: BLE001 - the job is ending: never change how
                log.warning("writing the final stats (%s) failed", state, exc_info=True)


def _die_of(signum: int) -> None:
    """Ends the process by `signum` with its default action, from any thread.

    signal.signal() works on the main thread only, which may be stuck in an op: the default is
    restored through libc. If the process is somehow still alive after a while, it exits with the
    status a shell reports for that signal.
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signum, None)  # None: a NULL pointer, SIG_DFL
        os.kill(os.getpid(), signum)
    time.sleep(_DIE_TIMEOUT_S)
    os._exit(128 + signum)
