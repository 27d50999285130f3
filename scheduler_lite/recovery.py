"""How a daemon starting on an existing store takes over the jobs the store says are running.

The store (scheduler_lite.storage) is the truth. A new daemon on it re-adopts running jobs (pid +
start time + launch token), requeues booked jobs that never started, keeps queued jobs queued and
finished ones as they were; a job caught in a migration (`migrating` in the store: the new GPUs
recorded, the old process perhaps still running) is stopped if it still runs and then started
on its new GPUs. tests/scheduler/test_daemon_crash.py kills a real daemon at each point of a
tick (scheduler_lite.faults) and checks that nothing is lost or run twice.

`Recovery` runs once, from Daemon.__init__, on the daemon's job table (scheduler_lite.tick),
through its job host (scheduler_lite.jobhost: on this machine, or asked of the job's node in a
cluster); the jobs it cannot take over go back to the daemon's steps (`RecoverySteps`).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from scheduler_lite.driver import Launch, Settings
from scheduler_lite.jobhost import JobHost
from scheduler_lite.launcher import ExitInfo, ProcessHandle
from scheduler_lite.model import Gpu, Job, Place
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import JobTable, LiveJob, TickLog

if TYPE_CHECKING:
    from scheduler_lite.config import Config

log = logging.getLogger("scheduler_lite")

# A restart that finds a launch booked without a pid, pid file or process looks for one until
# this long after the booking (a child forked by a Popen the crash interrupted may exec the
# wrapper late on a loaded machine).
LAUNCH_GRACE_S: Final = 5.0


class RecoverySteps(Protocol):
    """The daemon's steps recovery hands jobs to (the daemon, which imports this module)."""

    def enqueue(self, record: JobRecord, now: float, out: TickLog | None) -> bool: ...

    def record_end(self, record: JobRecord, ended: ExitInfo, now: float, note: str | None) -> None: ...

    def record_lost(self, job_id: str, now: float, reason: str, requeue: bool) -> None: ...

    def restart_moved(self, job_id: str, launch: Launch, ended: ExitInfo, now: float, out: TickLog | None) -> None: ...


