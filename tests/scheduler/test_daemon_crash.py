"""The daemon as a separate process, SIGKILLed at random points of its loop and restarted.

Jobs are plain Python processes speaking the file protocol (tests/scheduler/test_daemon_fakes.py),
each about a second long; every start appends the job id to a shared log. The daemon dies 20
times: at a fault point (SCHEDULER_LITE_FAULT: launch booked, process started with its pid not
recorded, between control writes, between stats reads, an exit noticed but not recorded) or by a
kill -9 from outside at a random moment. After each death the store must account exactly for
what runs (each GPU at most one guarantee job, quotas respected, settings rows only for running
jobs), the next daemon must re-adopt every job process still alive, and at the end every job has
finished exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite.faults import FAULT_AFTER_ENV, FAULT_ENV, FAULT_POINTS
from scheduler_lite.launcher import EXIT_STATUS_FILE, process_running, wrappers_under
from scheduler_lite.model import JobKind, Role
from scheduler_lite.storage import JobRecord, JobSpec, JobStatus, SqliteStorage
from scheduler_lite.submission import request_cancel, submit_once
from scheduler_lite.testing import stop_all_jobs
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import JOB_ENV, REPO, fake_command, wait_for

DEATHS = 20
JOBS = 40
CONFIG = to_toml(scheduler_config(
    ["1GiB", "1GiB"], {"A": 1, "B": 0}, jobs={"cancel_grace_s": 2},
    daemon={"tick_interval_s": 0.05, "schedule_interval_s": 0.2, "utilisation_window_s": 0.5},
    coordinator={"round_interval_s": 0.2, "min_memory_bytes": "64MiB"}))


def job_processes(state_dir: Path) -> dict[str, int]:
    """Live job wrappers of this store, by job id (other daemons on the machine run jobs with the
    same ids, under other job directories)."""
    return {name.split(":")[1]: pid for pid, name in wrappers_under(state_dir / "jobs")}


def start_daemon(config: Path, log: Path, fault: str | None, after: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault
        env[FAULT_AFTER_ENV] = str(after)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(config), "serve",
                                 "--log-level", "WARNING"], env=env, stdout=out, stderr=out,
                                start_new_session=True)


def check_store(db: Path) -> list[str]:
    """The store's accounting while no daemon runs; returns the running job ids."""
    store = SqliteStorage(db)
    try:
        running = store.list_jobs([JobStatus.RUNNING])
        holders: dict[int, str] = {}
        quota: dict[str, int] = {}
        for r in running:
            assert r.placement and r.role is not None, r
            if r.role is Role.GUARANTEE:
                for g in r.placement:
                    assert g not in holders, f"GPU {g} held by {holders[g]} and {r.id}"
                    holders[g] = r.id
                quota[r.tenant] = quota.get(r.tenant, 0) + r.num_gpus
        assert quota.get("A", 0) <= 1 and quota.get("B", 0) == 0, quota
        ids = {r.id for r in running}
        rows = {p.job_id for p in store.placements()}
        assert rows <= ids, f"settings rows for jobs not running: {rows - ids}"
        return sorted(ids)
    finally:
        store.close()


