"""The job host: where the daemon's jobs run, and the one way the daemon touches them.

The daemon (scheduler_lite.daemon) decides; a job host carries its decisions out on machines.
The contract is `JobHost`, each verb and what a host says about its machines stated there once
(docs/scheduler.md, "Job hosts", draws it). Two hosts exist:

  LocalJobHost      this machine, in the daemon's process (the single-machine daemon); also the
                    node side of a cluster (scheduler_lite.cluster.node_host wraps one per node);
  ClusterJobHost    the nodes of a Ray cluster (scheduler_lite.cluster.host): the same verbs fanned
                    out over one Ray actor per node, each wrapping a LocalJobHost there.

The daemon's LocalJobHost (`local_job_host`) has two parts composed into it: `containment`
(scheduler_lite.containment: each launch in a cgroup of its own where the machine allows; `start`
puts the job in it, `find` after a restart looks for its wrapper among the members, never in the
pid file the job can write, `signal` reaches every member, `stop`, `cleanup`, `kill_leftovers`
and `recover` kill what is left and remove it) and a `judge` (scheduler_lite.misbehaviour: each
`stats` read checked; each tick, `refresh`, NVML's processes against the jobs' cgroups). A
cluster node's host has neither: its jobs run in their process groups alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from scheduler_lite.containment import Containment, JobCgroup
from scheduler_lite.devices import DeviceBackend, NvmlDevices, open_devices
from scheduler_lite.isolation import (
    base_environment,
    job_user,
    prepare_job_dir,
    process_uid,
    read_log,
    read_small_int,
)
from scheduler_lite.jobenv import job_environment
from scheduler_lite.launcher import (
    EXIT_STATUS_FILE,
    PID_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    ExitInfo,
    Launcher,
    LaunchError,
    LaunchSpec,
    ProcessHandle,
    has_name,
    process_name,
    process_running,
    read_exit,
)
from scheduler_lite.misbehaviour import Finding, Judge
from scheduler_lite.model import Gpu
from scheduler_lite.ranks import job_stats, write_controls
from scheduler_lite.tick import JobTableView, LiveJob
from tf_antman.protocol import Control, ProtocolError, Stats, control_path, parse_control, read_text

if TYPE_CHECKING:
    from scheduler_lite.config import Config
    from scheduler_lite.driver import Launch, SchedulePolicy
    from scheduler_lite.storage import JobRecord, Storage

log = logging.getLogger("scheduler_lite")


class HostedJobs(Protocol):
    """The daemon's side, as a host whose machines come and go sees it (`JobHost.attach`): the
    daemon's verbs; what it holds of its jobs comes beside it, read only (`JobTableView`)."""

    # A running or booked job gone with its machine: out of the book (GPUs, quota released; the
    # host's `gpus_changed` that follows drops it), recorded by `record_lost` once nothing of it
    # runs. Its LiveJob if it ran.
    def lose(self, job_id: str, now: float) -> LiveJob | None: ...
    # The host's GPUs are now `gpus`; `size_known`: queued jobs that can never run fail now.
    def gpus_changed(self, gpus: Sequence[Gpu], now: float, size_known: bool) -> None: ...
    def adopt(self, record: JobRecord, now: float, launched_pid: int | None) -> None: ...  # machines late
    # A job lost with its machine, nothing of it running any more: requeued (as never run) or failed.
    def record_lost(self, job_id: str, now: float, reason: str, requeue: bool) -> None: ...
    def changed(self) -> None: ...  # schedule this tick (a job released)


