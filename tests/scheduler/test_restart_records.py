"""Records after a restart tell the truth (real daemon processes, real restarts).

- A crash at the `started` fault point (the process started, its pid not recorded): the history
  has the `launched` event (recorded by the restart), then `adopted`.
- A job that ends while the restarted daemon is still taking over (the restart waits for a launch
  booked just before the crash, fault point `booked`): its end time is the one its wrapper
  recorded (was clamped to the start of the take-over, seconds early) and the reason says it
  ended while the daemon was starting (was "while the daemon was down").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from scheduler_lite.faults import FAULT_AFTER_ENV, FAULT_ENV
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import REPO, wait_for
from tests.scheduler.test_submit_idempotent import serving

CONFIG = to_toml(scheduler_config(["1GiB", "1GiB"], {"A": 2, "B": 0}, jobs={"cancel_grace_s": 1},
                                  daemon={"tick_interval_s": 0.05}, coordinator={"min_memory_bytes": "64MiB"}))


class Site:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.config = base / "sl.toml"
        self.config.write_text(CONFIG)
        self.log = base / "daemon.log"
        self.daemon: subprocess.Popen[bytes] | None = None

    def start(self, fault: str | None = None, after: int = 1, wait: bool = True) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop(FAULT_ENV, None)
        if fault:
            env[FAULT_ENV], env[FAULT_AFTER_ENV] = fault, str(after)
        with open(self.log, "ab") as out:
            self.daemon = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(self.config),
                                            "serve"], env=env, stdout=out, stderr=out, start_new_session=True)
        if wait:
            assert wait_for(lambda: serving(self.config) or self.daemon.poll() is not None, 30), self.log.read_text()

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            self.daemon.wait(30)

    def cli(self, *argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(self.config), *argv],
                              capture_output=True, text=True, cwd=self.base, timeout=60, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        return done.stdout

    def show(self, job_id: str) -> dict:
        return json.loads(self.cli("--json", "show", job_id))


def test_a_crash_at_started_keeps_the_launched_event(tmp_path: Path) -> None:
    site = Site(tmp_path)
    try:
        site.start(fault="started")
        job = site.cli("submit", "--tenant", "A", "--", "sleep", "60").strip()
        assert site.daemon is not None and site.daemon.wait(30) == -signal.SIGKILL
        site.start()
        assert wait_for(lambda: site.show(job)["job"]["state"] == "running"
                        and "adopted" in [e["kind"] for e in site.show(job)["events"]], 30)
        events = site.show(job)["events"]
        kinds = [e["kind"] for e in events]
        assert kinds[:3] == ["submitted", "launched", "adopted"], kinds
        launched = events[1]
        assert launched["detail"]["recorded_at_restart"] is True
        assert launched["detail"]["pid"] == site.show(job)["job"]["pid"]
        site.cli("cancel", job)
        assert wait_for(lambda: site.show(job)["job"]["state"] == "cancelled", 30)
    finally:
        site.stop()


def test_a_job_ending_while_the_daemon_starts_keeps_its_end_time(tmp_path: Path) -> None:
    site = Site(tmp_path)
    go = tmp_path / "go"
    try:
        site.start(fault="booked", after=2)  # the second booking kills it
        # Y runs until the test says so; X's booking kills the daemon before X starts.
        y = site.cli("submit", "--tenant", "A", "--", "/bin/sh", "-c",
                     f"while [ ! -e {go} ]; do sleep 0.05; done").strip()
        assert wait_for(lambda: site.show(y)["job"]["pid"] is not None, 30)
        x = site.cli("submit", "--tenant", "A", "--", "sleep", "60").strip()
        assert site.daemon is not None and site.daemon.wait(30) == -signal.SIGKILL
        # The restart waits (LAUNCH_GRACE_S after X's booking) for X's process before it takes
        # over Y: Y ends in that wait, once the new daemon holds the state directory.
        site.start(wait=False)
        lock = tmp_path / "state" / "daemon.lock"
        assert wait_for(lambda: lock.read_text().strip() == str(site.daemon.pid), 30)
        assert not serving(site.config)  # still taking over
        go.touch()
        assert wait_for(lambda: serving(site.config), 60)
        record = site.show(y)["job"]
        assert record["state"] == "finished"
        recorded = (Path(record["job_dir"]) / "exit_status").stat().st_mtime
        assert record["ended_at"] == recorded  # the wrapper's time, not the take-over's start
        assert record["reason"] == "exit status 0 (ended while the daemon was starting)"
        assert site.show(x)["job"]["state"] in ("queued", "running")  # X never started: requeued
        site.cli("cancel", x)  # a stopped daemon leaves its jobs running: X ends first
        assert wait_for(lambda: site.show(x)["job"]["state"] == "cancelled", 30)
    finally:
        site.stop()
