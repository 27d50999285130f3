"""Helpers shared by the protocol tests (job side of docs/protocol.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tf_antman.protocol import Stats
from tf_antman.protocol import read_stats as _read_stats

# A bound on waiting for another thread, not a performance expectation: a healthy hand-off takes
# milliseconds; only a broken one gets anywhere near it.
WAIT_BOUND_S = 20.0


def wait_for(predicate: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.0005)


def read_stats(job_dir: Path) -> Stats | None:
    return _read_stats(job_dir)