def test_daemon_survives_kill_9_at_random_points(tmp_path: Path) -> None:
    rng = random.Random(13)
    config = tmp_path / "scheduler.toml"
    config.write_text(CONFIG)
    runs = tmp_path / "runs.log"
    runs.touch()
    db = tmp_path / "state" / "scheduler.db"
    store = SqliteStorage(db)
    env = tuple({**JOB_ENV, "FAKE_RUNS_LOG": str(runs)}.items())
    submitted = []
    for i in range(JOBS):
        tenant, kind = ("A", JobKind.GUARANTEE) if i % 3 == 0 else ("B", JobKind.OPPORTUNISTIC)
        spec = JobSpec(tenant=tenant, kind=kind, num_gpus=1, command=tuple(fake_command(steps=30, step_s=0.05)),
                       workdir=str(tmp_path), submit_time=time.time(), env=env)
        submitted.append(submit_once(store, spec)[0].id)
    store.close()
    daemon_log = tmp_path / "daemon.log"
    deaths = []
    try:
        for death in range(DEATHS):
            fault = rng.choice([*FAULT_POINTS, None])
            proc = start_daemon(config, daemon_log, fault, rng.randint(1, 3))
            if fault is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=rng.uniform(0.5, 2.5))
            else:
                # It kills itself at the fault point however long a loaded machine takes to get
                # there (a fixed 6 s from the start could end it first: the interpreter's start
                # alone takes seconds there), unless no work is left to reach it: every job done.
                store = SqliteStorage(db)
                try:
                    def fired_or_idle(proc: subprocess.Popen[bytes] = proc, store: SqliteStorage = store) -> bool:
                        return proc.poll() is not None or all(j.state.done for j in store.list_jobs())
                    wait_for(fired_or_idle, timeout=300, interval=0.1)
                finally:
                    store.close()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # kill -9 from outside, wherever it is
            proc.wait()
            assert proc.returncode == -signal.SIGKILL, (death, fault, proc.returncode, daemon_log.read_text()[-2000:])
            running = check_store(db)
            alive = job_processes(tmp_path / "state")
            if not set(alive) <= set(running):
                store = SqliteStorage(db)
                states = {j: (store.get_job(j), [(e.kind, e.detail) for e in store.events(j)]) for j in alive}
                store.close()
                raise AssertionError(f"death {death} ({fault}): job processes the store does not know run: "
                                     f"{alive} {states}")
            deaths.append((fault, sorted(alive)))
            # The next daemon accounts for every job alive now: adopted, or recorded as ended.
            store = SqliteStorage(db)
            before = store.events()[-1].id
            store.close()
            verify = start_daemon(config, daemon_log, None, 0)
            try:
                store = SqliteStorage(db)
                try:
                    def accounted(store: SqliteStorage = store, before: int = before,
                                  alive: dict[str, int] = alive) -> bool:
                        seen = {e.job_id for e in store.events(after_id=before) if e.kind in ("adopted", "exited")}
                        return set(alive) <= seen
                    # Deadline for a loaded machine, where the interpreter's start alone takes seconds.
                    assert wait_for(accounted, timeout=120), (alive, daemon_log.read_text()[-2000:])
                finally:
                    store.close()
            finally:
                os.killpg(verify.pid, signal.SIGKILL)
                verify.wait()
        final = start_daemon(config, daemon_log, None, 0)
        store = SqliteStorage(db)
        try:
            assert wait_for(lambda: all(j.state.done for j in store.list_jobs()), timeout=300), [
                (j.id, str(j.state)) for j in store.list_jobs() if not j.state.done]
            jobs = store.list_jobs()
            events = store.events()
        finally:
            store.close()
            final.send_signal(signal.SIGTERM)
            final.wait(timeout=120)
    finally:
        for pid in job_processes(tmp_path / "state").values():  # this test's jobs only
            os.killpg(pid, signal.SIGKILL)
    assert [j.id for j in jobs] == submitted
    assert all(j.state is JobStatus.FINISHED for j in jobs), [(j.id, j.state, j.reason) for j in jobs]
    starts = runs.read_text().split()
    assert sorted(starts) == sorted(submitted), "a job was lost or run twice: " + json.dumps(
        {j: starts.count(j) for j in submitted if starts.count(j) != 1})
    assert not any(e.kind == "exited" and "unknown" in str(e.detail.get("reason")) for e in events)
    assert not SqliteStorage(db).placements()
    fired = {line.rsplit(" ", 1)[1] for line in daemon_log.read_text().splitlines() if "fault injection" in line}
    assert fired >= {"booked", "started", "control", "observe"}, (fired, deaths)


# -- "never started" vs "started, pid unknown", and pid reuse, without waiting for a race ------------


def _record_launch(store: SqliteStorage, tmp_path: Path, token: str | None) -> str:
    spec = JobSpec(tenant="B", kind=JobKind.OPPORTUNISTIC, num_gpus=1, command=("true",), workdir=str(tmp_path),
                   submit_time=time.time())
    job = submit_once(store, spec)[0].id
    job_dir = tmp_path / "state" / "jobs" / job
    job_dir.mkdir(parents=True)
    store.update_job(job, state=JobStatus.RUNNING, role=Role.OPPORTUNISTIC, placement=(0,), job_dir=str(job_dir),
                     started_at=time.time(), launch_token=token)
    return job