class JobHost(Protocol):
    """What the daemon asks of the machines that run its jobs (docs/scheduler.md, "Job hosts")."""

    devices: DeviceBackend  # the GPUs and their utilisation readings
    migrates: bool  # a job's restart on other GPUs is possible

    # -- the jobs (OSError or LaunchError where a verb fails) ------------------------------------
    # The job's directory, ready before the booking is recorded; an earlier launch's files (pid,
    # exit status) gone, or a restart between the booking and the start would take them for this
    # launch's and end it (it must find no process of this launch: requeued, never started).
    def prepare(self, launch: Launch, uid: int | None) -> Path: ...
    def start(self, launch: Launch, record: JobRecord, job_dir: Path, gpus: Sequence[Gpu]) -> ProcessHandle: ...
    def find(self, record: JobRecord, job_dir: Path) -> int | None: ...  # pid file, else launch token
    def adopt(self, record: JobRecord, pid: int, start_ticks: int | None, job_dir: Path) -> ProcessHandle | ExitInfo: ...
    def poll(self, handle: ProcessHandle) -> ExitInfo | None: ...
    def signal(self, handle: ProcessHandle, sig: int) -> bool: ...
    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo: ...  # SIGTERM, SIGKILL after grace_s
    def cleanup(self, handle: ProcessHandle) -> None: ...  # its end recorded: nothing of it outlives it
    def kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> list[int]: ...
    def stats(self, job_id: str, live: LiveJob) -> Stats | None: ...  # ProtocolError/OSError: refused
    def write_control(self, job_id: str, live: LiveJob, control: Control) -> None: ...
    def recorded_exit(self, record: JobRecord, job_dir: Path) -> ExitInfo | None: ...
    def control_seq(self, record: JobRecord, job_dir: Path) -> int: ...
    def read_log(self, record: JobRecord, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]: ...

    # -- the machines (what only the host knows about them) ----------------------------------------
    # A host whose machines change under the daemon (nodes lost and joined) keeps the daemon's
    # side and hands job ends back through it; `table`: the daemon's running and booked jobs.
    def attach(self, jobs: HostedJobs, table: JobTableView) -> None: ...
    # At the start: the ids of the store's running jobs the daemon must not adopt now.
    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]: ...
    def refresh(self, now: float) -> None: ...  # first thing in every tick
    def policy(self, base: SchedulePolicy) -> SchedulePolicy: ...  # Algorithm 1 for this topology
    def cannot_run(self, record: JobRecord) -> str | None: ...  # before the daemon's own checks
    def size_known(self) -> bool: ...  # False: a job too big for the machines here waits
    def absent(self) -> tuple[str, ...]: ...  # machines configured but not here
    # Device memory on the GPU no job's limit controls (NVML: processes of no job, bytes above a
    # limit): the coordinator counts it as taken. 0 where the host cannot see it.
    def taken_bytes(self, gpu: int) -> int: ...
    # For `status` and the metrics: the jobs' cgroups (None: a host with nothing to say of them)
    # and what its jobs (and GPUs) do that they should not (None: not checked here).
    containment: Containment | None
    def findings(self) -> Sequence[Finding] | None: ...


