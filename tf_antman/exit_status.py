"""Whether the process is ending in failure, as far as Python can tell (final_state.py).

Two ways, read at exit (an `atexit` callback, after the main module and every non-daemon thread
have finished):

- an exception nobody caught in the main thread: the interpreter stores it in `sys.last_value`
  before printing its traceback, whatever `sys.excepthook` the script installed (a hook wrapped
  once at start-up would miss one the script installs later);
- a non-zero status given to `sys.exit`, `exit` or `quit` (SystemExit does not reach any hook, and
  its status is not visible from Python at exit): these are wrapped. The .pth hook wraps them at
  interpreter start, before the script runs, so `from sys import exit` binds the wrapper too.

Standard library only: imported at interpreter start by the .pth hook (tf_antman/_autoload.py).
"""

from __future__ import annotations

import builtins
import functools
import sys
from collections.abc import Callable
from typing import Any

_exit_failed = False  # a failing status was given to sys.exit / exit / quit


_MARK = "_tf_antman_noting_exit"


def is_failure(status: object) -> bool:
    """Whether SystemExit(status) ends the process with a non-zero exit status (Python's rule:
    None and 0 are success, another integer is the status, anything else prints and exits 1)."""
    return status is not None and status != 0


def note_exit(status: object) -> None:
    # A SystemExit the script catches and survives still counts: nothing in Python says whether it
    # will be caught.
    global _exit_failed
    if is_failure(status):
        _exit_failed = True


def failed() -> bool:
    """At exit: an uncaught exception ended the main module, or an exit call got a failing status."""
    return _exit_failed or getattr(sys, "last_value", None) is not None


def watch_exit_calls() -> None:
    """sys.exit, and the exit/quit that site.py puts in builtins, note a failing status; each is
    wrapped once. From the .pth hook site.py has not made exit/quit yet: activation wraps them."""
    if not getattr(sys.exit, _MARK, False):
        sys.exit = _noting(sys.exit)
    for name in ("exit", "quit"):
        quitter = getattr(builtins, name, None)
        if quitter is not None and not isinstance(quitter, _NotingQuitter):
            setattr(builtins, name, _NotingQuitter(quitter))


def _noting(exit_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(exit_fn)
    def exit_noting_status(status: object = None) -> Any:
        note_exit(status)
        return exit_fn(status)

    setattr(exit_noting_status, _MARK, True)
    return exit_noting_status


class _NotingQuitter:
    """site.Quitter (`exit`, `quit`) that notes the status first; repr unchanged for the REPL."""

    def __init__(self, quitter: Any) -> None:
        self._quitter = quitter

    def __repr__(self) -> str:
        return repr(self._quitter)

    def __call__(self, code: object = None) -> Any:
        note_exit(code)
        return self._quitter(code)
