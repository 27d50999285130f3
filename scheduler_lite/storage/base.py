"""What the daemon's store holds (its records) and the rules of its contract, which the methods of
`SqliteStorage` (sqlite.py, also `Storage`) state: kept in the database file the daemon and the CLI
share, or by `MemoryStorage` (tests, the library) in an in-memory database;
tests/scheduler/test_storage_contract.py runs the same suite against each.

The store is the truth about jobs: the daemon's in-memory book is rebuilt from it on start, so a
crash loses nothing that was committed. Writes are column-level (`update_job(id, **fields)`), so
the CLI setting `cancel_requested` and the daemon setting `state` never overwrite each other.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from scheduler_lite.model import JobKind, Role

SCHEMA_VERSION: Final = 6  # PRAGMA user_version of a current SQLite database
MAX_EVENTS: Final = 100_000  # events kept; older ones are pruned (prune_events) so the table stays bounded
MAX_SEQ: Final = (1 << 63) - 1  # SQLite's largest integer: a cursor past it names no job
_JOB_ID: Final = re.compile(r"job-([1-9][0-9]{0,18})")  # job_id_for's form, ASCII digits only
# A submission's request id (JobSpec.request_id): what the client generated, ASCII, short.
REQUEST_ID: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_request_id(request_id: object, label: str, error: Callable[[str], Exception]) -> None:
    """Raise `error` unless `request_id` is None or of REQUEST_ID's form. Both the submission (before
    anything is stored) and the store check it; `label` names it as each one's caller knows it."""
    if request_id is not None and (not isinstance(request_id, str) or REQUEST_ID.fullmatch(request_id) is None):
        raise error(f"{label} {str(request_id)[:70]!r} is invalid: accepted 1-64 characters among "
                    "A-Z a-z 0-9 _ . : -")


class JobStatus(enum.StrEnum):
    """Life cycle of a submitted job as stored (the policies' JobState has no 'cancelled')."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"  # exited with status 0
    FAILED = "failed"  # non-zero exit, rejected, could not start, or lost
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELLED)


class StorageError(RuntimeError):
    """A request the store refuses (unknown job, duplicate, newer schema); the message says which."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a submission asks for; the store assigns the id."""

    tenant: str
    kind: JobKind
    num_gpus: int
    command: tuple[str, ...]
    workdir: str
    submit_time: float
    env: tuple[tuple[str, str], ...] = ()
    memory_bytes: int | None = None  # declared peak per GPU; None: the whole device
    name: str = ""
    # What the job will do, when the user says (remaining-time estimate of auto jobs' delays).
    expected_steps: int | None = None
    expected_duration_s: float | None = None
    # Who submitted it, as the daemon identified the caller (SO_PEERCRED): its jobs run as it.
    # None: submitted through the library (Daemon.submit), i.e. by the daemon's own user.
    uid: int | None = None
    user: str = ""
    # The share of one GPU the job asks for (0, 1], as PAI's GPU request: opportunistic placement
    # puts it only where the requested shares fit (SchedulerConfig.opportunistic_placement).
    # None: unstated (counts as scheduler.unknown_requested_share).
    requested_share: float | None = None
    # The user declares that the command resumes from its own checkpoints when started again:
    # the daemon may stop it (SIGTERM, jobs.cancel_grace_s) and start it on other GPUs (migration).
    restartable: bool = False
    # The client's id for this submission (REQUEST_ID's form): a retried submit with the same
    # submitter and id finds the job recorded the first time instead of adding a second
    # (Storage.job_by_request). None: the submitter gave none (the library, an older client).
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    seq: int  # submission order
    tenant: str
    kind: JobKind
    num_gpus: int
    command: tuple[str, ...]
    workdir: str
    submit_time: float
    env: tuple[tuple[str, str], ...] = ()
    memory_bytes: int | None = None
    name: str = ""
    state: JobStatus = JobStatus.QUEUED
    role: Role | None = None
    placement: tuple[int, ...] = ()
    pid: int | None = None  # the job's process group leader
    pid_start: int | None = None  # its start time in clock ticks since boot: tells pid reuse apart
    job_dir: str | None = None
    started_at: float | None = None  # when its first launch was booked: the job's start for its user
    ended_at: float | None = None
    exit_code: int | None = None  # negative: killed by that signal
    reason: str | None = None
    cancel_requested: bool = False
    control_seq: int = 0  # last control.json seq written for it
    expected_steps: int | None = None
    expected_duration_s: float | None = None
    # Written before the process is started and put in its command line: a restart that finds no
    # pid recorded looks for a process carrying it ("started, pid unknown") before concluding
    # "never started".
    launch_token: str | None = None
    uid: int | None = None  # the submitter (JobSpec.uid)
    user: str = ""
    requested_share: float | None = None  # JobSpec.requested_share
    restartable: bool = False  # JobSpec.restartable
    # Being stopped to be started again on `placement` (migration): set with the new placement
    # while the old process still runs; cleared when the new launch is booked.
    migrating: bool = False
    # When the launch now running was booked: `started_at` but for a migrated job, which keeps
    # its first start (its runtime) and starts a new process. None: before schema 5 (read
    # `started_at`) or not booked.
    launched_at: float | None = None
    request_id: str | None = None  # JobSpec.request_id; None before schema 6


@dataclass(frozen=True, slots=True)
class JobPage:
    """One page of jobs (Storage.jobs_page): the newest `limit` matching jobs before the cursor."""

    jobs: tuple[JobRecord, ...]  # in submission order, oldest first (as list_jobs)
    remaining: int  # matching jobs older than jobs[0]: what the next pages hold

    @property
    def more(self) -> bool:
        return self.remaining > 0

    @property
    def next_cursor(self) -> str | None:
        """The cursor of the next (older) page: the oldest job here; None when nothing remains."""
        return self.jobs[0].id if self.jobs and self.remaining else None


# Columns update_job() may set; the others are fixed at submission.
UPDATABLE: Final = frozenset({
    "state", "role", "placement", "pid", "pid_start", "job_dir", "started_at", "ended_at",
    "exit_code", "reason", "cancel_requested", "control_seq", "launch_token", "migrating", "launched_at",
})


@dataclass(frozen=True, slots=True)
class EventRecord:
    id: int
    time: float
    job_id: str | None
    kind: str
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    """Settings in force for one job on one GPU (what the coordinator last decided)."""

    job_id: str
    gpu: int
    memory_limit_bytes: int
    compute_share: float


def job_id_for(seq: int) -> str:
    return f"job-{seq}"


def seq_of(job_id: object) -> int:
    """The seq of an id of job_id_for's form; StorageError for anything else."""
    match = _JOB_ID.fullmatch(job_id) if isinstance(job_id, str) else None
    if match is None or int(match[1]) > MAX_SEQ:
        raise StorageError(f"{str(job_id)[:60]!r} is not a job id: accepted job-N, N in [1, {MAX_SEQ}]")
    return int(match[1])

