"""The scheduler_lite daemon: the driver's loop (scheduler_lite.driver) in the real world.

Each tick, in this order (the simulator runs the same steps on its model, sim/engine.py):
  1. ingest     pick up submissions and cancel requests the CLI wrote into the store;
  2. reap       notice job exits (SIGKILL what outlived its cancel grace period);
  3. observe    read every running job's stats.json (a bad file is logged and skipped): step
                samples, peak memory, solo step time, remaining time; average the GPUs'
                utilisation over the last window and hand it to the driver;
  4. schedule   on any event (and periodically while jobs wait): `Driver.schedule`, then book
                each launch in the store (state running, launch token, no pid yet); then
                migrate: restartable opportunistic jobs held below `migration.stranded_share`
                next to a guarantee job are moved to idle GPUs (`Driver.plan_migrations`): the
                old process gets SIGTERM (SIGKILL after jobs.cancel_grace_s) and the job is started
                on its new GPUs once it has ended (step 2 of a later tick): never two copies;
  5. coordinate per GPU, when its jobs changed and every `round_interval_s`: `Driver.round`,
                then write the changed settings into the running jobs' control.json files;
  6. launch     start the booked jobs with the settings in force after step 5, record the pid.

Submission, the job environment and status live in scheduler_lite.submission, .jobenv and .status;
the CLI calls those, never the loop.

Everything that touches a job's process or files goes through the daemon's job host
(scheduler_lite.jobhost): `LocalJobHost` runs the jobs on this machine; in cluster mode
(scheduler_lite.cluster) a `ClusterJobHost` runs them on Ray nodes, with the same loop here.

Steps 3 and 5, the exchange with the running jobs (their stats read, their controls written),
are scheduler_lite.job_controls. The store (scheduler_lite.storage) is the truth: a new Daemon on
the same store takes over the jobs it records (scheduler_lite.recovery). Both work on the
daemon's job table (scheduler_lite.tick.JobTable, with a tick's report and the record of each
running job). The clock is injected: tests drive `tick(now)` themselves (scheduler_lite.testing
has the loops tests, benches and examples use); the crash tests' fault points: scheduler_lite.faults.
"""

from __future__ import annotations

import errno
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

from scheduler_lite.config import Config, file_identity
from scheduler_lite.driver import Driver, Launch, PassWorld
from scheduler_lite.faults import Faults
from scheduler_lite.isolation import INITIAL_CONTROL_SEQ
from scheduler_lite.job_controls import JobControls
from scheduler_lite.jobenv import MIN_ENV_LIMIT
from scheduler_lite.jobhost import JobHost, local_job_host
from scheduler_lite.launcher import ExitInfo, LaunchError, after_sigkill, describe_exit
from scheduler_lite.model import (
    Gpu,
    JobKind,
    JobState,
    Place,
    Reject,
    Reserve,
    Role,
    Tenant,
    Unreserve,
    Upgrade,
)
from scheduler_lite.policy.global_scheduler import schedule
from scheduler_lite.recovery import Recovery, book_job
from scheduler_lite.state_dir import LOCK_FILE
from scheduler_lite.status import ClusterStatus, build_status
from scheduler_lite.storage import MAX_EVENTS, JobRecord, JobStatus, Storage
from scheduler_lite.submission import make_job_spec, quota_warning, request_cancel, submit_once
from scheduler_lite.tick import JobTable, LiveJob, TickLog, TickReport

log = logging.getLogger("scheduler_lite")

PRUNE_EVERY_TICKS: Final = 1000  # events beyond MAX_EVENTS are deleted this often


class StateDirLostError(OSError):
    """`serve` stopped: a file of its state directory was removed or replaced (an OSError: the
    CLI prints one line naming the file and exits with status 1)."""


# ----------------------------------------------------------------------------------------------


