"""The last state a job writes to stats.json, from how its process ends (docs/protocol.md).

- `finished`: the interpreter exits normally, or through `sys.exit(0)` / `sys.exit()`;
- `failed`: an exception nobody caught (`sys.excepthook`, KeyboardInterrupt included), or a
  non-zero `sys.exit(n)` / `exit(n)` / `quit(n)` (absl's `app.run` and argparse exit that way);
- `terminated`: SIGTERM, which scheduler_lite sends to cancel or migrate a job.

What cannot be seen from Python: `raise SystemExit(n)` written directly (the interpreter turns it
into the exit status in C, after the last Python code ran: it ends "finished"), and `os._exit()`
or SIGKILL (no final document at all). The exit status stays the authority; scheduler_lite
records it.

SIGTERM: only when its disposition is the default (SIG_DFL) at start-up; a script with its own
handler (or SIG_IGN) keeps it, and a handler the script installs later replaces this one. The
handler writes the final stats and the exit report, then restores SIG_DFL and raises SIGTERM
again, so the process still dies of it (exit status -15, or 143 from a shell). The work is done
on a thread of its own: the main thread may be interrupted while it holds a lock the work needs,
or be stuck in a TensorFlow op that a pause holds at compute share 0, where a Python handler
would not run until the op returns. For that second case Python's signal wakeup fd wakes the
thread as the signal arrives (unless the process already uses the wakeup fd, e.g. asyncio).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tf_antman._log import log

# How long the process may take to die of the re-raised SIGTERM before it exits by itself.
_DIE_TIMEOUT_S = 5.0


def is_failure(status: object) -> bool:
    """Whether SystemExit(status) ends the process with a non-zero exit status (Python's rule:
    None and 0 are success, another integer is the status, anything else prints and exits 1)."""
    return status is not None and status != 0


class FinalState:
    """Watches how the process ends and closes `agent` with the matching state.

    `agent` is a JobAgent (its `close(state)`); `report()` logs the exit report, called on
    SIGTERM only (at a normal exit exit_report.py's own hook logs it).
    """

    def __init__(self, agent: Any, report: Callable[[], None]) -> None:
        self._agent = agent
        self._report = report
        self._failed = False
        self._ending = threading.Lock()
        self._ended = False
        self._handler: Callable[[int, Any], None] | None = None
        self._wakeup_fds: tuple[int, int] | None = None  # (read, write) of signal.set_wakeup_fd

    def install(self) -> None:
        self._watch_exceptions()
        self._watch_exit_calls()
        self._watch_sigterm()
        # Close while threads still run normally: from a plain atexit callback (run after the
        # interpreter began shutting threads down) stopping watchdog's inotify observer took
        # ~30 s. threading._register_atexit runs before that, as concurrent.futures relies on.
        register = getattr(threading, "_register_atexit", None)
        (register or _atexit_register)(self._close_at_exit)
        os.register_at_fork(after_in_child=self._forked)

    # --- exceptions and exit calls --------------------------------------------------------------

    def _watch_exceptions(self) -> None:
        previous = sys.excepthook

        def mark_failed(*exc: Any) -> None:
            self._failed = True
            previous(*exc)

        sys.excepthook = mark_failed

    def _watch_exit_calls(self) -> None:
        """sys.exit, and the exit/quit that site.py puts in builtins, note a failing status."""
        sys.exit = self._noting(sys.exit)
        for name in ("exit", "quit"):
            quitter = getattr(builtins, name, None)
            if quitter is not None:
                setattr(builtins, name, _NotingQuitter(quitter, self._note_exit))

    def _noting(self, exit_fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(exit_fn)
        def exit_noting_status(status: object = None) -> Any:
            self._note_exit(status)
            return exit_fn(status)

        return exit_noting_status

    def _note_exit(self, status: object) -> None:
        # A SystemExit the script catches and survives still counts: nothing in Python says
        # whether it will be caught.
        if is_failure(status):
            self._failed = True

    def _close_at_exit(self) -> None:
        self._end("failed" if self._failed else "finished", report=False)

    # --- SIGTERM --------------------------------------------------------------------------------

    def _watch_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # signal.signal() works on the main thread only (TensorFlow imported from another).
            log.debug("started off the main thread: SIGTERM is not watched")
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the script's own handler, or SIG_IGN: theirs to keep
        self._handler = self._on_sigterm
        signal.signal(signal.SIGTERM, self._handler)
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
        threading.Thread(target=self._read_wakeups, args=(read_fd,), name="tf_antman-sigterm-wakeup",
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
            if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is self._handler:
                self._terminate()

    def _forked(self) -> None:
        """In a forked child (multiprocessing's default start method on Linux): it shares the
        job's agent lock but is not the agent's process, so it writes no final state; and its
        SIGTERM (multiprocessing's terminate()) must end it as by default, not reach the parent's
        wakeup reader through the pipe they share."""
        self._ending = threading.Lock()  # another thread may have held it at the fork
        self._ended = True
        if self._handler is None:
            return
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) is self._handler:
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
                self._agent.close(state)
                if report:
                    self._report()
            except Exception:  # noqa: BLE001 - the job is ending: never change how
                log.warning("writing the final stats (%s) failed", state, exc_info=True)


class _NotingQuitter:
    """site.Quitter (`exit`, `quit`) that notes the status first; repr unchanged for the REPL."""

    def __init__(self, quitter: Any, note: Callable[[object], None]) -> None:
        self._quitter = quitter
        self._note = note

    def __repr__(self) -> str:
        return repr(self._quitter)

    def __call__(self, code: object = None) -> Any:
        self._note(code)
        return self._quitter(code)


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


def _atexit_register(fn: Callable[[], None]) -> None:  # pragma: no cover - CPython >= 3.9 has the other
    import atexit

    atexit.register(fn)