class LocalJobHost:
    """Jobs on this machine: a process per job under the launcher's wrapper, its files in
    `jobs_dir/<job id>` (scheduler_lite.isolation lays them out); `containment` and `judge`:
    the module docstring (none given: not contained, not checked)."""

    migrates = True

    def __init__(self, config: Config, launcher: Launcher | None = None, jobs_dir: Path | None = None, *,
                 containment: Containment | None = None, judge: Judge | None = None) -> None:
        self.config = config
        self.jobs_dir = config.jobs_dir if jobs_dir is None else jobs_dir
        self.devices: DeviceBackend = open_devices(config.devices)
        self.launcher = launcher if launcher is not None else Launcher()
        self.containment = containment if containment is not None else Containment(config.state_dir, "off")
        self.judge = judge
        self._cgroups: dict[Path, JobCgroup] = {}  # by job directory: the handles' launches

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    # -- the jobs ---------------------------------------------------------------------------------

    def clear(self, job_id: str, extra: Sequence[str] = ()) -> None:
        """Drop the files an earlier launch of the job left (its pid, its exit status)."""
        for stale in (PID_FILE, EXIT_STATUS_FILE, *extra):
            with contextlib.suppress(FileNotFoundError):
                (self.job_dir(job_id) / stale).unlink()

    def prepare(self, launch: Launch, uid: int | None) -> Path:
        return self.prepare_dir(launch.job_id, uid, len(launch.gpus))

    def prepare_dir(self, job_id: str, uid: int | None, gpus: int = 1) -> Path:
        job_dir = self.job_dir(job_id)
        # Owned by the daemon, open to the job's user for its stats only; an earlier launch's files
        # (its pid, its exit status) are emptied out with the rest (scheduler_lite.isolation).
        # A job on several GPUs gets a directory per rank r > 0 too (scheduler_lite.ranks).
        prepare_job_dir(job_dir, job_user(uid), gpus)
        return job_dir

    def start(self, launch: Launch, record: JobRecord, job_dir: Path, gpus: Sequence[Gpu]) -> ProcessHandle:
        assert record.launch_token is not None
        return self.launch(record, gpus, launch.memory_limit_bytes(), launch.compute_share(), job_dir,
                           record.launch_token)

    def launch(self, record: JobRecord, gpus: Sequence[Gpu], limit: int, share: float, job_dir: Path, token: str,
               extra_env: Mapping[str, str] | None = None) -> ProcessHandle:
        """Start the job's process on `gpus` (ids as the job sees them) with these settings."""
        if self.judge is not None:
            self.judge.launched(record.id, share, {g.id: limit for g in gpus})
        cg = self.containment.cgroup(record.id, token)
        if cg is not None:
            # GPU id N's node is /dev/nvidiaN (minor N), as where NVML's indices follow the minor
            # numbers (the usual machine; not checked here).
            placed = {g.id for g in gpus}
            self.containment.create(cg, [g.id for g in self.devices.inventory() if g.id not in placed])
        user = job_user(record.uid)
        env = job_environment(self.config, record, list(gpus), limit, share, job_dir, base=base_environment(user))
        env.update(extra_env or {})
        handle = self.launcher.start(LaunchSpec(record.id, record.command, Path(record.workdir), env, job_dir, token,
                                                user))
        if cg is not None:
            try:
                self.containment.enter(cg, handle.pid)
            except OSError as e:  # not contained: not run (it was promised a cgroup)
                self.launcher.stop(handle, 0.0)
                self.containment.end(cg)
                raise LaunchError(f"cannot put {record.id} in its cgroup {cg.v2}: {e.strerror or e}") from None
            self._cgroups[job_dir] = cg
        return handle

    def find(self, record: JobRecord, job_dir: Path) -> int | None:
        cg = self._launch_cgroup(record)
        if cg is None:  # not contained (started before containment, or none here)
            return self.find_launch(record.id, record.launch_token, record.uid, job_dir)
        assert record.launch_token is not None
        pid = self.launcher.find(record.id, record.launch_token)
        return pid if pid is not None and pid in self.containment.pids(cg) else None

    def find_launch(self, job_id: str, token: str | None, uid: int | None, job_dir: Path, *,
                    named: bool = False) -> int | None:
        """The launch's pid: its pid file, else its token (/proc). `named`: a live process from the
        pid file must carry the token too (a node's directory may hold another launch's pid file)."""
        pid = read_small_int(job_dir / PID_FILE)  # no link followed, no FIFO blocking
        if named and token and pid is not None and process_running(pid, None) \
                and not has_name(pid, process_name(job_id, token)):
            pid = None  # a live process without this launch's token: another launch's, or a reused pid
        if pid is None and token:
            pid = self.launcher.find(job_id, token)
        # The job's user writes the pid file: never adopt (and later signal) another's process.
        if pid is not None and process_uid(pid) in (None, os.geteuid(), uid):
            return pid
        return None

    def adopt(self, record: JobRecord, pid: int, start_ticks: int | None, job_dir: Path) -> ProcessHandle | ExitInfo:
        found = self.launcher.adopt(pid, start_ticks, job_dir, record.launch_token, record.id)
        running = isinstance(found, ProcessHandle)
        if running and self.judge is not None:
            self.judge.launched(record.id, 1.0)
        cg = self._launch_cgroup(record)
        if cg is not None and running:
            self._cgroups[job_dir] = cg
        elif cg is not None:
            self.containment.end(cg)
        return found

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        return self.launcher.poll(handle)

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        sent = self.launcher.signal(handle, sig)
        cg = self._cgroups.get(handle.job_dir)
        return (cg is not None and self.containment.signal(cg, sig, skip_group=handle.pid)) or sent

    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo:
        info = self.launcher.stop(handle, grace_s)
        self._ended(handle)
        return info

    def cleanup(self, handle: ProcessHandle) -> None:
        self.launcher.cleanup(handle)
        self._ended(handle)

    def kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> list[int]:
        killed = self.launcher.kill_leftovers(job_dir, pid, start)
        cg = self._launch_cgroup(record)
        return killed if cg is None else killed + [p for p in self.containment.end(cg) if p not in killed]

    def stats(self, job_id: str, live: LiveJob) -> Stats | None:
        # A refused document raises (the daemon reports it) before the judge sees it.
        found = job_stats(live.job_dir, live.record.uid, len(live.record.placement))
        if self.judge is not None:
            memory = {g.id: g.memory_bytes for g in self.devices.inventory()}
            if self.judge.check(job_id, live, found, [memory.get(g, 0) for g in live.record.placement]):
                self.signal(live.handle, signal.SIGTERM)
        return found

    def write_control(self, job_id: str, live: LiveJob, control: Control) -> None:
        write_controls(live.job_dir, len(live.record.placement), control)
        if self.judge is not None:
            self.judge.sent(job_id, live.record.placement, control)

    def recorded_exit(self, record: JobRecord, job_dir: Path) -> ExitInfo | None:
        return read_exit(job_dir)

    def control_seq(self, record: JobRecord, job_dir: Path) -> int:
        return control_file_seq(job_dir)

    def read_log(self, record: JobRecord, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]:
        assert record.job_dir is not None
        return read_log(Path(record.job_dir) / (STDERR_FILE if stderr else STDOUT_FILE), offset, limit)

    def _launch_cgroup(self, record: JobRecord) -> JobCgroup | None:
        """The cgroup of the record's launch, where it exists."""
        cg = None if not record.launch_token else self.containment.cgroup(record.id, record.launch_token)
        return cg if cg is not None and cg.v2.is_dir() else None

    def _ended(self, handle: ProcessHandle) -> None:
        if self.judge is not None:
            self.judge.ended(handle.job_dir.name)  # the layout: jobs_dir/<job id>
        cg = self._cgroups.pop(handle.job_dir, None)
        if cg is not None:
            self.containment.end(cg)

    # -- the machine: one, always here ------------------------------------------------------------

    def attach(self, jobs: HostedJobs, table: JobTableView) -> None:
        pass  # its GPUs never change under the daemon

    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]:
        keep = [f"{r.id}-{r.launch_token}" for r in running if r.launch_token]
        for cg in self.containment.stale(keep):
            killed = self.containment.end(cg)
            if killed:
                log.warning("cgroup %s: %d process(es) of a launch the store no longer runs killed", cg.v2, len(killed))
        return set()

    def refresh(self, now: float) -> None:
        """Each GPU's compute processes to the judge with the jobs' cgroups' pids, where NVML and
        containment are (without cgroups a job's pids cannot be told from another's: not checked)."""
        if self.judge is None or not isinstance(self.devices, NvmlDevices) or not self.containment.active:
            return
        try:
            processes = self.devices.compute_processes()
        except Exception as e:  # noqa: BLE001 - NVML errors (a lost GPU): the check waits for the next tick
            log.debug("NVML per-process read failed: %r", e)
            return
        owner = {pid: job_dir.name for job_dir, cg in self._cgroups.items() for pid in self.containment.pids(cg)}
        self.judge.gpu_processes(processes, owner, now)

    def policy(self, base: SchedulePolicy) -> SchedulePolicy:
        return base

    def cannot_run(self, record: JobRecord) -> str | None:
        return None

    def size_known(self) -> bool:
        return True

    def absent(self) -> tuple[str, ...]:
        return ()

    def taken_bytes(self, gpu: int) -> int:
        return 0 if self.judge is None else self.judge.taken_bytes(gpu)

    def findings(self) -> list[Finding] | None:
        return None if self.judge is None else self.judge.findings()


def local_job_host(config: Config, storage: Storage | None = None,
                   clock: Callable[[], float] = time.time) -> LocalJobHost:
    """The daemon's host on this machine: each job contained where the machine allows
    (jobs.containment), its reports checked (events in `storage`)."""
    containment = Containment(config.state_dir, config.jobs.containment)
    if containment.active:
        log.info("containment: %s", containment.detail)
    else:
        log.warning("containment off: %s (docs/security.md)", containment.detail)
    return LocalJobHost(config, containment=containment, judge=Judge(config.jobs, storage, clock))


def control_file_seq(job_dir: Path) -> int:
    """The seq of the control.json in `job_dir`; 0 if none or unreadable (a fresh one follows)."""
    try:
        text = read_text(control_path(job_dir))
        return 0 if text is None else parse_control(text).seq
    except (ProtocolError, OSError):
        return 0