class _PassRecords(PassWorld):
    """What the daemon does with a global pass's decisions (driver.py's table): records them in
    the store (an upgrade and a rejection by the daemon's own steps, `record_upgrade` and
    `reject`); its Places are booked after the pass's records (`Daemon._schedule`)."""

    def __init__(self, daemon: Daemon, now: float, out: TickLog) -> None:
        self.daemon = daemon
        self.now = now
        self.out = out
        self.launches: list[Launch] = []

    def place(self, launch: Launch) -> None:
        self.launches.append(launch)

    def reserve(self, decision: Reserve) -> None:
        self.daemon.storage.add_event(self.now, "reserved", decision.job_id, gpus=list(decision.gpus))

    def unreserve(self, decision: Unreserve) -> None:
        self.daemon.storage.add_event(self.now, "unreserved", decision.job_id)

    def upgrade(self, decision: Upgrade) -> None:
        self.daemon.record_upgrade(decision.job_id, self.now, self.out)

    def reject(self, decision: Reject) -> None:
        self.daemon.reject(decision.job_id, decision.reason, self.now, self.out)


class Daemon:
    """The scheduler as a library: `tick(now)` does one round; `serve()` loops until SIGTERM.

    `host`: where the jobs run (scheduler_lite.jobhost); this machine's GPUs and processes
    (`LocalJobHost`) unless given."""

    def __init__(
        self,
        config: Config,
        storage: Storage,
        clock: Callable[[], float] = time.time,
        *,
        host: JobHost | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.clock = clock
        # Each job in a cgroup where the machine allows (scheduler_lite.containment).
        self.host: JobHost = host if host is not None else local_job_host(config, storage, clock)
        self._last_schedule = -math.inf
        self._dirty = True
        self._ticks = 0
        self._stop = threading.Event()
        self._faults = Faults()
        now = clock()
        # A tenant dropped from the config while its job ran: in the book, with quota 0, until it ends.
        known = {t.name for t in config.tenants}
        dropped = dict.fromkeys(r.tenant for r in storage.list_jobs([JobStatus.RUNNING]) if r.tenant not in known)
        tenants = [*config.tenants, *(Tenant(name, 0) for name in dropped)]
        gpus = {g.id: g for g in self.host.devices.inventory()}
        driver = Driver(gpus.values(), tenants, policy=self.host.policy(schedule),  # type: ignore[arg-type]
                        scheduler_config=config.scheduler, coordinator_config=config.coordinator)
        self.jobs = JobTable(driver, gpus)
        self.controls = JobControls(config, storage, self.host, self.jobs, self._faults)
        warning = quota_warning((t.gpu_quota for t in config.tenants), len(gpus))
        if warning:
            log.warning("%s", warning)
        with storage.transaction():
            for t in config.tenants:
                storage.set_quota(t.name, t.gpu_quota)
        self.host.attach(self, self.jobs)
        self._recovery = Recovery(config, clock, storage, self.host, self.jobs, self)
        self._recovery.recover(now)

    # -- public API -------------------------------------------------------------------------------

    def submit(
        self,
        command: Sequence[str],
        *,
        tenant: str | None = None,
        gpus: int = 1,
        kind: JobKind | str = JobKind.AUTO,
        workdir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        memory_bytes: int | None = None,
        name: str = "",
        expected_steps: int | None = None,
        expected_duration_s: float | None = None,
        requested_share: float | None = None,
        restartable: bool = False,
    ) -> str:
        """Queue a job (picked up at the next tick); returns its id. SubmitError if it cannot run."""
        spec = make_job_spec(self.config, command, tenant=tenant, gpus=gpus, kind=kind, workdir=workdir,
                             env=env, memory_bytes=memory_bytes, name=name, expected_steps=expected_steps,
                             expected_duration_s=expected_duration_s, requested_share=requested_share,
                             restartable=restartable, now=self.clock())
        return submit_once(self.storage, spec)[0].id

    def cancel(self, job_id: str) -> None:
        """SIGTERM now-ish (next tick), SIGKILL after jobs.cancel_grace_s; a queued job just leaves."""
        request_cancel(self.storage, job_id, self.clock())

    def job(self, job_id: str) -> JobRecord | None:
        return self.storage.get_job(job_id)

    def job_dir(self, job_id: str) -> Path:
        return self.config.jobs_dir / job_id

    def tick(self, now: float | None = None) -> TickReport:
        now = self.clock() if now is None else now
        self.host.refresh(now)  # a cluster's nodes: reports, losses, joins
        out = TickLog(now)
        self._ingest(now, out)
        self._reap(now, out)
        self.controls.observe(now)
        waiting = self.jobs.book.pending_count() > 0
        if self._dirty or (waiting and now - self._last_schedule >= self.config.daemon.schedule_interval_s):
            self._schedule(now, out)
        self._migrate(now, out)
        self.controls.coordinate(now, out)
        self._start_booked(now, out)
        self._ticks += 1
        if self._ticks % PRUNE_EVERY_TICKS == 0:
            self.storage.prune_events(MAX_EVENTS)
        return out.freeze()

    def status(self) -> ClusterStatus:
        utilisation = {g: self.jobs.book.gpus[g].utilisation for g in self.jobs.gpus}
        phases = {g: str(m.phase) for g, m in self.jobs.driver.memos.items()}
        stats = {j: (live.stats, live.stats_error) for j, live in self.jobs.live.items()}
        status = build_status(self.config, self.storage, list(self.jobs.gpus.values()), self.clock(), stats,
                              utilisation, phases, self.jobs.book.reservations)
        absent = self.host.absent()
        return replace(status, absent_nodes=absent) if absent else status

    def serve(self, between_ticks: Callable[[float], None] | None = None) -> None:
        """Tick every daemon.tick_interval_s until SIGTERM/SIGINT (or stop()); jobs keep running.

        `between_ticks(seconds)`, if given, replaces the sleep between ticks: the socket server
        (scheduler_lite.server) answers clients on this thread then, so requests and ticks never
        run at the same time.

        Before each tick the state directory's lock file, socket and store (those there at the
        start) must still be the files this daemon started with: one removed or replaced (the
        directory deleted, another daemon started on it) leaves this daemon unreachable, and a
        second daemon would manage the same jobs. It then stops as for SIGTERM (jobs keep
        running) and raises StateDirLostError naming the file.
        """
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda signum, frame: self._stop.set())
        log.info("serving %d GPU(s) from %s", len(self.jobs.gpus), self.config.state_dir)
        # The state directory's files that make this daemon the one serving it.
        state_files = [self.config.state_dir / LOCK_FILE, self.config.socket_path, self.config.db_path]
        held = {path: found for path in state_files if (found := file_identity(path)) is not None}
        lost = None
        try:
            while not self._stop.is_set():
                lost = next((path for path, was in held.items() if file_identity(path) != was), None)
                if lost is not None:
                    log.error("%s was removed or replaced while this daemon served it: clients no longer reach "
                              "this daemon and another could start on the same store; stopping (jobs keep running)",
                              lost)
                    break
                try:
                    self.tick()
                except Exception:  # one bad tick must not take the jobs' scheduler down
                    log.exception("tick failed; continuing")
                if between_ticks is None:
                    self._stop.wait(self.config.daemon.tick_interval_s)
                else:
                    between_ticks(self.config.daemon.tick_interval_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.info("stopped; %d running job(s) left running for the next start", len(self.jobs.live))
        if lost is not None:
            raise StateDirLostError(errno.ENOENT, "the daemon's state file was removed or replaced while it served; "
                                    "it stopped, its jobs keep running", str(lost))

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- what the job host may ask (jobhost.HostedJobs) ------------------------------------------

    def lose(self, job_id: str, now: float) -> LiveJob | None:
        live = self.jobs.live.pop(job_id, None)
        self.jobs.booked = [b for b in self.jobs.booked if b.job_id != job_id]
        self.jobs.driver.finish(job_id, now, failed=True)
        self._dirty = True
        return live

    def changed(self) -> None:
        self._dirty = True

    def record_lost(self, job_id: str, now: float, reason: str, requeue: bool) -> None:
        """In the store, off its GPUs: a job without a process (a lost node's, a launch that failed
        or that a restart finds never started) back in its queue (no token: as if it never ran) or
        failed without an exit status of its own."""
        with self.storage.transaction():
            self.storage.clear_placements(job_id)
            if requeue:
                self.storage.update_job(job_id, state=JobStatus.QUEUED, role=None, placement=(), job_dir=None,
                                        started_at=None, launched_at=None, launch_token=None, pid=None,
                                        pid_start=None, control_seq=0)
                self.storage.add_event(now, "requeued", job_id, reason=reason)
            else:
                self.storage.update_job(job_id, state=JobStatus.FAILED, ended_at=now, reason=reason)
                self.storage.add_event(now, "exited", job_id, state=str(JobStatus.FAILED), exit_code=None,
                                       reason=reason)

    def adopt(self, record: JobRecord, now: float, launched_pid: int | None) -> None:
        self._recovery.readopt(record, now, launched_pid)

    def gpus_changed(self, gpus: Sequence[Gpu], now: float, size_known: bool) -> None:
        """Rebuild the driver over the host's GPUs now, keeping jobs and settings.

        The book has no GPU removal: a new one is filled with the running jobs (their settings
        kept) and the queued ones. Measured solo step times and coordinator memos start afresh;
        reservations are recomputed by the next pass. `size_known`: queued jobs that waited for
        the host's size and can never run fail now, with the reason.
        """
        old = self.jobs.driver
        new = Driver(gpus, old.book.tenants.values(), policy=old.policy, scheduler_config=old.scheduler_config,
                     coordinator_config=old.ccfg)
        ids = {g.id for g in gpus}
        for job in old.book.jobs.values():
            if job.state is JobState.RUNNING and job.role is not None and set(job.placement) <= ids:
                new.restore(job, Place(job.id, job.placement, job.role), old.settings[job.id], now)
            elif job.state is JobState.PENDING:
                new.book.submit(job)
        self.jobs.driver = new
        self.jobs.gpus = {g.id: g for g in gpus}
        self.controls.gpus_changed()
        self._dirty = True
        if not size_known:
            return
        for job in [j for j in self.jobs.book.jobs.values() if j.state is JobState.PENDING]:
            record = self.storage.get_job(job.id)
            problem = self._cannot_run(record) if record is not None else None
            if problem is not None:
                self.reject(job.id, problem, now, None)
                self.jobs.driver.finish(job.id, now, failed=True)

    # -- 1. ingest --------------------------------------------------------------------------------

    def _ingest(self, now: float, out: TickLog) -> None:
        for record in self.storage.list_jobs([JobStatus.QUEUED, JobStatus.RUNNING]):
            new = record.state is JobStatus.QUEUED and record.id not in self.jobs.book.jobs
            if new and not self.enqueue(record, now, out):
                continue
            if not record.cancel_requested:
                continue
            if record.state is JobStatus.QUEUED:
                with self.storage.transaction():
                    self.storage.update_job(record.id, state=JobStatus.CANCELLED, ended_at=now,
                                            reason="cancelled while queued")
                    self.storage.add_event(now, "cancelled", record.id, while_state="queued")
                self.jobs.driver.finish(record.id, now, failed=True)
                out.ended.append((record.id, JobStatus.CANCELLED, None))
                self._dirty = True
            else:
                live = self.jobs.live.get(record.id)
                if live is not None and live.stop_sent_at is None:
                    live.stop_sent_at = now
                    self.host.signal(live.handle, signal.SIGTERM)
                    self.storage.add_event(now, "stopping", record.id, signal="SIGTERM")

    def enqueue(self, record: JobRecord, now: float, out: TickLog | None) -> bool:
        """Into the book; False (and the job failed) when it can never run here."""
        problem = self._cannot_run(record)
        if problem is not None:
            self.reject(record.id, problem, now, out)
            return False
        self.jobs.book.submit(book_job(record, self.jobs.gpus.values()))
        self._dirty = True
        if out is not None:
            out.picked_up.append(record.id)
        return True

    def _cannot_run(self, record: JobRecord) -> str | None:
        """Why the job can never run here (the reason it fails with), or None: the host's
        reasons first; while the host's size is not known (a node away), a job too big for the
        GPUs here waits for it."""
        problem = self.host.cannot_run(record)
        if problem is not None:
            return problem
        largest = max((g.memory_bytes for g in self.jobs.gpus.values()), default=0)
        # The config, not the book: the book also holds tenants dropped from the config while a
        # job of theirs ran (quota 0, until it ends); their queued jobs must not run.
        if self.config.tenant(record.tenant) is None:
            return f"tenant {record.tenant!r} is not configured"
        if not self.host.size_known():
            return None
        if record.num_gpus > len(self.jobs.gpus):
            return f"needs {record.num_gpus} GPUs; this machine has {len(self.jobs.gpus)}"
        if record.memory_bytes is not None and not 0 < record.memory_bytes <= largest:
            return f"memory {record.memory_bytes} bytes is outside [1, {largest}] (the largest GPU)"
        return None

    def reject(self, job_id: str, reason: str, now: float, out: TickLog | None) -> None:
        """The job fails without having run: at pick-up, or when the global scheduler rejects it."""
        with self.storage.transaction():
            self.storage.update_job(job_id, state=JobStatus.FAILED, ended_at=now, reason=reason)
            self.storage.add_event(now, "rejected", job_id, reason=reason)
        if out is not None:
            out.ended.append((job_id, JobStatus.FAILED, None))

    # -- 2. reap ----------------------------------------------------------------------------------

    def _reap(self, now: float, out: TickLog) -> None:
        for job_id, live in list(self.jobs.stopping.items()):
            ended = self.host.poll(live.handle)
            if ended is not None:
                ended = after_sigkill(ended, live.killed)
                del self.jobs.stopping[job_id]
                self.host.cleanup(live.handle)  # the rest of its group: nothing of it may outlive it
                self.restart_moved(job_id, self.jobs.moves.pop(job_id), ended, now, out)
            else:
                self._kill_after_grace(job_id, live, now, why="migration")
        for job_id, live in list(self.jobs.live.items()):
            ended = self.host.poll(live.handle)
            if ended is not None:
                self._faults.at("ended")
                # An adopted job (not our child) killed by our SIGKILL has no status of its own.
                self.finish(job_id, after_sigkill(ended, live.killed), now, out)
            else:
                self._kill_after_grace(job_id, live, now)

    def _kill_after_grace(self, job_id: str, live: LiveJob, now: float, **why: str) -> None:
        """SIGKILL a job still running jobs.cancel_grace_s after its SIGTERM (cancel or migration)."""
        if (live.stop_sent_at is not None and not live.killed
                and now - live.stop_sent_at >= self.config.jobs.cancel_grace_s):
            live.killed = True
            self.host.signal(live.handle, signal.SIGKILL)
            self.storage.add_event(now, "stopping", job_id, signal="SIGKILL", **why)

    def finish(self, job_id: str, ended: ExitInfo, now: float, out: TickLog | None) -> None:
        """A running job ended: its end recorded, its GPUs and quota released; or, stopped to be
        queued again (`live.requeue`, not cancelled meanwhile), back in its queue as a lost
        node's never-run job is (`record_lost`): no placement, no token, a new launch later."""
        live = self.jobs.live.pop(job_id)
        self.host.cleanup(live.handle)
        record = self.storage.get_job(job_id) or live.record
        if live.requeue is not None and not record.cancel_requested:
            self.jobs.driver.requeue(job_id, now)
            self.record_lost(job_id, now, f"{live.requeue}; {describe_exit(ended.exit_code)}", requeue=True)
            log.info("%s requeued: %s", job_id, live.requeue)
            self._dirty = True
            return
        self.record_end(record, ended, now, None, out)

    def record_end(self, record: JobRecord, ended: ExitInfo, now: float, note: str | None,
                   out: TickLog | None = None) -> None:
        """A job's end recorded (with `note`, if any, after its exit), and, if the driver holds
        it (not one a restart found ended), its GPUs and quota released."""
        if record.cancel_requested:
            state = JobStatus.CANCELLED
        elif ended.exit_code == 0:
            state = JobStatus.FINISHED
        else:
            state = JobStatus.FAILED
        reason = describe_exit(ended.exit_code) + (f" ({note})" if note else "")
        with self.storage.transaction():
            self.storage.update_job(record.id, state=state, ended_at=end_time(record, ended, now),
                                    exit_code=ended.exit_code, reason=reason)
            self.storage.clear_placements(record.id)
            self.storage.add_event(now, "exited", record.id, state=str(state), exit_code=ended.exit_code,
                                   reason=reason)
        log.info("%s %s: %s", record.id, state, reason)
        if record.id in self.jobs.driver.settings:
            self.jobs.driver.finish(record.id, now, failed=state is not JobStatus.FINISHED)
        self._dirty = True
        if out is not None:
            out.ended.append((record.id, state, ended.exit_code))

    # -- 4. schedule ------------------------------------------------------------------------------

    def _schedule(self, now: float, out: TickLog) -> None:
        self._dirty = False
        self._last_schedule = now
        records = _PassRecords(self, now, out)
        out.decisions.extend(self.jobs.driver.run_pass(now, records))  # the simulator's decision loop too (driver.py)
        for launch in records.launches:  # booked after the pass's records
            self._book_launch(launch, now, out)

    def record_upgrade(self, job_id: str, now: float, out: TickLog) -> None:
        """An auto job became a guarantee job where it runs: record it, write its control."""
        with self.storage.transaction():
            self.storage.update_job(job_id, role=Role.GUARANTEE)
            self.storage.add_event(now, "upgraded", job_id)
        live = self.jobs.live.get(job_id)
        if live is not None:
            live.record = self.storage.get_job(job_id) or live.record
            self.controls.write_control(job_id, now, out)  # its share is 1 now

    # -- 4b. migrate ------------------------------------------------------------------------------

    def _migrate(self, now: float, out: TickLog) -> None:
        """Move stranded restartable jobs (policy/migration.py, as in the simulator): book the
        move, record it (`migrating`, new GPUs and settings), then SIGTERM the old process.

        Not on a host that cannot restart a job elsewhere (a cluster, yet: a move to another
        node would need the job's checkpoints on storage both nodes share)."""
        if not self.host.migrates:
            return
        cfg = self.config.migration
        # Not a job being stopped (a cancel) or stopped to be queued again (jobs.misbehaviour = "requeue").
        restartable = [j for j, live in self.jobs.live.items()
                       if live.record.restartable and live.stop_sent_at is None and live.requeue is None]
        low = self.jobs.driver.stranded(restartable, cfg.stranded_share) if restartable else {}
        if not low:
            return
        for move in self.jobs.driver.plan_migrations(now, low, cfg):
            live = self.jobs.live.pop(move.job_id)
            old = live.record.placement
            launch = self.jobs.driver.migrate(move, now)
            with self.storage.transaction():
                live.record = self.storage.update_job(move.job_id, placement=launch.gpus, migrating=True)
                self.storage.clear_placements(move.job_id)
                for g in launch.gpus:
                    self.storage.set_placement(move.job_id, g, launch.settings.limits[g], launch.settings.shares[g])
                self.storage.add_event(now, "migrating", move.job_id, from_gpus=list(old), to_gpus=list(launch.gpus),
                                       share=low[move.job_id])
            log.info("%s: held at share %.2f on GPU(s) %s; moving it to %s", move.job_id, low[move.job_id],
                     list(old), list(launch.gpus))
            live.stop_sent_at = now
            self.jobs.stopping[move.job_id] = live
            self.jobs.moves[move.job_id] = launch
            self.host.signal(live.handle, signal.SIGTERM)
            self.storage.add_event(now, "stopping", move.job_id, signal="SIGTERM", why="migration")
            out.migrating.append(move)
            self._dirty = True

    def restart_moved(self, job_id: str, launch: Launch, ended: ExitInfo, now: float, out: TickLog | None) -> None:
        """The old process of a migrated job has ended: book its launch on the new GPUs (started
        at step 6 like any other), unless it was cancelled meanwhile. Its exit status is not an
        end: a restartable job stopped by SIGTERM resumes from its checkpoints."""
        record = self.storage.get_job(job_id)
        assert record is not None
        if record.cancel_requested or job_id not in self.jobs.driver.settings:
            self.record_end(record, ended, now, "stopped while migrating", out)
            return
        # The old launch's pid and exit files go when the host prepares the new launch (by them a
        # restart would adopt, or end, the new one).
        self.storage.add_event(now, "migrated", job_id, exit=describe_exit(ended.exit_code), gpus=list(launch.gpus))
        self._book_launch(launch, now, out, started_at=record.started_at)

    def _book_launch(self, launch: Launch, now: float, out: TickLog | None, started_at: float | None = None) -> None:
        """Record the launch (with its token) before any process exists: a crash now requeues it.
        Whatever fails, the GPUs must not stay held: the booking is released (`_launch_failed`).

        `started_at`: kept from the first launch when a migrated job starts again (its runtime);
        `launched_at` is this launch's (how long the process now running has run)."""
        try:
            booked = self.storage.get_job(launch.job_id)
            job_dir = self.host.prepare(launch, None if booked is None else booked.uid)
            with self.storage.transaction():
                self.storage.update_job(launch.job_id, state=JobStatus.RUNNING, role=launch.role,
                                        placement=launch.gpus, job_dir=str(job_dir),
                                        started_at=now if started_at is None else started_at, launched_at=now,
                                        pid=None, pid_start=None, launch_token=uuid.uuid4().hex,
                                        control_seq=INITIAL_CONTROL_SEQ, migrating=False)
                for g in launch.gpus:
                    self.storage.set_placement(launch.job_id, g, launch.settings.limits[g], launch.settings.shares[g])
            self.jobs.booked.append(launch)
            self._faults.at("booked")
        except Exception as e:  # noqa: BLE001 - whatever it was
            what = "the launch" if started_at is None else "the migrated launch"
            self._launch_failed(launch, now, out, f"could not book {what}: {e}")

    def _launch_failed(self, launch: Launch, now: float, out: TickLog | None, reason: str) -> None:
        """Release the booking (driver and store): the job failed, its GPUs are free again."""
        log.error("%s: %s", launch.job_id, reason)
        self.lose(launch.job_id, now)
        self.record_lost(launch.job_id, now, reason, requeue=False)
        if out is not None:
            out.ended.append((launch.job_id, JobStatus.FAILED, None))

    # -- 6. launch --------------------------------------------------------------------------------

    def _start_booked(self, now: float, out: TickLog) -> None:
        booked, self.jobs.booked = self.jobs.booked, []
        for launch in booked:
            if launch.job_id not in self.jobs.driver.settings:  # released meanwhile
                continue
            try:
                record = self.storage.get_job(launch.job_id)
                assert record is not None and record.launch_token is not None and record.job_dir is not None
                job_dir = Path(record.job_dir)
                limit, share = launch.memory_limit_bytes(), launch.compute_share()
                handle = self.host.start(launch, record, job_dir, [self.jobs.gpus[g] for g in launch.gpus])
                self._faults.at("started")
                with self.storage.transaction():
                    record = self.storage.update_job(launch.job_id, pid=handle.pid, pid_start=handle.start_ticks)
                    for g in launch.gpus:
                        self.storage.set_placement(launch.job_id, g, launch.settings.limits[g],
                                                   launch.settings.shares[g])
                    self.storage.add_event(now, "launched", launch.job_id, pid=handle.pid, gpus=list(launch.gpus),
                                           role=str(launch.role), memory_limit_bytes=max(MIN_ENV_LIMIT, limit),
                                           compute_share=share)
                self.jobs.live[launch.job_id] = LiveJob(record, handle, job_dir, control_seq=record.control_seq)
                out.launched.append(launch.job_id)
            except LaunchError as e:
                self._launch_failed(launch, now, out, str(e))
            except Exception as e:  # noqa: BLE001 - between booking and launch: release the booking
                self._launch_failed(launch, now, out, f"could not start: {e!r}")


# ----------------------------------------------------------------------------------------------


def end_time(record: JobRecord, ended: ExitInfo, now: float) -> float:
    """When a job ended: as its wrapper recorded it (a job that ended while no daemon watched it),
    else `now`; never before its launch nor after `now` (a file's clock is not the daemon's)."""
    if ended.ended_at is None:
        return now
    launched = record.launched_at if record.launched_at is not None else record.started_at
    return min(now, max(ended.ended_at, -math.inf if launched is None else launched))

