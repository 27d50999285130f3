"""Storage in one SQLite file, shared by the daemon and the CLI processes (or, `MemoryStorage`,
in an in-memory database of its own).

WAL so that readers (`scheduler-lite list`) never block the daemon's writes; a busy timeout so
that two writers wait for each other instead of failing; every write inside `BEGIN IMMEDIATE`
(the write lock is taken at the start, so a transaction never fails half-way on a lock upgrade).
The schema is versioned with `PRAGMA user_version`: MIGRATIONS[i] takes a database from version i
to i + 1, run under `BEGIN EXCLUSIVE`; a database newer than this code is refused.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Final

from scheduler_lite.model import JobKind, Role
from scheduler_lite.storage.base import (
    MAX_EVENTS,
    MAX_SEQ,
    SCHEMA_VERSION,
    UPDATABLE,
    EventRecord,
    JobPage,
    JobRecord,
    JobSpec,
    JobStatus,
    PlacementRecord,
    StorageError,
    check_request_id,
    job_id_for,
    seq_of,
)

BUSY_TIMEOUT_MS: Final = 10_000

MIGRATIONS: Final[tuple[str, ...]] = (
    # 0 -> 1
    """
    CREATE TABLE IF NOT EXISTS jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        kind TEXT NOT NULL,
        num_gpus INTEGER NOT NULL,
        command TEXT NOT NULL,          -- JSON list
        workdir TEXT NOT NULL,
        submit_time REAL NOT NULL,
        env TEXT NOT NULL DEFAULT '[]', -- JSON list of [key, value]
        memory_bytes INTEGER,
        name TEXT NOT NULL DEFAULT '',
        state TEXT NOT NULL,
        role TEXT,
        placement TEXT NOT NULL DEFAULT '[]',
        pid INTEGER,
        pid_start INTEGER,
        job_dir TEXT,
        started_at REAL,
        ended_at REAL,
        exit_code INTEGER,
        reason TEXT,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        control_seq INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, seq);
    CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        time REAL NOT NULL,
        job_id TEXT,
        kind TEXT NOT NULL,
        detail TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX IF NOT EXISTS events_by_job ON events(job_id, id);
    CREATE TABLE IF NOT EXISTS placements (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        gpu INTEGER NOT NULL,
        memory_limit_bytes INTEGER NOT NULL,
        compute_share REAL NOT NULL,
        PRIMARY KEY (job_id, gpu)
    );
    CREATE TABLE IF NOT EXISTS quotas (
        tenant TEXT PRIMARY KEY,
        gpu_quota INTEGER NOT NULL
    );
    """,
    # 1 -> 2: what the job will do (auto jobs' remaining time), the launch token (crash safety)
    """
    ALTER TABLE jobs ADD COLUMN expected_steps INTEGER;
    ALTER TABLE jobs ADD COLUMN expected_duration_s REAL;
    ALTER TABLE jobs ADD COLUMN launch_token TEXT
    """,
    # 2 -> 3: the submitter, as the daemon identified it (its jobs run as that user)
    """
    ALTER TABLE jobs ADD COLUMN uid INTEGER;
    ALTER TABLE jobs ADD COLUMN user TEXT NOT NULL DEFAULT ''
    """,
    # 3 -> 4: requested GPU share and restartable (placement by share, migration), migrating
    """
    ALTER TABLE jobs ADD COLUMN requested_share REAL;
    ALTER TABLE jobs ADD COLUMN restartable INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN migrating INTEGER NOT NULL DEFAULT 0
    """,
    # 4 -> 5: when the current launch was booked (a migrated job keeps its first started_at)
    """
    ALTER TABLE jobs ADD COLUMN launched_at REAL
    """,
    # 5 -> 6: the client's request id (an interrupted submit retried finds its first job). One
    # per submitter: the index's -1 stands for NULL (the daemon's own user), which a unique index
    # would otherwise treat as distinct from every other NULL.
    """
    ALTER TABLE jobs ADD COLUMN request_id TEXT;
    CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_request ON jobs(IFNULL(uid, -1), request_id)
        WHERE request_id IS NOT NULL
    """,
)
assert len(MIGRATIONS) == SCHEMA_VERSION

# JobRecord's fields are the jobs table's columns. These are stored as something else (JSON text,
# enum values, 0 or 1) and converted each way here; the others are stored as they are.
_FLAGS: Final = ("cancel_requested", "restartable", "migrating")
_TO_COLUMN: Final[dict[str, Callable[[Any], Any]]] = {
    "kind": lambda v: str(JobKind(v)),
    "state": lambda v: str(JobStatus(v)),
    "role": lambda v: None if v is None else str(Role(v)),
    "command": lambda v: json.dumps(list(v)),
    "env": lambda v: json.dumps([list(kv) for kv in v]),
    "placement": lambda v: json.dumps(list(v)),
    **dict.fromkeys(_FLAGS, lambda v: int(bool(v))),
}
_FROM_COLUMN: Final[dict[str, Callable[[Any], Any]]] = {
    "kind": JobKind,
    "state": JobStatus,
    "role": lambda v: None if v is None else Role(v),
    "command": lambda v: tuple(json.loads(v)),
    "env": lambda v: tuple((k, x) for k, x in json.loads(v)),
    "placement": lambda v: tuple(json.loads(v)),
    **dict.fromkeys(_FLAGS, bool),
}
_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(JobRecord))
_DECODE_AT: Final = tuple((i, _FROM_COLUMN[c]) for i, c in enumerate(_COLUMNS) if c in _FROM_COLUMN)
_SELECT_JOBS: Final = f"SELECT {', '.join(_COLUMNS)} FROM jobs"
_SPEC_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(JobSpec))  # what add_job writes, and state
_INSERT_JOB: Final = (f"INSERT INTO jobs (id, state, {', '.join(_SPEC_COLUMNS)}) "
                      f"VALUES ('', ?, {', '.join('?' * len(_SPEC_COLUMNS))})")
_ALL_STATES: Final = ", ".join(f"'{s}'" for s in JobStatus)  # every row's state: the (state, seq) index covers all


class SqliteStorage:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        in_memory = str(path) == ":memory:"
        if not in_memory:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are ours (BEGIN IMMEDIATE), not the sqlite3 module's. An
        # in-memory database is this connection alone: like any object it may pass to another
        # thread (a test builds the daemon, a thread serves it). One thread writes; others may
        # only read (SQLite serializes the calls, but a transaction is the connection's, not a
        # thread's: a second writer would join the first one's and share its rollback).
        self._db = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   check_same_thread=not in_memory)
        self._open = False  # inside a transaction block: a nested one joins it
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        # Switching to WAL needs the database to itself and SQLite does not always wait for that
        # (many CLI processes opening a new store at once): retried within the busy timeout.
        _retry_locked(lambda: self._db.execute("PRAGMA journal_mode = WAL"))
        self._db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across a process crash
        self._db.execute("PRAGMA foreign_keys = ON")
        _retry_locked(self._migrate)

    # -- schema -----------------------------------------------------------------------------------

    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        if self.schema_version() == SCHEMA_VERSION:
            return
        with self._begin("EXCLUSIVE"):
            version = self.schema_version()  # again: another process may have migrated meanwhile
            if version > SCHEMA_VERSION:
                raise StorageError(
                    f"{self.path}: database schema version {version} is newer than this scheduler-lite "
                    f"(knows up to {SCHEMA_VERSION}); upgrade scheduler-lite"
                )
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {step + 1}")

    # -- transactions -----------------------------------------------------------------------------

    @contextmanager
    def _begin(self, mode: str) -> Iterator[None]:
        if self._open:
            yield
            return
        self._db.execute(f"BEGIN {mode}")
        self._open = True
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        finally:
            self._open = False
        self._db.execute("COMMIT")

    def transaction(self) -> AbstractContextManager[None]:
        """Group calls atomically: all committed at the end of the block, none if it raises.
        Nested blocks join the outermost one."""
        return self._begin("IMMEDIATE")

    # -- jobs -------------------------------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> JobRecord:
        """Store a queued job under a new id (unique for the life of the store). StorageError when
        `spec.request_id` is malformed, or set and a job of the same submitter (`uid`, None for the
        daemon's own user) already carries it: a submission is recorded once."""
        request_id = spec.request_id
        check_request_id(request_id, "request id", StorageError)
        with self.transaction():
            first = None if request_id is None else self.job_by_request(spec.uid, request_id)
            if first is not None:
                raise StorageError(f"request id {request_id!r} of uid {spec.uid} is already recorded as {first.id}")
            cur = self._db.execute(_INSERT_JOB, [str(JobStatus.QUEUED),
                                                 *(_column(c, getattr(spec, c)) for c in _SPEC_COLUMNS)])
            seq = cur.lastrowid
            assert seq is not None
            self._db.execute("UPDATE jobs SET id = ? WHERE seq = ?", (job_id_for(seq), seq))
            record = self.get_job(job_id_for(seq))
            assert record is not None
            return record

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._db.execute(f"{_SELECT_JOBS} WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def job_by_request(self, uid: int | None, request_id: str) -> JobRecord | None:
        """The job submitted by `uid` (None: the daemon's own user, library submissions) with
        this request id, if any; another submitter's job with the same id is not found."""
        # The same expression as the unique index's, so the lookup is an index search.
        row = self._db.execute(f"{_SELECT_JOBS} WHERE IFNULL(uid, -1) = ? AND request_id = ?",
                               (-1 if uid is None else uid, request_id)).fetchone()
        return None if row is None else _job(row)

    def list_jobs(self, states: Iterable[JobStatus] | None = None) -> list[JobRecord]:
        """Jobs in submission order, optionally only those in `states`."""
        wanted = _states(states)
        where = "" if wanted is None else f" WHERE state IN ({', '.join('?' * len(wanted))})"
        rows = self._db.execute(f"{_SELECT_JOBS}{where} ORDER BY seq", [str(s) for s in wanted or ()])
        return [_job(r) for r in rows]

    def jobs_page(self, limit: int, before: str | None = None,
                  states: Iterable[JobStatus] | None = None) -> JobPage:
        """The newest `limit` (>= 1) jobs, optionally only those in `states`, submitted before the
        job `before` (a cursor: a job id, whether or not that job exists; None: from the newest),
        in submission order, with how many matching older ones remain. A keyset on `seq`, not an
        offset: jobs submitted between two pages never shift the next one. Reads the page's jobs
        and an index, never every job (`list` on a store of 100,000 jobs)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise StorageError(f"page limit {limit!r} is invalid: accepted an integer >= 1")
        below = MAX_SEQ if before is None else seq_of(before)  # seq < below; ids never reach MAX_SEQ
        wanted = _states(states)
        with self._begin("DEFERRED"):  # one snapshot for the page and its count
            if wanted is None:
                # Backwards along the primary key from the cursor: reads the page's rows only.
                rows = self._db.execute(f"{_SELECT_JOBS} WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                                        (below, limit)).fetchall()
                jobs = [_job(r) for r in reversed(rows)]
                # How many are older, read from the (state, seq) index, not the rows: counted
                # directly near the oldest end, as all jobs (a b-tree count) less the newer ones
                # near the newest (seq is about a job's position), where `list` reads.
                remaining = 0
                if jobs:
                    oldest = jobs[0].seq
                    (total,) = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()
                    near_newest = oldest > total // 2
                    (counted,) = self._db.execute(f"SELECT COUNT(*) FROM jobs INDEXED BY jobs_by_state WHERE state "
                                                  f"IN ({_ALL_STATES}) AND seq {'>=' if near_newest else '<'} ?",
                                                  (oldest,)).fetchone()
                    remaining = total - counted if near_newest else counted
            else:
                # The page's seqs from the (state, seq) index alone, then only those rows.
                marks = ", ".join("?" * len(wanted))
                names = [str(s) for s in wanted]
                jobs = [_job(r) for r in self._db.execute(
                    f"{_SELECT_JOBS} WHERE seq IN (SELECT seq FROM jobs INDEXED BY jobs_by_state "
                    f"WHERE state IN ({marks}) AND seq < ? ORDER BY seq DESC LIMIT ?) ORDER BY seq",
                    [*names, below, limit])]
                remaining = 0
                if jobs:  # the matching older ones' index entries (no row is read)
                    (remaining,) = self._db.execute(
                        f"SELECT COUNT(*) FROM jobs INDEXED BY jobs_by_state WHERE state IN ({marks}) AND seq < ?",
                        [*names, jobs[0].seq]).fetchone()
        return JobPage(tuple(jobs), remaining)

    def update_job(self, job_id: str, **fields: Any) -> JobRecord:
        """Set columns of UPDATABLE; StorageError for an unknown job or column."""
        bad = sorted(set(fields) - UPDATABLE)
        if bad:
            raise StorageError(f"cannot update job column {bad[0]!r}; updatable: {', '.join(sorted(UPDATABLE))}")
        values = [_column(k, v) for k, v in fields.items()]
        with self.transaction():
            if fields:
                assignments = ", ".join(f"{k} = ?" for k in fields)
                self._db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", [*values, job_id])
            record = self.get_job(job_id)
            if record is None:
                raise StorageError(f"no job {job_id!r}")
            return record

    # -- events -----------------------------------------------------------------------------------

    def add_event(self, time: float, kind: str, job_id: str | None = None, /, **detail: Any) -> int:
        """Append an event (detail must be JSON-serialisable); returns its id, increasing."""
        text = json.dumps(detail)
        with self.transaction():
            cur = self._db.execute(
                "INSERT INTO events (time, job_id, kind, detail) VALUES (?, ?, ?, ?)", (time, job_id, kind, text)
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

    def events(self, job_id: str | None = None, after_id: int = 0, limit: int | None = None) -> list[EventRecord]:
        """Events with id > after_id, oldest first, of one job or all."""
        where = "" if job_id is None else " AND job_id = ?"
        args = [after_id, *([job_id] if where else []), -1 if limit is None else limit]  # LIMIT -1: no limit
        return [EventRecord(i, t, j, k, json.loads(d)) for i, t, j, k, d in self._db.execute(
            f"SELECT id, time, job_id, kind, detail FROM events WHERE id > ?{where} ORDER BY id LIMIT ?", args)]

    def newest_events(self, job_id: str, n: int) -> tuple[list[EventRecord], int]:
        """The job's newest `n` events, oldest first, and how many older ones it has (what `show`
        answers: a job can have 100,000 events, some large, and reading them all is not bounded)."""
        rows = self._db.execute("SELECT id, time, job_id, kind, detail FROM events WHERE job_id = ? "
                                "ORDER BY id DESC LIMIT ?", (job_id, max(0, n))).fetchall()
        (total,) = self._db.execute("SELECT COUNT(*) FROM events WHERE job_id = ?", (job_id,)).fetchone()
        return [EventRecord(i, t, j, k, json.loads(d)) for i, t, j, k, d in reversed(rows)], total - len(rows)

    def prune_events(self, keep: int = MAX_EVENTS) -> int:
        """Delete all but the newest `keep` events; returns how many were deleted."""
        with self.transaction():
            cur = self._db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (keep,))
            return cur.rowcount

    # -- placements and quotas --------------------------------------------------------------------

    def set_placement(self, job_id: str, gpu: int, memory_limit_bytes: int, compute_share: float) -> None:
        with self.transaction():
            if self.get_job(job_id) is None:
                raise StorageError(f"no job {job_id!r}")
            self._db.execute(
                "INSERT INTO placements (job_id, gpu, memory_limit_bytes, compute_share) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (job_id, gpu) DO UPDATE SET memory_limit_bytes = excluded.memory_limit_bytes, "
                "compute_share = excluded.compute_share",
                (job_id, gpu, memory_limit_bytes, float(compute_share)),
            )

    def placements(self, job_id: str | None = None) -> list[PlacementRecord]:
        """Ordered by job submission, then GPU."""
        where = "" if job_id is None else " WHERE p.job_id = ?"
        rows = self._db.execute("SELECT p.job_id, p.gpu, p.memory_limit_bytes, p.compute_share FROM placements p "
                                f"JOIN jobs j ON j.id = p.job_id{where} ORDER BY j.seq, p.gpu", [job_id] if where else [])
        return [PlacementRecord(*row) for row in rows]

    def clear_placements(self, job_id: str) -> None:
        with self.transaction():
            self._db.execute("DELETE FROM placements WHERE job_id = ?", (job_id,))

    def set_quota(self, tenant: str, gpu_quota: int) -> None:
        with self.transaction():
            self._db.execute(
                "INSERT INTO quotas (tenant, gpu_quota) VALUES (?, ?) "
                "ON CONFLICT (tenant) DO UPDATE SET gpu_quota = excluded.gpu_quota",
                (tenant, gpu_quota),
            )

    def quotas(self) -> dict[str, int]:
        return dict(self._db.execute("SELECT tenant, gpu_quota FROM quotas ORDER BY tenant").fetchall())

    def close(self) -> None:
        self._db.close()


class MemoryStorage(SqliteStorage):
    """Storage without a file (tests, the daemon as a library): SQLite's in-memory database, so
    the one implementation of the contract serves both."""

    def __init__(self) -> None:
        super().__init__(":memory:")


def _retry_locked(call: Callable[[], object]) -> None:
    """Run `call`, again while SQLite reports the database locked, up to the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            call()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _states(states: Iterable[JobStatus] | None) -> frozenset[JobStatus] | None:
    return None if states is None else frozenset(JobStatus(s) for s in states)


def _column(name: str, value: Any) -> Any:
    convert = _TO_COLUMN.get(name)
    return value if convert is None else convert(value)


def _job(row: tuple[Any, ...]) -> JobRecord:
    values = list(row)
    for i, decode in _DECODE_AT:
        values[i] = decode(values[i])
    return JobRecord(*values)