class Recovery:
    """Takes over the jobs the store records, filling the daemon's job table."""

    def __init__(self, config: Config, clock: Callable[[], float], storage: Storage, host: JobHost,
                 table: JobTable, steps: RecoverySteps) -> None:
        self.config = config
        self.clock = clock
        self.storage = storage
        self.host = host
        self.table = table
        self.steps = steps

    # -- recovery ---------------------------------------------------------------------------------

    def recover(self, now: float) -> None:
        """Every job the store says runs taken over (except those the host holds back: their
        machines have not answered), every queued one enqueued."""
        held = self.host.recover(self.storage.list_jobs([JobStatus.RUNNING]), now)
        # Listed again: the host may have requeued or failed jobs it found lost.
        running = [r for r in self.storage.list_jobs([JobStatus.RUNNING]) if r.id not in held]
        launched = self._find_launched([r for r in running if r.pid is None], now)
        for record in running:
            self.readopt(record, now, launched.get(record.id))
        for record in self.storage.list_jobs([JobStatus.QUEUED]):
            self.steps.enqueue(record, now, None)

    def _find_launched(self, records: Sequence[JobRecord], now: float) -> dict[str, int]:
        """Pids of jobs booked but with no pid recorded (the daemon died mid-launch).

        The wrapper writes its pid file first thing; before that, the launch token in its command
        line finds it. A daemon killed inside Popen may leave a child that has forked but not yet
        exec'd the wrapper (which can take seconds on a loaded machine): until LAUNCH_GRACE_S
        after the booking, a job with neither is looked for again (all of them together).
        """
        found: dict[str, int] = {}
        booked = [r.started_at for r in records if r.launch_token and r.started_at is not None]
        wait = min(LAUNCH_GRACE_S, max((t + LAUNCH_GRACE_S - now for t in booked), default=0.0))
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            for r in records:
                if r.id in found:
                    continue
                pid = self.host.find(r, self._job_dir(r))  # pid file, else launch token
                if pid is not None:
                    found[r.id] = pid
            if len(found) == len(records) or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def _job_dir(self, record: JobRecord) -> Path:
        return Path(record.job_dir) if record.job_dir else self.config.jobs_dir / record.id

    def _kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> None:
        """SIGKILL what is left of a job that ended while the daemon was down, as the daemon does
        for an end it watches: its processes, told by the host's launcher (never by a group id
        alone, which may be another's by now). `pid`/`start`: its wrapper's, the group's id, if known."""
        killed = self.host.kill_leftovers(record, job_dir, pid, start)
        if killed:
            log.info("%s ended while the daemon was down; killed what it left running: pid(s) %s", record.id, killed)

    def readopt(self, record: JobRecord, now: float, launched_pid: int | None = None) -> None:
        """A job the store says runs: its process, how it ended, or 'never started' (requeued)."""
        job_dir = self._job_dir(record)
        missing = [g for g in record.placement if g not in self.table.gpus]
        pid, start = record.pid, record.pid_start
        if pid is None:  # crashed between booking the launch and recording the pid
            pid, start = launched_pid, None
            if pid is not None:  # it did start: the history says so, as the launch would have
                self._launched_event(record, pid)
        if pid is None:
            ended = self.host.recorded_exit(record, job_dir)
            if ended is not None:  # ran and ended, pid file lost: not again
                self._launched_event(record, None)
                self._kill_leftovers(record, job_dir, None, None)
                self._record_unwatched_end(record, ended, now)
                return
            # No process carries its token and it never wrote a pid: the command never ran.
            self.steps.record_lost(record.id, now, "never started", requeue=True)
            return
        found = self.host.adopt(record, pid, start, job_dir)
        if isinstance(found, ExitInfo):  # ended unwatched: nothing of it may outlive it (migrating or not)
            self._kill_leftovers(record, job_dir, pid, start)
        if record.migrating and not missing and record.role is not None:
            self._resume_migration(record, job_dir, found, now)
            return
        if isinstance(found, ExitInfo):
            self._record_unwatched_end(record, found, now)
            return
        if missing or record.role is None:
            # Nothing may run unmanaged: SIGTERM, SIGKILL after the grace, and its end recorded
            # once it has ended (this blocks the start-up for up to jobs.cancel_grace_s).
            log.error("job %s runs on GPU(s) %s that are no longer configured: stopping it", record.id, missing)
            self.storage.add_event(now, "stopping", record.id, signal="SIGTERM", why="GPU(s) no longer configured")
            ended = self.host.stop(found, self.config.jobs.cancel_grace_s)
            self.host.cleanup(found)
            self.steps.record_end(record, ended, self.clock(), f"GPU(s) {missing} no longer configured")
            return
        self._restore(record, now)
        seq = max(record.control_seq, self.host.control_seq(record, job_dir))
        with self.storage.transaction():
            record = self.storage.update_job(record.id, pid=pid, pid_start=found.start_ticks)
            self.storage.add_event(now, "adopted", record.id, pid=pid, gpus=list(record.placement))
        live = LiveJob(record, found, job_dir, control_seq=seq)
        # A cancel whose SIGTERM was sent before the restart keeps its grace period; one the
        # daemon died before acting on gets its SIGTERM from _ingest (never a bare SIGKILL).
        live.stop_sent_at = self._sigterm_sent_at(record.id) if record.cancel_requested else None
        self.table.live[record.id] = live
        log.info("re-adopted %s (pid %d) on GPU(s) %s", record.id, pid, list(record.placement))

    def _record_unwatched_end(self, record: JobRecord, ended: ExitInfo, started: float) -> None:
        """The end of a job no daemon watched. `started`: when this daemon began taking over;
        finding the jobs may take seconds (LAUNCH_GRACE_S), so the clock is read again: an exit
        recorded meanwhile keeps its own time (it was clamped to `started`, up to seconds early),
        and is said to have happened while the daemon was starting, not while it was down."""
        during_start = ended.ended_at is not None and ended.ended_at > started
        note = "ended while the daemon was starting" if during_start else "ended while the daemon was down"
        self.steps.record_end(record, ended, max(started, self.clock()), note)

    def _launched_event(self, record: JobRecord, pid: int | None) -> None:
        """The `launched` event a crash between the start and its recording left out (fault point
        `started`), at the launch's booked time, marked as recorded by the restart."""
        when = record.launched_at if record.launched_at is not None else record.started_at
        self.storage.add_event(self.clock() if when is None else when, "launched", record.id, pid=pid,
                               gpus=list(record.placement), role=None if record.role is None else str(record.role),
                               recorded_at_restart=True)

    def _sigterm_sent_at(self, job_id: str) -> float | None:
        """When the cancel's SIGTERM went out, if the store shows it did (after the cancel request)."""
        sent = None
        for event in self.storage.events(job_id):
            if event.kind == "cancel_requested":
                sent = None
            elif event.kind == "stopping" and event.detail.get("signal") == "SIGTERM":
                sent = event.time
        return sent

    def _restore(self, record: JobRecord, now: float) -> Settings:
        """The job back in the driver's book where the store places it, with its stored settings."""
        assert record.role is not None
        placements = {p.gpu: p for p in self.storage.placements(record.id)}
        settings = Settings(
            {g: placements[g].memory_limit_bytes if g in placements else self.table.gpus[g].memory_bytes
             for g in record.placement},
            {g: placements[g].compute_share if g in placements else 1.0 for g in record.placement},
        )
        job = book_job(record, self.table.gpus.values())
        self.table.driver.restore(job, Place(record.id, record.placement, record.role), settings, now)
        return settings

    def _resume_migration(self, record: JobRecord, job_dir: Path, found: ProcessHandle | ExitInfo, now: float) -> None:
        """A restart found a job in the middle of a migration: the store holds its new GPUs and
        settings. The book gets it there; the old process, if it still runs, is stopped (again),
        and the job starts on its new GPUs once it has ended."""
        assert record.role is not None
        launch = Launch(record.id, record.placement, record.role, self._restore(record, now))
        self.storage.add_event(now, "migration_resumed", record.id, running=not isinstance(found, ExitInfo))
        if isinstance(found, ExitInfo):
            self.steps.restart_moved(record.id, launch, found, now, None)
            return
        live = LiveJob(record, found, job_dir, control_seq=record.control_seq)
        live.stop_sent_at = now
        self.host.signal(found, signal.SIGTERM)
        self.table.stopping[record.id] = live
        self.table.moves[record.id] = launch
        log.info("re-adopted %s (pid %d) in the middle of a migration: stopping it", record.id, found.pid)


def book_job(record: JobRecord, gpus: Iterable[Gpu]) -> Job:
    """The book's record of a stored job: its demand is the whole largest GPU until measured."""
    demand = record.memory_bytes
    if demand is None:
        demand = max((g.memory_bytes for g in gpus), default=0)
    return Job(id=record.id, tenant=record.tenant, num_gpus=record.num_gpus, kind=record.kind,
               submit_time=record.submit_time, memory_demand_bytes=demand, requested_share=record.requested_share)
