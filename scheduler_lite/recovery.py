"""How a daemon starting on an existing store takes over the jobs the store says are running.

The store (scheduler_lite.storage) is the truth. A new daemon on it re-adopts running jobs (pid +
start time + launch token), requeues booked jobs that never started, keeps queued jobs queued and
finished ones as they were; a job caught in a migration (`migrating` in the store: the new GPUs
recorded, the old process perhaps still running) is stopped if it still runs and then started
on its new GPUs. tests/scheduler/test_daemon_crash.py kills a real daemon at each point of a
tick (scheduler_lite.faults) and checks that nothing is lost or run twice.

`Recovery` is a part of `daemon.Daemon` (a mixin: recovery runs once, from Daemon.__init__,
over the daemon's own state declared below). Its process and file hooks (`_find_pid`,
`_recorded_exit`, `_control_seq_on_disk`) are overridden by cluster mode, which asks the job's
node instead.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from scheduler_lite.driver import Driver, Launch, Settings
from scheduler_lite.isolation import process_uid, read_small_int
from scheduler_lite.launcher import PID_FILE, ExitInfo, Launcher, ProcessHandle, read_exit
from scheduler_lite.model import Gpu, Job, Place
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import LiveJob, TickLog
from tf_antman.protocol import ProtocolError, control_path, parse_control, read_text

if TYPE_CHECKING:
    from scheduler_lite.config import Config

log = logging.getLogger("scheduler_lite")

# A restart that finds a launch booked without a pid, pid file or process looks for one until
# this long after the booking (a child forked by a Popen the crash interrupted may exec the
# wrapper late on a loaded machine).
LAUNCH_GRACE_S: Final = 5.0


class Recovery:
    # The daemon's state these methods read and fill (set in Daemon.__init__ before _recover).
    config: Config
    clock: Callable[[], float]
    storage: Storage
    launcher: Launcher
    driver: Driver
    gpus: dict[int, Gpu]
    _live: dict[str, LiveJob]
    _stopping: dict[str, LiveJob]
    _moves: dict[str, Launch]

    # The daemon's steps recovery hands jobs to.
    def job_dir(self, job_id: str) -> Path:
        raise NotImplementedError

    def _enqueue(self, record: JobRecord, now: float, out: TickLog | None) -> bool:
        raise NotImplementedError

    def _record_end(self, record: JobRecord, ended: ExitInfo, now: float, note: str | None) -> JobStatus:
        raise NotImplementedError

    def _restart_moved(self, job_id: str, launch: Launch, ended: ExitInfo, now: float, out: TickLog | None) -> None:
        raise NotImplementedError

    # -- recovery ---------------------------------------------------------------------------------

    def _recover(self, now: float) -> None:
        running = self.storage.list_jobs([JobStatus.RUNNING])
        launched = self._find_launched([r for r in running if r.pid is None], now)
        for record in running:
            self._readopt(record, now, launched.get(record.id))
        for record in self.storage.list_jobs([JobStatus.QUEUED]):
            self._enqueue(record, now, None)

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
                pid = self._find_pid(r)
                if pid is not None:
                    found[r.id] = pid
            if len(found) == len(records) or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def _find_pid(self, record: JobRecord) -> int | None:
        """The pid of a booked job's process, from its pid file or its launch token; None if none.

        A hook: the cluster scheduler (scheduler_lite.cluster) asks the job's node instead.
        """
        job_dir = Path(record.job_dir) if record.job_dir else self.job_dir(record.id)
        pid = read_small_int(job_dir / PID_FILE)  # no link followed, no FIFO blocking
        if pid is None and record.launch_token:
            pid = self.launcher.find(record.id, record.launch_token)
        # The job's user writes the pid file: never adopt (and later signal) another's process.
        if pid is not None and process_uid(pid) in (None, os.geteuid(), record.uid):
            return pid
        return None

    def _recorded_exit(self, job_dir: Path) -> ExitInfo | None:
        """How (and when) the job ended if its wrapper recorded it (hook: on the job's node in a cluster)."""
        return read_exit(job_dir)

    def _kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> None:
        """SIGKILL what is left of a job that ended while the daemon was down, as the daemon does
        for an end it watches: its processes, told by the launcher (never by a group id alone,
        which may be another's by now). `pid`/`start`: its wrapper's, the group's id, if known.
        A hook: on the job's node in a cluster."""
        killed = self.launcher.kill_leftovers(job_dir, pid, start)
        if killed:
            log.info("%s ended while the daemon was down; killed what it left running: pid(s) %s", record.id, killed)

    def _control_seq_on_disk(self, job_id: str, job_dir: Path) -> int:
        """The seq of the job's control.json, 0 if none (hook: on the job's node in a cluster)."""
        return control_file_seq(job_dir)

    def _readopt(self, record: JobRecord, now: float, launched_pid: int | None = None) -> None:
        """A job the store says runs: its process, how it ended, or 'never started' (requeued)."""
        job_dir = Path(record.job_dir) if record.job_dir else self.job_dir(record.id)
        missing = [g for g in record.placement if g not in self.gpus]
        pid, start = record.pid, record.pid_start
        if pid is None:  # crashed between booking the launch and recording the pid
            pid, start = launched_pid, None
        if pid is None:
            ended = self._recorded_exit(job_dir)
            if ended is not None:  # ran and ended, pid file lost: not again
                self._kill_leftovers(record, job_dir, None, None)
                self._record_end(record, ended, now, "ended while the daemon was down")
                return
            # No process carries its token and it never wrote a pid: the command never ran.
            with self.storage.transaction():
                self.storage.update_job(record.id, state=JobStatus.QUEUED, role=None, placement=(), job_dir=None,
                                        started_at=None, launched_at=None, launch_token=None)
                self.storage.clear_placements(record.id)
                self.storage.add_event(now, "requeued", record.id, reason="never started")
            return
        found = self.launcher.adopt(pid, start, job_dir, record.launch_token, record.id)
        if isinstance(found, ExitInfo):  # ended unwatched: nothing of it may outlive it (migrating or not)
            self._kill_leftovers(record, job_dir, pid, start)
        if record.migrating and not missing and record.role is not None:
            self._resume_migration(record, found, now)
            return
        if isinstance(found, ExitInfo):
            self._record_end(record, found, now, "ended while the daemon was down")
            return
        if missing or record.role is None:
            # Nothing may run unmanaged: SIGTERM, SIGKILL after the grace, and its end recorded
            # once it has ended (this blocks the start-up for up to jobs.cancel_grace_s).
            log.error("job %s runs on GPU(s) %s that are no longer configured: stopping it", record.id, missing)
            self.storage.add_event(now, "stopping", record.id, signal="SIGTERM", why="GPU(s) no longer configured")
            ended = self.launcher.stop(found, self.config.jobs.cancel_grace_s)
            self.launcher.cleanup(found)
            self._record_end(record, ended, self.clock(), f"GPU(s) {missing} no longer configured")
            return
        settings = self._stored_settings(record)
        self.driver.restore(self._book_job(record), Place(record.id, record.placement, record.role), settings, now)
        seq = max(record.control_seq, self._control_seq_on_disk(record.id, job_dir))
        with self.storage.transaction():
            record = self.storage.update_job(record.id, pid=pid, pid_start=found.start_ticks)
            self.storage.add_event(now, "adopted", record.id, pid=pid, gpus=list(record.placement))
        live = LiveJob(record, found, job_dir, control_seq=seq)
        # A cancel whose SIGTERM was sent before the restart keeps its grace period; one the
        # daemon died before acting on gets its SIGTERM from _ingest (never a bare SIGKILL).
        live.stop_sent_at = self._sigterm_sent_at(record.id) if record.cancel_requested else None
        self._live[record.id] = live
        log.info("re-adopted %s (pid %d) on GPU(s) %s", record.id, pid, list(record.placement))

    def _sigterm_sent_at(self, job_id: str) -> float | None:
        """When the cancel's SIGTERM went out, if the store shows it did (after the cancel request)."""
        sent = None
        for event in self.storage.events(job_id):
            if event.kind == "cancel_requested":
                sent = None
            elif event.kind == "stopping" and event.detail.get("signal") == "SIGTERM":
                sent = event.time
        return sent

    def _stored_settings(self, record: JobRecord) -> Settings:
        placements = {p.gpu: p for p in self.storage.placements(record.id)}
        return Settings(
            {g: placements[g].memory_limit_bytes if g in placements else self.gpus[g].memory_bytes
             for g in record.placement},
            {g: placements[g].compute_share if g in placements else 1.0 for g in record.placement},
        )

    def _resume_migration(self, record: JobRecord, found: ProcessHandle | ExitInfo, now: float) -> None:
        """A restart found a job in the middle of a migration: the store holds its new GPUs and
        settings. The book gets it there; the old process, if it still runs, is stopped (again),
        and the job starts on its new GPUs once it has ended."""
        assert record.role is not None
        settings = self._stored_settings(record)
        self.driver.restore(self._book_job(record), Place(record.id, record.placement, record.role), settings, now)
        launch = Launch(record.id, record.placement, record.role, settings)
        job_dir = Path(record.job_dir) if record.job_dir else self.job_dir(record.id)
        self.storage.add_event(now, "migration_resumed", record.id, running=not isinstance(found, ExitInfo))
        if isinstance(found, ExitInfo):
            self._restart_moved(record.id, launch, found, now, None)
            return
        live = LiveJob(record, found, job_dir, control_seq=record.control_seq)
        live.stop_sent_at = now
        self.launcher.signal(found, signal.SIGTERM)
        self._stopping[record.id] = live
        self._moves[record.id] = launch
        log.info("re-adopted %s (pid %d) in the middle of a migration: stopping it", record.id, found.pid)

    def _book_job(self, record: JobRecord) -> Job:
        """The book's record of a stored job: its demand is the whole largest GPU until measured."""
        demand = record.memory_bytes
        if demand is None:
            demand = max((g.memory_bytes for g in self.gpus.values()), default=0)
        return Job(id=record.id, tenant=record.tenant, num_gpus=record.num_gpus, kind=record.kind,
                   submit_time=record.submit_time, memory_demand_bytes=demand,
                   requested_share=record.requested_share)


def control_file_seq(job_dir: Path) -> int:
    """The seq of the control.json in `job_dir`; 0 if none or unreadable (a fresh one follows)."""
    try:
        text = read_text(control_path(job_dir))
        return 0 if text is None else parse_control(text).seq
    except (ProtocolError, OSError):
        return 0
