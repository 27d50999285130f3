"""The scheduler_lite daemon: one loop, `tick(now)`, around the pure policies (paper §3.2-3.3).

Each tick, in this order (like the staged round of the paper's figure):
  1. ingest   pick up submissions and cancel requests the CLI wrote into the store;
  2. reap     notice job exits (SIGKILL what outlived its cancel grace period);
  3. observe  read every running job's stats.json (a bad file is logged and skipped), turn new
              steps into step samples, average the GPUs' utilisation over the last window;
  4. schedule on any event (and periodically while jobs wait): `global_scheduler.schedule`, apply
              the decisions to the book, launch what was placed;
  5. coordinate per GPU, when its jobs changed and every `round_interval_s`: `coordinator.round`,
              then write the changed settings into the jobs' control.json files.

The store (scheduler_lite.storage) is the truth: a new Daemon on the same store re-adopts running
jobs (pid + start time + job directory), keeps queued jobs queued and finished ones as they were.
The clock is injected: tests and the simulator-like demo drive `tick(now)` themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from scheduler_lite.config import Config
from scheduler_lite.devices import DeviceBackend, JobLoad, job_load, open_devices
from scheduler_lite.launcher import (
    PID_FILE,
    ExitInfo,
    Launcher,
    LaunchError,
    LaunchSpec,
    ProcessHandle,
    describe_exit,
)
from scheduler_lite.model import (
    Decision,
    Downgrade,
    Gpu,
    GpuView,
    Job,
    JobKind,
    LocalJob,
    Pause,
    Place,
    Reject,
    Reserve,
    Resume,
    Role,
    SetComputeShare,
    SetMemoryLimit,
    StepSample,
    Tenant,
    Unreserve,
    Upgrade,
)
from scheduler_lite.policy import coordinator
from scheduler_lite.policy.book import ClusterBook
from scheduler_lite.policy.coordinator import CoordinatorMemo
from scheduler_lite.policy.global_scheduler import schedule
from scheduler_lite.storage import JobRecord, JobSpec, JobStatus, Storage
from tf_antman.config import VARIABLES as ANTMAN_VARIABLES
from tf_antman.protocol import (
    CONTROL_FILE,
    STATS_FILE,
    Control,
    DeviceStats,
    MemoryLimit,
    ProtocolError,
    Stats,
    control_path,
    parse_control,
    read_stats,
    read_text,
    write_control,
)

log = logging.getLogger("scheduler_lite")

MIB: Final = 1 << 20
MIN_ENV_LIMIT: Final = MIB  # ANTMAN_MEMORY_LIMIT's lower bound
STEP_HISTORY: Final = 256  # step samples kept per job: several detector windows
LOCK_FILE: Final = "daemon.lock"
# ANTMAN_* variables a submission may set; the others are the scheduler's to set.
USER_ANTMAN_VARIABLES: Final = frozenset({"ANTMAN_ENABLE", "ANTMAN_HOST_MEMORY", "ANTMAN_STATS_INTERVAL_MS"})
RESERVED_ENV: Final = frozenset({"CUDA_VISIBLE_DEVICES"})
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SubmitError(ValueError):
    """A submission that is refused; the message is one line naming what to fix."""


class DaemonLockedError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------
# Typed results.


@dataclass(frozen=True, slots=True)
class JobOnGpu:
    job_id: str
    tenant: str
    role: Role
    memory_limit_bytes: int
    compute_share: float
    in_use_bytes: int | None = None  # None: no stats yet
    host_in_use_bytes: int | None = None  # kept in host memory past the limit
    host_fallbacks: int | None = None
    step: int | None = None
    last_step_ms: float | None = None
    step_ms_median: float | None = None
    achieved_share: float | None = None
    stats_error: str | None = None  # why the last stats.json was refused


@dataclass(frozen=True, slots=True)
class GpuStatus:
    id: int
    memory_bytes: int
    nvlink_group: str
    utilisation: float | None  # averaged over daemon.utilisation_window_s; None outside the daemon
    jobs: tuple[JobOnGpu, ...]
    reserved_for: str | None = None
    coordinator_phase: str | None = None

    def job(self, job_id: str) -> JobOnGpu | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)


@dataclass(frozen=True, slots=True)
class TenantStatus:
    name: str
    gpu_quota: int
    quota_used: int  # GPUs of its running guarantee jobs
    running: int
    queued: int


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    time: float
    gpus: tuple[GpuStatus, ...]
    tenants: tuple[TenantStatus, ...]
    queued: tuple[str, ...]
    running: tuple[str, ...]

    def gpu(self, gpu_id: int) -> GpuStatus:
        return next(g for g in self.gpus if g.id == gpu_id)


@dataclass(frozen=True, slots=True)
class ControlWrite:
    job_id: str
    control: Control


@dataclass(frozen=True, slots=True)
class TickReport:
    now: float
    picked_up: tuple[str, ...] = ()
    launched: tuple[str, ...] = ()
    ended: tuple[tuple[str, JobStatus, int | None], ...] = ()
    decisions: tuple[Decision, ...] = ()
    controls: tuple[ControlWrite, ...] = ()


@dataclass
class _TickLog:
    now: float
    picked_up: list[str] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)
    ended: list[tuple[str, JobStatus, int | None]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    controls: list[ControlWrite] = field(default_factory=list)

    def freeze(self) -> TickReport:
        return TickReport(self.now, tuple(self.picked_up), tuple(self.launched), tuple(self.ended),
                          tuple(self.decisions), tuple(self.controls))


@dataclass
class _Live:
    """What the daemon tracks of one running job."""

    record: JobRecord
    handle: ProcessHandle
    job_dir: Path
    limits: dict[int, int]  # per GPU, in force as far as the coordinator knows
    shares: dict[int, float]
    paused: bool = False
    control_seq: int = 0
    stats: Stats | None = None
    stats_error: str | None = None
    last_step: int | None = None
    last_progress_at: float = -math.inf
    samples: deque[StepSample] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    stop_sent_at: float | None = None
    killed: bool = False


# ----------------------------------------------------------------------------------------------
# Submissions (shared by Daemon.submit and the CLI, which writes into the store without a daemon).


def make_job_spec(
    config: Config,
    command: Sequence[str],
    *,
    tenant: str | None = None,
    gpus: int = 1,
    kind: JobKind | str = JobKind.AUTO,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    memory_bytes: int | None = None,
    name: str = "",
    now: float | None = None,
) -> JobSpec:
    """Validate a submission against the config; SubmitError (one line) when it cannot run here."""
    if not command or not all(isinstance(c, str) and c for c in command):
        raise SubmitError("the command is empty: give it after '--', e.g. submit -- python train.py")
    if tenant is None:
        if len(config.tenants) != 1:
            raise SubmitError("--tenant is required; tenants: " + ", ".join(t.name for t in config.tenants))
        tenant = config.tenants[0].name
    found = config.tenant(tenant)
    if found is None:
        raise SubmitError(f"unknown tenant {tenant!r}; tenants: " + ", ".join(t.name for t in config.tenants))
    try:
        job_kind = JobKind(kind)
    except ValueError:
        raise SubmitError(f"--type {kind!r} is invalid: accepted " + ", ".join(k.value for k in JobKind)) from None
    device_count = len(config.devices.emulated) if config.devices.kind == "emulated" else None
    limit = device_count or 1024
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= limit:
        raise SubmitError(f"--gpus {gpus!r} is invalid: accepted an integer in [1, {limit}]")
    if job_kind is JobKind.GUARANTEE and gpus > found.gpu_quota:
        raise SubmitError(f"a guarantee job of {gpus} GPU(s) can never run: tenant {tenant!r} has a quota "
                          f"of {found.gpu_quota}; use --type opportunistic or auto")
    path = Path(workdir) if workdir is not None else Path.cwd()
    if not path.is_dir():
        raise SubmitError(f"--workdir {str(path)!r} is not a directory")
    pairs = list(env.items()) if isinstance(env, Mapping) else list(env or ())
    for key, _ in pairs:
        if not _ENV_NAME.match(key):
            raise SubmitError(f"--env {key!r}: not a variable name (letters, digits, '_')")
        owned = key in RESERVED_ENV or key.startswith("SCHEDULER_LITE_") or (
            key.startswith("ANTMAN_") and key not in USER_ANTMAN_VARIABLES
        )
        if owned:
            allowed = ", ".join(sorted(USER_ANTMAN_VARIABLES))
            raise SubmitError(f"--env {key}: set by the scheduler for each placement; a job may set {allowed}")
        if key.startswith("ANTMAN_") and key not in {v.name for v in ANTMAN_VARIABLES}:
            raise SubmitError(f"--env {key}: not a tf-antman variable (docs/configuration.md)")
    if memory_bytes is not None and (isinstance(memory_bytes, bool) or memory_bytes < 0):
        raise SubmitError(f"--memory {memory_bytes!r} is invalid: accepted a size >= 0")
    return JobSpec(
        tenant=tenant, kind=job_kind, num_gpus=gpus, command=tuple(command), workdir=str(path.resolve()),
        submit_time=time.time() if now is None else now, env=tuple(pairs), memory_bytes=memory_bytes, name=name,
    )


def submit_job(storage: Storage, spec: JobSpec) -> JobRecord:
    with storage.transaction():
        record = storage.add_job(spec)
        storage.add_event(spec.submit_time, "submitted", record.id, tenant=spec.tenant, kind=str(spec.kind),
                          gpus=spec.num_gpus, command=list(spec.command))
    return record


def request_cancel(storage: Storage, job_id: str, now: float) -> JobRecord:
    """Mark a job for cancellation (the daemon acts on it); a finished job is returned unchanged."""
    record = storage.get_job(job_id)
    if record is None:
        raise SubmitError(f"no job {job_id!r}")
    if record.state.done or record.cancel_requested:
        return record
    with storage.transaction():
        record = storage.update_job(job_id, cancel_requested=True)
        storage.add_event(now, "cancel_requested", job_id)
    return record


# ----------------------------------------------------------------------------------------------
# Environment of a job.


def job_environment(
    config: Config,
    record: JobRecord,
    gpus: Sequence[Gpu],
    memory_limit_bytes: int,
    compute_share: float,
    job_dir: Path,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of a job placed on `gpus` (docs/scheduler.md, "Job environment")."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("ANTMAN_") and k not in RESERVED_ENV and not k.startswith("SCHEDULER_LITE_")}
    env.update(dict(record.env))
    first = gpus[0]
    env.update({
        "ANTMAN_JOB_DIR": str(job_dir),
        "ANTMAN_COMPUTE_SHARE": repr(float(compute_share)),
        "ANTMAN_DEVICE_MEMORY": str(first.memory_bytes),
        "ANTMAN_MEMORY_LIMIT": str(max(MIN_ENV_LIMIT, min(memory_limit_bytes, first.memory_bytes))),
        "SCHEDULER_LITE_JOB_ID": record.id,
        "SCHEDULER_LITE_GPUS": ",".join(str(g.id) for g in gpus),
    })
    env.setdefault("ANTMAN_HOST_MEMORY", str(config.jobs.host_memory_bytes))
    if config.devices.kind == "nvml":
        # The job sees only its GPUs, renumbered from 0. (Not tested here: no GPU on this machine.)
        env["ANTMAN_DEVICE"] = "cuda"
        env["ANTMAN_DEVICE_ID"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.id) for g in gpus)
    else:
        env["ANTMAN_DEVICE"] = "emulated"
        env["ANTMAN_DEVICE_ID"] = str(first.id)
    return env


# ----------------------------------------------------------------------------------------------


class Daemon:
    """The scheduler as a library: `tick(now)` does one round; `serve()` loops until SIGTERM."""

    def __init__(
        self,
        config: Config,
        storage: Storage,
        clock: Callable[[], float] = time.time,
        *,
        devices: DeviceBackend | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.clock = clock
        self.devices = devices if devices is not None else open_devices(config.devices)
        self.launcher = launcher if launcher is not None else Launcher()
        self.gpus: dict[int, Gpu] = {g.id: g for g in self.devices.inventory()}
        self._live: dict[str, _Live] = {}
        self._memos: dict[int, CoordinatorMemo] = {}
        self._round_sig: dict[int, tuple[tuple[str, Role], ...]] = {}
        self._last_round: dict[int, float] = {}
        self._util_samples: dict[int, deque[tuple[float, float]]] = {g: deque() for g in self.gpus}
        self._last_schedule = -math.inf
        self._dirty = True
        self._stop = threading.Event()
        now = clock()
        tenants = list(config.tenants)
        known = {t.name for t in tenants}
        for record in storage.list_jobs([JobStatus.RUNNING]):
            if record.tenant not in known:  # dropped from the config while its job ran
                tenants.append(Tenant(record.tenant, 0))
                known.add(record.tenant)
        self.book = ClusterBook(self.gpus.values(), tenants)
        with storage.transaction():
            for t in config.tenants:
                storage.set_quota(t.name, t.gpu_quota)
        self._recover(now)

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
    ) -> str:
        """Queue a job (picked up at the next tick); returns its id. SubmitError if it cannot run."""
        spec = make_job_spec(self.config, command, tenant=tenant, gpus=gpus, kind=kind, workdir=workdir,
                             env=env, memory_bytes=memory_bytes, name=name, now=self.clock())
        return submit_job(self.storage, spec).id

    def cancel(self, job_id: str) -> None:
        """SIGTERM now-ish (next tick), SIGKILL after jobs.cancel_grace_s; a queued job just leaves."""
        request_cancel(self.storage, job_id, self.clock())

    def job(self, job_id: str) -> JobRecord | None:
        return self.storage.get_job(job_id)

    def job_dir(self, job_id: str) -> Path:
        return self.config.jobs_dir / job_id

    def tick(self, now: float | None = None) -> TickReport:
        now = self.clock() if now is None else now
        out = _TickLog(now)
        self._ingest(now, out)
        self._reap(now, out)
        self._observe(now)
        waiting = self.book.pending_count() > 0
        if self._dirty or (waiting and now - self._last_schedule >= self.config.daemon.schedule_interval_s):
            self._schedule(now, out)
        self._coordinate(now, out)
        return out.freeze()

    def status(self) -> ClusterStatus:
        utilisation = {g: self.book.gpus[g].utilisation for g in self.gpus}
        phases = {g: str(m.phase) for g, m in self._memos.items()}
        stats = {j: (live.stats, live.stats_error) for j, live in self._live.items()}
        return build_status(self.config, self.storage, list(self.gpus.values()), self.clock(), stats,
                            utilisation, phases, self.book.reservations)

    def run_until(self, predicate: Callable[[Daemon], bool], timeout: float,
                  interval: float | None = None) -> bool:
        """tick() until predicate(self) holds (True) or `timeout` real seconds pass (False)."""
        deadline = time.monotonic() + timeout
        pause = self.config.daemon.tick_interval_s if interval is None else interval
        while True:
            self.tick()
            if predicate(self):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)

    def serve(self) -> None:
        """Tick every daemon.tick_interval_s until SIGTERM/SIGINT (or stop()); jobs keep running."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda signum, frame: self._stop.set())
        log.info("serving %d GPU(s) from %s", len(self.gpus), self.config.state_dir)
        try:
            while not self._stop.is_set():
                try:
                    self.tick()
                except Exception:  # one bad tick must not take the jobs' scheduler down
                    log.exception("tick failed; continuing")
                self._stop.wait(self.config.daemon.tick_interval_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.info("stopped; %d running job(s) left running for the next start", len(self._live))

    def stop(self) -> None:
        self._stop.set()

    def stop_all_jobs(self, grace_s: float | None = None) -> None:
        """Stop every running job now (blocking) and record it: for tests and demos, not shutdown."""
        grace = self.config.jobs.cancel_grace_s if grace_s is None else grace_s
        for job_id in list(self._live):
            with contextlib.suppress(Exception):
                self.storage.update_job(job_id, cancel_requested=True)
            ended = self.launcher.stop(self._live[job_id].handle, grace)
            self._finish(job_id, ended, self.clock(), None)

    # -- recovery ---------------------------------------------------------------------------------

    def _recover(self, now: float) -> None:
        for record in self.storage.list_jobs([JobStatus.RUNNING]):
            self._readopt(record, now)
        for record in self.storage.list_jobs([JobStatus.QUEUED]):
            self._enqueue(record, now, None)

    def _readopt(self, record: JobRecord, now: float) -> None:
        job_dir = Path(record.job_dir) if record.job_dir else self.job_dir(record.id)
        missing = [g for g in record.placement if g not in self.gpus]
        pid, start = record.pid, record.pid_start
        if pid is None:  # crashed between the launch record and the pid record: the wrapper wrote it
            with contextlib.suppress(OSError, ValueError):
                pid = int((job_dir / PID_FILE).read_text().strip())
        if pid is None:
            # It was never started: back to the queue.
            with self.storage.transaction():
                self.storage.update_job(record.id, state=JobStatus.QUEUED, role=None, placement=(), job_dir=None,
                                        started_at=None)
                self.storage.clear_placements(record.id)
                self.storage.add_event(now, "requeued", record.id, reason="never started")
            return
        found = self.launcher.adopt(pid, start, job_dir)
        if isinstance(found, ExitInfo):
            self._record_end(record, found, now, "ended while the daemon was down")
            return
        if missing or record.role is None:
            log.error("job %s runs on GPU(s) %s that are no longer configured: stopping it", record.id, missing)
            self.launcher.signal(found, signal.SIGTERM)
            self._record_end(record, ExitInfo(None), now, f"GPU(s) {missing} no longer configured")
            return
        self.book.submit(self._book_job(record))
        self.book.apply(Place(record.id, record.placement, record.role))
        placements = {p.gpu: p for p in self.storage.placements(record.id)}
        limits = {g: placements[g].memory_limit_bytes if g in placements else self.gpus[g].memory_bytes
                  for g in record.placement}
        shares = {g: placements[g].compute_share if g in placements else 1.0 for g in record.placement}
        seq = max(record.control_seq, _control_file_seq(job_dir))
        live = _Live(record, found, job_dir, limits, shares, control_seq=seq)
        live.stop_sent_at = now if record.cancel_requested else None
        self._live[record.id] = live
        self.storage.add_event(now, "adopted", record.id, pid=pid, gpus=list(record.placement))
        log.info("re-adopted %s (pid %d) on GPU(s) %s", record.id, pid, list(record.placement))

    def _book_job(self, record: JobRecord) -> Job:
        demand = record.memory_bytes
        if demand is None:
            demand = max((g.memory_bytes for g in self.gpus.values()), default=0)
        return Job(id=record.id, tenant=record.tenant, num_gpus=record.num_gpus, kind=record.kind,
                   submit_time=record.submit_time, memory_demand_bytes=demand)

    # -- 1. ingest --------------------------------------------------------------------------------

    def _ingest(self, now: float, out: _TickLog) -> None:
        for record in self.storage.list_jobs([JobStatus.QUEUED, JobStatus.RUNNING]):
            new = record.state is JobStatus.QUEUED and record.id not in self.book.jobs
            if new and not self._enqueue(record, now, out):
                continue
            if not record.cancel_requested:
                continue
            if record.state is JobStatus.QUEUED:
                with self.storage.transaction():
                    self.storage.update_job(record.id, state=JobStatus.CANCELLED, ended_at=now,
                                            reason="cancelled while queued")
                    self.storage.add_event(now, "cancelled", record.id, while_state="queued")
                self.book.finish(record.id, failed=True)
                out.ended.append((record.id, JobStatus.CANCELLED, None))
                self._dirty = True
            else:
                live = self._live.get(record.id)
                if live is not None and live.stop_sent_at is None:
                    live.stop_sent_at = now
                    self.launcher.signal(live.handle, signal.SIGTERM)
                    self.storage.add_event(now, "stopping", record.id, signal="SIGTERM")

    def _enqueue(self, record: JobRecord, now: float, out: _TickLog | None) -> bool:
        """Into the book; False (and the job failed) when it can never run here."""
        problem = None
        if record.tenant not in self.book.tenants:
            problem = f"tenant {record.tenant!r} is not configured"
        elif record.num_gpus > len(self.gpus):
            problem = f"needs {record.num_gpus} GPUs; this machine has {len(self.gpus)}"
        if problem is not None:
            with self.storage.transaction():
                self.storage.update_job(record.id, state=JobStatus.FAILED, ended_at=now, reason=problem)
                self.storage.add_event(now, "rejected", record.id, reason=problem)
            if out is not None:
                out.ended.append((record.id, JobStatus.FAILED, None))
            return False
        self.book.submit(self._book_job(record))
        self._dirty = True
        if out is not None:
            out.picked_up.append(record.id)
        return True

    # -- 2. reap ----------------------------------------------------------------------------------

    def _reap(self, now: float, out: _TickLog) -> None:
        for job_id, live in list(self._live.items()):
            ended = self.launcher.poll(live.handle)
            if ended is not None:
                self._finish(job_id, ended, now, out)
            elif (live.stop_sent_at is not None and not live.killed
                  and now - live.stop_sent_at >= self.config.jobs.cancel_grace_s):
                live.killed = True
                self.launcher.signal(live.handle, signal.SIGKILL)
                self.storage.add_event(now, "stopping", job_id, signal="SIGKILL")

    def _finish(self, job_id: str, ended: ExitInfo, now: float, out: _TickLog | None) -> None:
        live = self._live.pop(job_id)
        self.launcher.cleanup(live.handle)
        record = self.storage.get_job(job_id) or live.record
        state = self._record_end(record, ended, now, None)
        self.book.finish(job_id, failed=state is not JobStatus.FINISHED)
        self._dirty = True
        if out is not None:
            out.ended.append((job_id, state, ended.exit_code))

    def _record_end(self, record: JobRecord, ended: ExitInfo, now: float, note: str | None) -> JobStatus:
        if record.cancel_requested:
            state = JobStatus.CANCELLED
        elif ended.exit_code == 0:
            state = JobStatus.FINISHED
        else:
            state = JobStatus.FAILED
        reason = describe_exit(ended.exit_code) + (f" ({note})" if note else "")
        with self.storage.transaction():
            self.storage.update_job(record.id, state=state, ended_at=now, exit_code=ended.exit_code, reason=reason)
            self.storage.clear_placements(record.id)
            self.storage.add_event(now, "exited", record.id, state=str(state), exit_code=ended.exit_code,
                                   reason=reason)
        log.info("%s %s: %s", record.id, state, reason)
        return state

    # -- 3. observe -------------------------------------------------------------------------------

    def _observe(self, now: float) -> None:
        window = self.config.daemon.utilisation_window_s
        loads: dict[int, list[JobLoad]] = {g: [] for g in self.gpus}
        for job_id, live in self._live.items():
            self._read_stats(job_id, live, now)
            stepping = now - live.last_progress_at <= window
            for gpu in live.record.placement:
                loads[gpu].append(job_load(live.stats, stepping))
            if live.stats is not None and live.stats.step_ms_median is not None:
                self.book.update_hints(job_id, mean_step_time_s=live.stats.step_ms_median / 1000.0)
        readings = self.devices.utilisation(loads)
        for gpu, samples in self._util_samples.items():
            samples.append((now, readings.get(gpu, 0.0)))
            while samples and samples[0][0] < now - window:
                samples.popleft()
            average = statistics.fmean(u for _, u in samples)
            self.book.set_utilisation(gpu, round(average, 6))

    def _read_stats(self, job_id: str, live: _Live, now: float) -> None:
        try:
            stats = read_stats(live.job_dir)
        except (ProtocolError, OSError) as e:
            message = str(e)
            if message != live.stats_error:  # once per distinct problem, not every tick
                log.warning("%s: stats.json refused, keeping the last good one: %s", job_id, message)
                self.storage.add_event(now, "stats_error", job_id, error=message)
            live.stats_error = message
            return
        live.stats_error = None
        if stats is None or (live.stats is not None and stats.seq == live.stats.seq):
            return
        new = stats.step - live.last_step if live.last_step is not None else min(stats.step, len(stats.step_ms_window))
        if new > 0 and stats.step_ms_window:
            # The daemon's clock, not the job's: samples are compared with the coordinator's `now`.
            # Steps first seen now ended by now: a decision taken at this tick excludes them.
            for ms in stats.step_ms_window[-min(new, len(stats.step_ms_window)):]:
                live.samples.append(StepSample(now, ms / 1000.0))
            live.last_progress_at = now
        live.last_step = stats.step
        live.stats = stats

    # -- 4. schedule ------------------------------------------------------------------------------

    def _schedule(self, now: float, out: _TickLog) -> None:
        self._dirty = False
        self._last_schedule = now
        decisions = schedule(self.book.snapshot(now), self.config.scheduler)
        for d in decisions:
            out.decisions.append(d)
            self.book.apply(d)
            match d:
                case Place():
                    self._launch(d, now, out)
                case Reserve():
                    self.storage.add_event(now, "reserved", d.job_id, gpus=list(d.gpus))
                case Unreserve():
                    self.storage.add_event(now, "unreserved", d.job_id)
                case Upgrade() | Downgrade():
                    role = Role.GUARANTEE if isinstance(d, Upgrade) else Role.OPPORTUNISTIC
                    with self.storage.transaction():
                        self.storage.update_job(d.job_id, role=role)
                        self.storage.add_event(now, "upgraded" if role is Role.GUARANTEE else "downgraded", d.job_id)
                    if d.job_id in self._live:
                        self._live[d.job_id].record = self.storage.get_job(d.job_id) or self._live[d.job_id].record
                case Reject():
                    with self.storage.transaction():
                        self.storage.update_job(d.job_id, state=JobStatus.FAILED, ended_at=now, reason=d.reason)
                        self.storage.add_event(now, "rejected", d.job_id, reason=d.reason)
                    out.ended.append((d.job_id, JobStatus.FAILED, None))
                case _:
                    # global_scheduler.schedule never preempts or unplaces (the baselines do).
                    log.error("decision %r is not supported by the daemon; ignored", d)

    def _launch(self, d: Place, now: float, out: _TickLog) -> None:
        record = self.storage.get_job(d.job_id)
        assert record is not None
        gpus = [self.gpus[g] for g in d.gpus]
        demand = self.book.jobs[d.job_id].memory_demand_bytes
        limits = {}
        for g in gpus:
            if d.role is Role.GUARANTEE:
                # What the coordinator's arrival step gives it at this tick: all but the minimum
                # of each opportunistic job, so it does not start in host memory.
                opps = sum(1 for j in self.book.jobs_on(g.id) if j != d.job_id)
                room = g.memory_bytes - opps * self.config.coordinator.min_memory_bytes
            else:
                room = g.memory_bytes - sum(live.limits.get(g.id, 0) for live in self._live.values())
            limits[g.id] = max(0, min(demand, room))
        shares = dict.fromkeys(d.gpus, 1.0)
        job_dir = self.job_dir(d.job_id)
        job_dir.mkdir(parents=True, exist_ok=True)
        for stale in (STATS_FILE, CONTROL_FILE):
            with contextlib.suppress(FileNotFoundError):
                (job_dir / stale).unlink()
        env = job_environment(self.config, record, gpus, min(limits.values()), 1.0, job_dir)
        with self.storage.transaction():
            record = self.storage.update_job(d.job_id, state=JobStatus.RUNNING, role=d.role, placement=d.gpus,
                                             job_dir=str(job_dir), started_at=now, pid=None, pid_start=None)
            for g in d.gpus:
                self.storage.set_placement(d.job_id, g, limits[g], shares[g])
        try:
            handle = self.launcher.start(LaunchSpec(d.job_id, record.command, Path(record.workdir),
                                                    env, job_dir))
        except LaunchError as e:
            self._record_end(record, ExitInfo(None), now, str(e))
            self.book.finish(d.job_id, failed=True)
            out.ended.append((d.job_id, JobStatus.FAILED, None))
            return
        with self.storage.transaction():
            record = self.storage.update_job(d.job_id, pid=handle.pid, pid_start=handle.start_ticks)
            self.storage.add_event(now, "launched", d.job_id, pid=handle.pid, gpus=list(d.gpus), role=str(d.role),
                                   memory_limit_bytes=min(limits.values()))
        self._live[d.job_id] = _Live(record, handle, job_dir, limits, shares)
        out.launched.append(d.job_id)

    # -- 5. coordinate ----------------------------------------------------------------------------

    def _coordinate(self, now: float, out: _TickLog) -> None:
        interval = self.config.coordinator.round_interval_s
        for gpu in self.gpus:
            ids = self.book.jobs_on(gpu)
            sig = tuple((j, self.book.jobs[j].role or Role.OPPORTUNISTIC) for j in ids)
            memo = self._memos.get(gpu, CoordinatorMemo())
            changed = sig != self._round_sig.get(gpu)
            due = bool(ids) and (
                now - self._last_round.get(gpu, -math.inf) >= interval
                or (memo.next_round_at is not None and now >= memo.next_round_at)
            )
            if not (changed or due):
                continue
            view = GpuView(self.book.gpus[gpu], tuple(self._local_job(j, gpu) for j in ids))
            decisions, memo = coordinator.round(now, view, self.config.coordinator, memo)
            self._memos[gpu] = memo
            self._round_sig[gpu] = sig
            self._last_round[gpu] = now
            touched: dict[str, None] = {}
            for d in decisions:
                live = self._live.get(d.job_id)
                if live is None:
                    continue
                match d:
                    case SetMemoryLimit():
                        live.limits[d.gpu] = d.limit_bytes
                        self.storage.add_event(now, "memory_limit", d.job_id, gpu=d.gpu, limit_bytes=d.limit_bytes,
                                               previous_bytes=d.previous_bytes)
                    case SetComputeShare():
                        live.shares[d.gpu] = d.share
                        self.storage.add_event(now, "compute_share", d.job_id, gpu=d.gpu, share=d.share,
                                               previous=d.previous)
                    case Pause() | Resume():
                        live.paused = isinstance(d, Pause)
                out.decisions.append(d)
                touched[d.job_id] = None
            for job_id in touched:  # in decision order: shrinks before grows
                self._write_control(job_id, now, out)

    def _local_job(self, job_id: str, gpu: int) -> LocalJob:
        live = self._live.get(job_id)
        job = self.book.jobs[job_id]
        role = job.role or Role.OPPORTUNISTIC
        if live is None:  # placed but not started (launch failed this tick)
            return LocalJob(job_id, role, job.memory_demand_bytes, 0, 0, 1.0)
        demand = job.memory_demand_bytes
        spill = 0
        device = _device_stats(live, gpu)
        if device is not None:
            spill = device.host_in_use_bytes
            demand = max(demand, device.in_use_bytes + device.host_in_use_bytes)
        return LocalJob(job_id, role, demand, live.limits.get(gpu, 0), spill, live.shares.get(gpu, 1.0),
                        tuple(live.samples))

    def _write_control(self, job_id: str, now: float, out: _TickLog) -> None:
        live = self._live[job_id]
        placement = live.record.placement
        control = Control(
            seq=live.control_seq + 1,
            memory_limits=tuple(MemoryLimit(i, live.limits[g]) for i, g in enumerate(placement)),
            compute_share=min(live.shares[g] for g in placement),
            paused=live.paused,
        )
        try:
            write_control(live.job_dir, control)
        except OSError as e:
            log.warning("%s: cannot write control.json: %s", job_id, e)
            self.storage.add_event(now, "control_error", job_id, error=str(e))
            return
        live.control_seq = control.seq
        with self.storage.transaction():
            self.storage.update_job(job_id, control_seq=control.seq)
            for g in placement:
                self.storage.set_placement(job_id, g, live.limits[g], live.shares[g])
        out.controls.append(ControlWrite(job_id, control))


# ----------------------------------------------------------------------------------------------
# Helpers shared with the CLI.


def _device_stats(live: _Live, gpu: int) -> DeviceStats | None:
    if live.stats is None:
        return None
    index = live.record.placement.index(gpu)
    return next((d for d in live.stats.devices if d.device == index), None)


def _control_file_seq(job_dir: Path) -> int:
    try:
        text = read_text(control_path(job_dir))
        return 0 if text is None else parse_control(text).seq
    except (ProtocolError, OSError):
        return 0


def read_job_stats(record: JobRecord) -> tuple[Stats | None, str | None]:
    if not record.job_dir:
        return None, None
    try:
        return read_stats(Path(record.job_dir)), None
    except (ProtocolError, OSError) as e:
        return None, str(e)


def build_status(
    config: Config,
    storage: Storage,
    gpus: Sequence[Gpu],
    now: float,
    stats: Mapping[str, tuple[Stats | None, str | None]] | None = None,
    utilisation: Mapping[int, float] | None = None,
    phases: Mapping[int, str] | None = None,
    reservations: Mapping[str, tuple[int, ...]] | None = None,
) -> ClusterStatus:
    """Per GPU: its jobs with limits, shares, memory in use, host fallback and step times.

    Works from the store and the job directories alone, so the CLI can answer without the daemon;
    the daemon adds utilisation, coordinator phases and reservations.
    """
    running = storage.list_jobs([JobStatus.RUNNING])
    queued = storage.list_jobs([JobStatus.QUEUED])
    settings = {(p.job_id, p.gpu): p for p in storage.placements()}
    reserved_for = {g: j for j, gs in (reservations or {}).items() for g in gs}
    per_gpu: dict[int, list[JobOnGpu]] = {g.id: [] for g in gpus}
    for record in running:
        found, error = (stats or {}).get(record.id) or read_job_stats(record)
        for index, gpu in enumerate(record.placement):
            if gpu not in per_gpu:
                continue
            setting = settings.get((record.id, gpu))
            device = None if found is None else next((d for d in found.devices if d.device == index), None)
            per_gpu[gpu].append(JobOnGpu(
                job_id=record.id, tenant=record.tenant, role=record.role or Role.OPPORTUNISTIC,
                memory_limit_bytes=setting.memory_limit_bytes if setting else 0,
                compute_share=setting.compute_share if setting else 1.0,
                in_use_bytes=None if device is None else device.in_use_bytes,
                host_in_use_bytes=None if device is None else device.host_in_use_bytes,
                host_fallbacks=None if device is None else device.host_fallbacks,
                step=None if found is None else found.step,
                last_step_ms=None if found is None else found.last_step_ms,
                step_ms_median=None if found is None else found.step_ms_median,
                achieved_share=None if found is None else found.achieved_share,
                stats_error=error,
            ))
    gpu_status = tuple(
        GpuStatus(g.id, g.memory_bytes, g.nvlink_group, None if utilisation is None else utilisation.get(g.id),
                  tuple(per_gpu[g.id]), reserved_for.get(g.id), None if phases is None else phases.get(g.id))
        for g in gpus
    )
    tenants = []
    quotas = {t.name: t.gpu_quota for t in config.tenants}
    for name in sorted(set(quotas) | {r.tenant for r in running} | {r.tenant for r in queued}):
        mine = [r for r in running if r.tenant == name]
        tenants.append(TenantStatus(
            name, quotas.get(name, 0),
            sum(r.num_gpus for r in mine if r.role is Role.GUARANTEE),
            len(mine), sum(1 for r in queued if r.tenant == name),
        ))
    return ClusterStatus(now, gpu_status, tuple(tenants), tuple(r.id for r in queued), tuple(r.id for r in running))


def lock_state_dir(state_dir: Path) -> int:
    """Hold the state directory for this process (one daemon per store); returns the lock's fd."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DaemonLockedError(f"another scheduler-lite daemon (pid {holder}) is serving {state_dir}") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