def _daemon(tmp_path: Path, store: SqliteStorage):
    from scheduler_lite.config import load_config
    from scheduler_lite.daemon import Daemon

    config = tmp_path / "scheduler.toml"
    config.write_text(CONFIG)
    return Daemon(load_config(config), store)


def test_a_started_job_without_pid_or_pid_file_is_found_by_its_launch_token(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "state" / "scheduler.db")
    started = _record_launch(store, tmp_path, "t0ken")
    never = _record_launch(store, tmp_path, "n0ne")
    # The daemon died right after Popen: the wrapper runs, it has not written its pid file yet.
    proc = subprocess.Popen(["/bin/sh", "-c", "sleep 60", f"scheduler-lite:{started}:t0ken"], start_new_session=True)
    try:
        d = _daemon(tmp_path, store)
        assert [e.detail["pid"] for e in store.events(started) if e.kind == "adopted"] == [proc.pid]
        assert store.get_job(started).state is JobStatus.RUNNING  # type: ignore[union-attr]
        assert store.get_job(never).state is JobStatus.QUEUED  # type: ignore[union-attr]
        assert [e.kind for e in store.events(never)][-1] == "requeued"
        stop_all_jobs(d, grace_s=1)
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_file_naming_another_process_is_not_adopted(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "state" / "scheduler.db")
    job = _record_launch(store, tmp_path, "t0ken")
    # The pid in the file now belongs to an unrelated process (the job ended, the pid was reused).
    other = subprocess.Popen(["/bin/sh", "-c", "sleep 60"], start_new_session=True)
    try:
        (tmp_path / "state" / "jobs" / job / "pid").write_text(f"{other.pid}\n")
        _daemon(tmp_path, store)
        record = store.get_job(job)
        assert record is not None and record.state is JobStatus.FAILED and "daemon was down" in (record.reason or "")
        assert other.poll() is None  # not signalled either
    finally:
        other.kill()
        other.wait()


# -- what a daemon killed with -9 (or left without its state directory) leaves to the next -----------


@contextlib.contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[SqliteStorage, Path]]:
    """This test's store, its config written, the daemon not started yet; at the end every job
    process of this store is killed and the store closed."""
    config = tmp_path / "scheduler.toml"
    config.write_text(CONFIG)
    store = SqliteStorage(tmp_path / "state" / "scheduler.db")
    try:
        yield store, config
    finally:
        for record in store.list_jobs():
            if record.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(record.pid, signal.SIGKILL)
        for pid in job_processes(tmp_path / "state").values():
            os.killpg(pid, signal.SIGKILL)
        store.close()


def queue(store: SqliteStorage, tmp_path: Path, *command: str) -> str:
    spec = JobSpec(tenant="B", kind=JobKind.OPPORTUNISTIC, num_gpus=1, command=command, workdir=str(tmp_path),
                   submit_time=time.time())
    return submit_once(store, spec)[0].id


def kill_9(daemon: subprocess.Popen[bytes]) -> None:
    os.killpg(daemon.pid, signal.SIGKILL)  # the daemon's own session: its jobs have theirs
    daemon.wait()


def stop(daemon: subprocess.Popen[bytes]) -> None:
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=20)


def record_of(store: SqliteStorage, job: str) -> JobRecord:
    record = store.get_job(job)
    assert record is not None
    return record


