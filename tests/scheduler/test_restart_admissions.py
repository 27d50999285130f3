"""A restart keeps admissions: the jobs a daemon runs (and adopts after a restart) hold their
GPUs before anything else is placed. The bug this is the test of: one GPU, three opportunistic
`sleep` jobs; one runs, two queue; each kill -9 and restart of the daemon admitted one more.
A real daemon process, real restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scheduler_lite.storage import JobStatus, SqliteStorage
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import REPO, wait_for
from tests.scheduler.test_submit_idempotent import serving

CONFIG = to_toml(scheduler_config(["1GiB"], {"A": 1, "B": 0},
                                  daemon={"tick_interval_s": 0.05, "schedule_interval_s": 0.2,
                                          "utilisation_window_s": 0.5},
                                  coordinator={"min_memory_bytes": "64MiB"}))


def running(db: Path) -> list[str]:
    store = SqliteStorage(db)
    try:
        return [j.id for j in store.list_jobs([JobStatus.RUNNING])]
    finally:
        store.close()


def start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(config), "serve"],
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=out,
                                start_new_session=True)
    assert wait_for(lambda: serving(config) or proc.poll() is not None, 30), log.read_text()
    return proc


def test_restarts_admit_nothing_more_on_a_busy_gpu(tmp_path: Path) -> None:
    config = tmp_path / "sl.toml"
    config.write_text(CONFIG)
    log = tmp_path / "daemon.log"
    db = tmp_path / "state" / "scheduler.db"
    daemon = start(config, log)
    try:
        for _ in range(3):
            done = subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(config), "submit",
                                   "--tenant", "B", "--type", "opportunistic", "--", "sleep", "120"],
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
        assert wait_for(lambda: len(running(db)) == 1, 30)
        time.sleep(1.5)  # several schedule passes: the other two stay queued
        first = running(db)
        assert len(first) == 1
        for restart in range(2):
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
            daemon = start(config, log)
            time.sleep(1.5)  # several ticks and schedule passes after the restart
            assert running(db) == first, (restart, running(db), log.read_text()[-3000:])
        subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(config), "cancel", "job-1", "job-2",
                        "job-3"], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=60,
                       check=False)
        assert wait_for(lambda: running(db) == [], 30)
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(30)
