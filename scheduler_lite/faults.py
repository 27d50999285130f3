"""Fault injection for the daemon's crash tests: SIGKILL itself at a named point of a tick.

SCHEDULER_LITE_FAULT="point,point..." and SCHEDULER_LITE_FAULT_AFTER=N make the daemon SIGKILL
itself the Nth time it passes one of the points (tests/scheduler/test_daemon_crash.py). Points:
booked (launch recorded, process not started), started (process started, pid not recorded),
control (between two control.json writes), observe (between two stats reads), ended (an exit
noticed, not yet recorded), and the socket server's submitted (a submit committed, its answer
not yet sent: SERVER_FAULT_POINTS, apart so that the tick's list stays what the random crash
test draws from). Unset: no effect. A wrong setting is logged and ignored: a test
hook must never stop a daemon from serving. (A crash in the middle of a migration is tested
in-process: tests/scheduler/test_daemon_migration.py.)
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Final

log = logging.getLogger("scheduler_lite")

FAULT_ENV: Final = "SCHEDULER_LITE_FAULT"
FAULT_AFTER_ENV: Final = "SCHEDULER_LITE_FAULT_AFTER"
FAULT_POINTS: Final = ("booked", "started", "control", "observe", "ended")
SERVER_FAULT_POINTS: Final = ("submitted",)


class Faults:
    def __init__(self) -> None:
        environ = os.environ
        names = [p for p in environ.get(FAULT_ENV, "").split(",") if p]
        after = environ.get(FAULT_AFTER_ENV, "1")
        bad = [p for p in names if p not in FAULT_POINTS + SERVER_FAULT_POINTS]
        if bad or not after.isdigit() or not 1 <= int(after) <= 1_000_000:
            if names:  # a test hook set wrong: say so and run without faults
                log.error("%s=%r / %s=%r ignored: accepted points %s, and a count in [1, 1000000]",
                          FAULT_ENV, environ.get(FAULT_ENV), FAULT_AFTER_ENV, after, ",".join(FAULT_POINTS + SERVER_FAULT_POINTS))
            names = []
        self.points = frozenset(names)
        self.left = int(after) if self.points else 0

    def at(self, point: str) -> None:
        if point in self.points:
            self.left -= 1
            if self.left <= 0:
                log.warning("fault injection: SIGKILL at %s", point)
                os.kill(os.getpid(), signal.SIGKILL)
