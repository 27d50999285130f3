"""What only the SQLite store promises: a file shared by processes, WAL, versioned schema."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scheduler_lite.model import JobKind
from scheduler_lite.storage import (
    SCHEMA_VERSION,
    JobPage,
    JobSpec,
    JobStatus,
    SqliteStorage,
    StorageError,
)
from scheduler_lite.storage import sqlite as sqlite_module
from scheduler_lite.storage.sqlite import MIGRATIONS

REPO = Path(__file__).resolve().parents[2]


def spec() -> JobSpec:
    return JobSpec("A", JobKind.AUTO, 1, ("true",), "/tmp", 1.0)


def test_schema_version_wal_and_idempotent_reopen(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "s.db"
    store = SqliteStorage(db)
    job = store.add_job(spec())
    store.close()
    again = SqliteStorage(db)  # reopening runs no migration and loses nothing
    assert again.schema_version() == SCHEMA_VERSION == len(MIGRATIONS)
    assert again.get_job(job.id) == job
    again.close()
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"jobs", "events", "placements", "quotas"} <= tables
    raw.close()


def test_migrates_an_empty_version_0_database(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sqlite3.connect(db).close()  # a file with user_version 0 and no tables
    store = SqliteStorage(db)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.add_job(spec()).id == "job-1"
    store.close()


def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    raw = sqlite3.connect(db)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(StorageError, match=f"schema version {SCHEMA_VERSION + 1} is newer"):
        SqliteStorage(db)


def test_a_second_process_sees_and_changes_the_same_jobs(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    daemon_side = SqliteStorage(db)
    first = daemon_side.add_job(spec())
    code = textwrap.dedent(f"""
        from scheduler_lite.storage import SqliteStorage, JobSpec
        from scheduler_lite.model import JobKind
        s = SqliteStorage({str(db)!r})
        s.update_job({first.id!r}, cancel_requested=True)
        print(s.add_job(JobSpec("B", JobKind.OPPORTUNISTIC, 2, ("x",), "/", 2.0)).id)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    second = out.stdout.strip()
    assert second == "job-2"
    got = daemon_side.get_job(first.id)
    assert got is not None and got.cancel_requested
    assert [(j.id, j.tenant, j.num_gpus) for j in daemon_side.list_jobs([JobStatus.QUEUED])] == [
        (first.id, "A", 1), (second, "B", 2)]
    daemon_side.close()


def test_ids_are_not_reused_after_a_rolled_back_insert_is_followed_by_commits(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "s.db")
    with pytest.raises(RuntimeError), store.transaction():
        store.add_job(spec())
        raise RuntimeError
    ids = [store.add_job(spec()).id for _ in range(3)]
    assert len(set(ids)) == 3 and [j.id for j in store.list_jobs()] == ids
    store.close()


