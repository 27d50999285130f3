"""Loops that tests, benches and examples run a `Daemon` with (not the daemon's own: `serve`).

    d = Daemon(config, SqliteStorage(config.db_path))
    run_until(d, lambda d: d.job(job_id).state.done, timeout=600)
    stop_all_jobs(d)                      # a demo's end: its jobs stopped, not left running
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from scheduler_lite.daemon import Daemon


def run_until(daemon: Daemon, predicate: Callable[[Daemon], bool], timeout: float,
              interval: float | None = None) -> bool:
    """tick() until predicate(daemon) holds (True) or `timeout` real seconds pass (False)."""
    deadline = time.monotonic() + timeout
    pause = daemon.config.daemon.tick_interval_s if interval is None else interval
    while True:
        daemon.tick()
        if predicate(daemon):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)


def stop_all_jobs(daemon: Daemon, grace_s: float | None = None) -> None:
    """Stop every running job now (blocking) and record it: for tests and demos, not shutdown
    (a daemon that stops leaves its jobs running for the next one)."""
    grace = daemon.config.jobs.cancel_grace_s if grace_s is None else grace_s
    jobs = daemon.jobs
    jobs.live.update(jobs.stopping)  # mid-migration: stopped, not started again
    jobs.stopping.clear()
    jobs.moves.clear()
    for job_id in list(jobs.live):
        with contextlib.suppress(Exception):
            daemon.storage.update_job(job_id, cancel_requested=True)
        ended = daemon.host.stop(jobs.live[job_id].handle, grace)
        daemon.finish(job_id, ended, daemon.clock(), None)
