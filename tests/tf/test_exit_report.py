"""A job's own log says at exit what tf-antman did (tf_antman/exit_report.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import run_py
from tests.tf.test_memory import KERAS_RUN
from tf_antman import exit_report
from tf_antman.holds import SHARE_ZERO, HoldClock
from tf_antman.native import Native
from tf_antman.units import format_bytes

ONE_EPOCH = KERAS_RUN.replace("epochs=2", "epochs=1")


# Through absl: "<level letter><date> <time> <thread> <file:line>] <message>" once absl's handler is
# installed (absl.app), else Python logging's "<LEVEL>:absl:<message>". INFO lines show only at
# INFO verbosity, which the job then asks for, as a user would.
VERBOSE = "from absl import logging as absl_logging\nabsl_logging.set_verbosity(absl_logging.INFO)\n"


def exit_lines(stderr: str) -> list[tuple[str, str]]:
    """(level letter, message) of every exit-report line."""
    found = []
    for line in stderr.splitlines():
        if "tf-antman: at exit: " not in line:
            continue
        head, message = line.split(":absl:", 1) if ":absl:" in line else line.split("] ", 1)
        found.append((head[:1], message))
    return found


def test_a_job_over_its_limit_says_how_much_came_from_host_memory() -> None:
    job = run_py(ONE_EPOCH, ANTMAN_DEVICE_MEMORY="1GiB", ANTMAN_MEMORY_LIMIT="4MiB")
    result = job.result
    assert result["fallbacks"] > 0
    [(level, line)] = exit_lines(job.stderr)  # a warning: shown at absl's default verbosity
    assert level == "W" and line.startswith("tf-antman: at exit: peak device memory ")
    assert "(limit 4.0 MiB)" in line
    # The same allocator counters as tf_antman.memory_stats() at the end of training.
    assert f"{format_bytes(result['host_served'])} served from host memory past the limit " \
           f"({result['fallbacks']} allocations" in line
    assert "paused 0.0 s" in line


def test_a_job_within_its_limit_says_so_quietly() -> None:
    assert exit_lines(run_py(ONE_EPOCH, ANTMAN_DEVICE_MEMORY="1GiB").stderr) == []  # quiet by default
    job = run_py(VERBOSE + ONE_EPOCH, ANTMAN_DEVICE_MEMORY="1GiB")
    [(level, line)] = exit_lines(job.stderr)
    assert level == "I" and line.startswith("tf-antman: at exit: peak device memory ")
    assert "limit: the whole device" in line and "nothing served from host memory" in line
    assert format_bytes(job.result["peak"]) in line


def test_paused_and_throttled_time_are_reported() -> None:
    mem = SimpleNamespace(limit=1 << 30, device_capacity=1 << 30, peak_in_use=5 << 20, host_bytes_served=0,
                          host_fallbacks=0, host_peak=0)
    now = [100.0]
    holds = HoldClock(clock=lambda: now[0])  # the runtime's clock of every hold (holds.py)
    holds.set(SHARE_ZERO, True)
    now[0] += 3.25  # still held at exit: counted up to now
    native = SimpleNamespace(mem_stats=lambda: mem, op_stats=lambda: SimpleNamespace(idle_inserted_ns=2_500_000_000),
                             holds=holds)
    f = exit_report.figures(native)
    assert (f.paused_s, f.throttled_s, f.limit_bytes, f.slowed) == (3.25, 2.5, None, True)
    assert exit_report.describe(f) == ("at exit: peak device memory 5.0 MiB (limit: the whole device); nothing "
                                       "served from host memory; paused 3.2 s; throttled 2.5 s (waiting for a "
                                       "compute share below 100%)")


class _SlowShareLib:
    """antman_rt_set_share of a fake core: a share of 0 takes a while to land (as when the call
    waits for the manager's lock), so another thread's set_share can come in the middle."""

    def __init__(self) -> None:
        self.share = 1.0
        self.zero_inside = threading.Event()

    def antman_rt_set_share(self, share: float) -> int:
        self.share = share
        if share == 0.0:
            self.zero_inside.set()
            time.sleep(0.3)
        return 0


def test_the_hold_clock_agrees_with_the_share_when_two_threads_set_it_at_once() -> None:
    # A user's set_compute_share(0) and the agent's resume to 1 at the same moment: whichever
    # lands last in the core must be what the exit report's clock says (held at 0, not at 1).
    lib = _SlowShareLib()
    native = Native(lib=lib, path=Path("fake"))  # type: ignore[arg-type]
    pause = threading.Thread(target=native.set_share, args=(0.0,))
    pause.start()
    assert lib.zero_inside.wait(5)
    native.set_share(1.0)
    pause.join()
    assert native.holds.held == (lib.share == 0.0), lib.share


def test_holds_too_short_to_show_do_not_make_a_warning() -> None:
    # "paused 0.0 s; throttled 0.0 s" as a WARNING told the user nothing.
    quiet = exit_report.ExitFigures(peak_device_bytes=1, limit_bytes=None, host_bytes_served=0, host_fallbacks=0,
                                    host_peak_bytes=0, paused_s=0.04, throttled_s=0.049)
    assert not quiet.slowed
    assert exit_report.ExitFigures(1, None, 0, 0, 0, paused_s=0.0, throttled_s=0.06).slowed