def test_a_version_1_store_is_migrated_and_keeps_its_jobs(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    raw = sqlite3.connect(db)
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            raw.execute(statement)
    raw.execute("INSERT INTO jobs (id, tenant, kind, num_gpus, command, workdir, submit_time, state) "
                "VALUES ('job-1', 't', 'auto', 1, '[\"x\"]', '/', 0.0, 'running')")
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()
    store = SqliteStorage(db)
    assert store.schema_version() == SCHEMA_VERSION == 6
    job = store.get_job("job-1")
    assert job is not None and (job.launch_token, job.expected_steps, job.expected_duration_s) == (None, None, None)
    assert (job.uid, job.user) == (None, "")  # 2 -> 3: submitted before users were known
    # 3 -> 4: no share stated, not restartable, not being migrated
    assert (job.requested_share, job.restartable, job.migrating) == (None, False, False)
    assert job.launched_at is None  # 4 -> 5: its launch's time is started_at (status reads that)
    assert job.request_id is None  # 5 -> 6: submitted without a request id
    store.close()


def test_a_request_id_survives_a_reopen_and_is_unique_in_the_file(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SqliteStorage(db)
    store.add_job(JobSpec(tenant="A", kind=JobKind.GUARANTEE, num_gpus=1, command=("x",), workdir="/",
                          submit_time=0.0, uid=1000, request_id="r-1"))
    store.close()
    again = SqliteStorage(db)  # as a restarted daemon opens it
    found = again.job_by_request(1000, "r-1")
    assert found is not None and found.id == "job-1"
    again.close()
    # The unique index holds even for a writer that skips add_job's lookup.
    raw = sqlite3.connect(db)
    with pytest.raises(sqlite3.IntegrityError):
        raw.execute("INSERT INTO jobs (id, tenant, kind, num_gpus, command, workdir, submit_time, state, uid, "
                    "request_id) VALUES ('x', 'A', 'auto', 1, '[]', '/', 0, 'queued', 1000, 'r-1')")
    raw.close()


def test_a_page_of_a_store_with_100k_jobs_reads_the_page_not_the_store(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`list` on a long-lived workstation: 100,000 jobs inserted directly. A page builds only its
    own jobs, and the database's work (virtual machine steps) stays far below reading every job,
    as `list` did: about 40 steps a job, 4 million here. Near the newest jobs, where `list` reads,
    a page takes fewer steps than the store has jobs; deep in the store, or with a state most jobs
    are in, counting the older ones reads their index entries (a few steps each), never a row."""
    db = tmp_path / "s.db"
    SqliteStorage(db).close()  # the current schema
    states = ["finished"] * 90 + ["failed"] * 6 + ["cancelled"] * 2 + ["queued", "running"]
    raw = sqlite3.connect(db)
    raw.executemany("INSERT INTO jobs (seq, id, tenant, kind, num_gpus, command, workdir, submit_time, state) "
                    "VALUES (?, ?, 'A', 'auto', 1, '[\"python\", \"train.py\"]', '/tmp', 0.0, ?)",
                    ((seq, f"job-{seq}", states[seq % 100]) for seq in range(1, 100_001)))
    raw.commit()
    raw.close()

    built: list[str] = []
    real_job = sqlite_module._job
    monkeypatch.setattr(sqlite_module, "_job", lambda row: built.append(row[0]) or real_job(row))
    store = SqliteStorage(db)
    hundreds = [0]

    def count() -> int:
        hundreds[0] += 1
        return 0

    store._db.set_progress_handler(count, 100)  # called every 100 virtual machine steps

    def page(limit: int, before: str | None = None, wanted: list[JobStatus] | None = None) -> tuple[JobPage, int]:
        built.clear()
        hundreds[0] = 0
        found = store.jobs_page(limit, before, wanted)
        assert built == [j.id for j in found.jobs]  # the page's rows, and no other, became jobs
        return found, hundreds[0] * 100

    first, steps = page(50)
    assert [j.id for j in first.jobs] == [f"job-{n}" for n in range(99_951, 100_001)]
    assert (first.remaining, first.next_cursor) == (99_950, "job-99951") and steps < 100_000, steps
    second, steps = page(50, first.next_cursor)
    assert second.jobs[-1].id == "job-99950" and second.remaining == 99_900 and steps < 100_000, steps
    running, steps = page(50, None, [JobStatus.QUEUED, JobStatus.RUNNING])  # 2% of the jobs
    assert [j.id for j in running.jobs][-2:] == ["job-99998", "job-99999"] and running.remaining == 1_950
    assert steps < 100_000, steps
    middle, steps = page(50, "job-50001")
    assert [j.id for j in middle.jobs] == [f"job-{n}" for n in range(49_951, 50_001)] and middle.remaining == 49_950
    assert steps < 500_000, steps
    finished, steps = page(50, None, [JobStatus.FINISHED])  # 90% of the jobs
    assert finished.jobs[-1].id == "job-100000" and finished.remaining == 90_000 - 50 and steps < 500_000, steps
    largest, steps = page(500)
    assert len(largest.jobs) == 500 and largest.remaining == 99_500 and steps < 100_000, steps
    store.close()