def test_a_job_that_ends_while_the_daemon_is_down_leaves_nothing_running_and_ends_when_it_did(
        tmp_path: Path) -> None:
    """Its main process ends while no daemon runs and leaves a child behind in its group. The
    next daemon kills that child (as it does when it watches an end) and records the end at the
    time the wrapper wrote it down, not at the restart."""
    with serving(tmp_path) as (store, config):
        job = queue(store, tmp_path, "/bin/sh", "-c", "sleep 60 & echo $! > left; sleep 1")
        log = tmp_path / "daemon.log"
        daemon = start_daemon(config, log, None, 0)
        try:
            assert wait_for(lambda: (tmp_path / "left").exists() and (tmp_path / "left").read_text().endswith("\n"))
            assert wait_for(lambda: record_of(store, job).pid is not None)
        finally:
            kill_9(daemon)
        left = int((tmp_path / "left").read_text())
        try:
            exit_file = Path(record_of(store, job).job_dir or "") / EXIT_STATUS_FILE
            assert wait_for(lambda: exit_file.exists())
            time.sleep(2.0)  # down for a while after the end
            restarted_at = time.time()
            daemon = start_daemon(config, log, None, 0)
            try:
                assert wait_for(lambda: record_of(store, job).state.done, timeout=30), log.read_text()[-2000:]
                assert wait_for(lambda: not process_running(left, None), timeout=10), "the child outlived its job"
            finally:
                stop(daemon)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(left, signal.SIGKILL)
        record = record_of(store, job)
        assert record.state is JobStatus.FINISHED and "while the daemon was down" in (record.reason or "")
        assert record.ended_at == pytest.approx(exit_file.stat().st_mtime, abs=0.01)
        assert record.ended_at is not None and record.ended_at < restarted_at - 1.5


def test_a_job_the_restarted_daemon_kills_reads_as_killed_by_sigkill(tmp_path: Path) -> None:
    """Cancelled, it ignores SIGTERM; the daemon dies within the grace period. The next one sends
    the SIGKILL: the job is not its child and its wrapper dies with it (no exit_status), yet it
    reads -9 as it would have without the restart, not 'exit status unknown'."""
    with serving(tmp_path) as (store, config):
        job = queue(store, tmp_path, "/bin/sh", "-c", "trap '' TERM; echo up > up; while :; do sleep 0.05; done")
        log = tmp_path / "daemon.log"
        daemon = start_daemon(config, log, None, 0)
        try:
            assert wait_for(lambda: (tmp_path / "up").exists())
            request_cancel(store, job, time.time())
            assert wait_for(lambda: "stopping" in [e.kind for e in store.events(job)])
        finally:
            kill_9(daemon)
        daemon = start_daemon(config, log, None, 0)
        try:
            assert wait_for(lambda: record_of(store, job).state.done, timeout=30), log.read_text()[-2000:]
        finally:
            stop(daemon)
        record = record_of(store, job)
        assert record.state is JobStatus.CANCELLED
        assert (record.exit_code, record.reason) == (-signal.SIGKILL, "killed by SIGKILL")
        assert [e.detail["signal"] for e in store.events(job) if e.kind == "stopping"] == ["SIGTERM", "SIGKILL"]


def test_a_daemon_whose_state_directory_is_deleted_stops_and_leaves_its_jobs_running(tmp_path: Path) -> None:
    """Unreachable (its socket is gone) and no longer holding the lock a second daemon would
    meet, it must not go on managing jobs: it logs the file it lost and exits with status 1,
    its jobs left running as on SIGTERM."""
    with serving(tmp_path) as (store, config):
        job = queue(store, tmp_path, "sleep", "60")
        log = tmp_path / "daemon.log"
        daemon = start_daemon(config, log, None, 0)
        try:
            assert wait_for(lambda: record_of(store, job).pid is not None)
            pid = record_of(store, job).pid
            assert pid is not None
            # rm -rf, again while the daemon and the job write into it meanwhile
            assert wait_for(lambda: shutil.rmtree(tmp_path / "state", ignore_errors=True) or
                            not (tmp_path / "state").exists())
            assert daemon.wait(timeout=20) == 1
        finally:
            if daemon.poll() is None:
                kill_9(daemon)
        try:
            lines = log.read_text().splitlines()
            lock = str(tmp_path / "state" / "daemon.lock")
            assert any("ERROR" in line and lock in line and "removed or replaced" in line for line in lines), lines
            assert lines[-1].startswith("scheduler-lite: error: ") and lines[-1].endswith(lock), lines[-1]
            assert process_running(pid, None)  # left running, as a normal shutdown leaves it
        finally:
            os.killpg(pid, signal.SIGKILL)
