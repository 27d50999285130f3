"""The job host: where the daemon's jobs run, and the one way the daemon touches them.

The daemon (scheduler_lite.daemon) decides; a job host carries its decisions out on machines.
The contract is `JobHost`, each verb and what a host says about its machines stated there once
(docs/scheduler.md, "Job hosts", draws it). Two hosts exist:

  LocalJobHost      this machine, in the daemon's process (the single-machine daemon); also the
                    node side of a cluster (scheduler_lite.cluster.node_host wraps one per node);
  ClusterJobHost    the nodes of a Ray cluster (scheduler_lite.cluster.host): the same verbs fanned
                    out over one Ray actor per node, each wrapping a LocalJobHost there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from scheduler_lite.devices import DeviceBackend, open_devices
from scheduler_lite.isolation import (
    base_environment,
    job_user,
    prepare_job_dir,
    process_uid,
    read_job_stats,
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
    LaunchSpec,
    ProcessHandle,
    has_name,
    process_name,
    process_running,
    read_exit,
)
from scheduler_lite.model import Gpu
from scheduler_lite.ranks import has_ranks, merge_rank_stats, rank_control
from scheduler_lite.tick import LiveJob
from tf_antman.protocol import Control, ProtocolError, Stats, control_path, parse_control, read_text, write_control
from tf_antman.protocol.layout import rank_dir

if TYPE_CHECKING:
    from scheduler_lite.config import Config
    from scheduler_lite.driver import Launch, SchedulePolicy
    from scheduler_lite.storage import JobRecord


class HostedJobs(Protocol):
    """The daemon's side, as a host whose machines come and go sees it (`JobHost.attach`)."""

    def live_jobs(self) -> Mapping[str, LiveJob]: ...
    def booked_launches(self) -> Sequence[Launch]: ...
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
    # side and hands job ends back through it.
    def attach(self, jobs: HostedJobs) -> None: ...
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


STALE_FILES = (PID_FILE, EXIT_STATUS_FILE)  # an earlier launch's, in a job directory


class LocalJobHost:
    """Jobs on this machine: a process per job under the launcher's wrapper, its files in
    `jobs_dir/<job id>` (scheduler_lite.isolation lays them out)."""

    migrates = True

    def __init__(self, config: Config, devices: DeviceBackend | None = None, launcher: Launcher | None = None,
                 jobs_dir: Path | None = None) -> None:
        self.config = config
        self.jobs_dir = config.jobs_dir if jobs_dir is None else jobs_dir
        self.devices = devices if devices is not None else open_devices(config.devices)
        self.launcher = launcher if launcher is not None else Launcher()

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    # -- the jobs ---------------------------------------------------------------------------------

    def clear(self, job_id: str, extra: Sequence[str] = ()) -> None:
        """Drop the files an earlier launch of the job left (its pid, its exit status)."""
        for stale in (*STALE_FILES, *extra):
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
        user = job_user(record.uid)
        env = job_environment(self.config, record, list(gpus), limit, share, job_dir, base=base_environment(user))
        env.update(extra_env or {})
        return self.launcher.start(LaunchSpec(record.id, record.command, Path(record.workdir), env, job_dir, token,
                                              user))

    def find(self, record: JobRecord, job_dir: Path) -> int | None:
        return self.find_launch(record.id, record.launch_token, record.uid, job_dir)

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
        return self.launcher.adopt(pid, start_ticks, job_dir, record.launch_token, record.id)

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        return self.launcher.poll(handle)

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        return self.launcher.signal(handle, sig)

    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo:
        return self.launcher.stop(handle, grace_s)

    def cleanup(self, handle: ProcessHandle) -> None:
        self.launcher.cleanup(handle)

    def kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> list[int]:
        return self.launcher.kill_leftovers(job_dir, pid, start)

    def stats(self, job_id: str, live: LiveJob) -> Stats | None:
        first = read_job_stats(live.job_dir, live.record.uid)
        gpus = len(live.record.placement)
        if gpus < 2:
            return first
        ranks = [read_job_stats(rank_dir(live.job_dir, r), live.record.uid) for r in range(1, gpus)]
        if all(s is None for s in ranks):
            return first  # one process for all its GPUs (or its ranks > 0 not started yet)
        if first is None or any(s is None for s in ranks):
            return None  # a rank that reports nothing: no new document (silent, as a job writing none)
        return merge_rank_stats([first, *ranks])

    def write_control(self, job_id: str, live: LiveJob, control: Control) -> None:
        gpus = len(live.record.placement)
        ranked = gpus > 1 and has_ranks(live.job_dir, gpus)
        for rank in range(gpus - 1, 0, -1):  # rank r's GPU: the placement's r-th
            here = rank_dir(live.job_dir, rank)
            if here.is_dir():  # made at prepare (a job launched before ranks existed has none)
                write_control(here, rank_control(control, rank, ranked))
        write_control(live.job_dir, rank_control(control, 0, ranked))

    def recorded_exit(self, record: JobRecord, job_dir: Path) -> ExitInfo | None:
        return read_exit(job_dir)

    def control_seq(self, record: JobRecord, job_dir: Path) -> int:
        return control_file_seq(job_dir)

    def read_log(self, record: JobRecord, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]:
        assert record.job_dir is not None
        return read_log(Path(record.job_dir) / (STDERR_FILE if stderr else STDOUT_FILE), offset, limit)

    # -- the machine: one, always here ------------------------------------------------------------

    def attach(self, jobs: HostedJobs) -> None:
        pass  # its GPUs never change under the daemon

    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]:
        return set()

    def refresh(self, now: float) -> None:
        pass

    def policy(self, base: SchedulePolicy) -> SchedulePolicy:
        return base

    def cannot_run(self, record: JobRecord) -> str | None:
        return None

    def size_known(self) -> bool:
        return True

    def absent(self) -> tuple[str, ...]:
        return ()

    def taken_bytes(self, gpu: int) -> int:
        return 0  # no per-process check here (ContainedJobHost has it, with NVML and containment)


def control_file_seq(job_dir: Path) -> int:
    """The seq of the control.json in `job_dir`; 0 if none or unreadable (a fresh one follows)."""
    try:
        text = read_text(control_path(job_dir))
        return 0 if text is None else parse_control(text).seq
    except (ProtocolError, OSError):
        return 0


__all__ = ["HostedJobs", "JobHost", "LocalJobHost", "control_file_seq"]
