"""The local job host with each job in a cgroup of its own (scheduler_lite.containment).

`ContainedJobHost` is `LocalJobHost` with the kernel's word added to its verbs:

  start      the launch's cgroup is made (its devices cgroup denying the managed GPUs it was not
             placed on), the wrapper and what it started meanwhile are put in it;
  find       a restarted daemon finds the wrapper among the launch's cgroup members (by its launch
             token), never through the pid file the job can write; with no cgroup for the launch
             (started before containment), as LocalJobHost does;
  signal     every member of the cgroup gets the signal too (a cancel's SIGTERM reaches processes
             that left the job's process group);
  stop, cleanup, kill_leftovers
             whatever is left in the cgroup is killed (`cgroup.kill`) and the cgroup removed: at
             a job's end, nothing of it runs on;
  recover    at the start, cgroups of launches the store no longer runs are emptied and removed;
  freeze     stops every process of the job at once;
  stats      what the job reports is checked (scheduler_lite.misbehaviour: controls refused,
             silence, impossible figures): each new finding is an event `misbehaving` and a log
             warning, the job's findings are `status` warnings (`findings`), and with
             `jobs.misbehaviour = "stop"` an opportunistic job found is stopped (SIGTERM, SIGKILL
             after jobs.cancel_grace_s; event `misbehaviour_stop`), with `"requeue"` stopped so
             and marked (`LiveJob.requeue`) for the daemon to queue it again when it has ended.

Where containment is inactive (`Containment.active` False: an unprivileged daemon, no cgroup2),
every verb is LocalJobHost's alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler_lite.containment import Containment, JobCgroup, device_minors
from scheduler_lite.devices import DeviceBackend
from scheduler_lite.jobhost import LocalJobHost
from scheduler_lite.launcher import ExitInfo, Launcher, LaunchError, ProcessHandle
from scheduler_lite.misbehaviour import (
    Finding,
    Sent,
    check_gpu_processes,
    check_stats,
    read_gpu_processes,
    taken_by_gpu,
)
from scheduler_lite.model import Gpu, Role
from scheduler_lite.tick import LiveJob
from tf_antman.protocol import Control, Stats

if TYPE_CHECKING:
    from scheduler_lite.config import Config
    from scheduler_lite.storage import JobRecord, Storage

log = logging.getLogger("scheduler_lite")
SENT_HISTORY = 8  # controls whose shares are kept per job (misbehaviour.Sent.shares)


class ContainedJobHost(LocalJobHost):
    def __init__(self, config: Config, devices: DeviceBackend | None = None, launcher: Launcher | None = None,
                 jobs_dir: Path | None = None, containment: Containment | None = None,
                 storage: Storage | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, devices, launcher, jobs_dir)
        self.storage = storage  # where findings are recorded as events (None: logged only)
        self.clock = clock
        self.findings: dict[str, list[Finding]] = {}  # by job id: what its latest stats showed
        self._sent: dict[str, Sent] = {}  # the newest control written to each job
        self._stats_seen: dict[str, tuple[int, float]] = {}  # (stats seq, when first seen) by job id
        self._launched: dict[str, float] = {}  # when the host launched or adopted it
        self._limits: dict[str, dict[int, int]] = {}  # each job's memory limit per GPU, as last sent
        self._device_findings: dict[str, list[Finding]] = {}  # NVML's (over_limit), by job id
        self._taken: dict[int, int] = {}  # by GPU: NVML's bytes of no job and above limits (taken_bytes)
        self.containment = containment if containment is not None else Containment(
            config.state_dir, config.jobs.containment)
        self._cgroups: dict[Path, JobCgroup] = {}  # by job directory: the handles' launches
        if self.containment.active:
            log.info("containment: %s", self.containment.describe())
        else:
            log.warning("containment off: %s (docs/security.md)", self.containment.describe())

    def launch(self, record: JobRecord, gpus: Sequence[Gpu], limit: int, share: float, job_dir: Path, token: str,
               extra_env: Mapping[str, str] | None = None) -> ProcessHandle:
        self._limits[record.id] = {g.id: limit for g in gpus}
        cg = self.containment.cgroup(record.id, token)
        self._track(record.id, share)
        if cg is None:
            return super().launch(record, gpus, limit, share, job_dir, token, extra_env)
        placed = {g.id for g in gpus}
        others = [g.id for g in self.devices.inventory() if g.id not in placed]
        self.containment.create(cg, device_minors(others))
        handle = super().launch(record, gpus, limit, share, job_dir, token, extra_env)
        try:
            self.containment.enter(cg, handle.pid)
        except OSError as e:  # not contained: not run (it was promised a cgroup)
            self.launcher.stop(handle, 0.0)
            self._end(cg)
            raise LaunchError(f"cannot put {record.id} in its cgroup {cg.v2}: {e.strerror or e}") from None
        self._cgroups[job_dir] = cg
        return handle

    def find(self, record: JobRecord, job_dir: Path) -> int | None:
        cg = self._launch_cgroup(record)
        if cg is None or not cg.v2.is_dir():
            return super().find(record, job_dir)
        assert record.launch_token is not None
        pid = self.launcher.find(record.id, record.launch_token)
        return pid if pid is not None and pid in self.containment.pids(cg) else None

    def adopt(self, record: JobRecord, pid: int, start_ticks: int | None, job_dir: Path) -> ProcessHandle | ExitInfo:
        found = super().adopt(record, pid, start_ticks, job_dir)
        if isinstance(found, ProcessHandle):
            self._track(record.id, 1.0)
        cg = self._launch_cgroup(record)
        if cg is not None and cg.v2.is_dir():
            if isinstance(found, ProcessHandle):
                self._cgroups[job_dir] = cg
            else:
                self._end(cg)
        return found

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        sent = super().signal(handle, sig)
        cg = self._cgroups.get(handle.job_dir)
        if cg is not None:  # the members that left the job's process group: the group has it already
            for pid in self.containment.pids(cg):
                sent = _signal_member(pid, cg, sig, skip_group=handle.pid) or sent
        return sent

    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo:
        info = super().stop(handle, grace_s)
        self._end_handle(handle)
        return info

    def cleanup(self, handle: ProcessHandle) -> None:
        super().cleanup(handle)
        self._end_handle(handle)

    # -- what the jobs report ---------------------------------------------------------------------

    def write_control(self, job_id: str, live: LiveJob, control: Control) -> None:
        super().write_control(job_id, live, control)
        placement = live.record.placement
        for entry in control.memory_limits:  # device = the GPU's index within the job
            if 0 <= entry.device < len(placement):
                self._limits.setdefault(job_id, {})[placement[entry.device]] = entry.limit_bytes
        before = self._sent.get(job_id)
        share = control.compute_share if control.compute_share is not None else (1.0 if before is None else before.share)
        history = (() if before is None else before.shares)[-(SENT_HISTORY - 1):] + ((control.seq, share),)
        self._sent[job_id] = Sent(control.seq, share, history, self.clock())

    def stats(self, job_id: str, live: LiveJob) -> Stats | None:
        found = super().stats(job_id, live)  # a refused document raises: the daemon reports it
        now = self.clock()
        if found is not None and self._stats_seen.get(job_id, (None,))[0] != found.seq:
            self._stats_seen[job_id] = (found.seq, now)
        seen = self._stats_seen.get(job_id)
        gpus = {g.id: g for g in self.devices.inventory()}
        findings = check_stats(job_id, found, sent=self._sent.get(job_id),
                               gpu_memory=[gpus[g].memory_bytes if g in gpus else 0 for g in live.record.placement],
                               host_allowance=self.config.jobs.host_memory_bytes, now=now,
                               stats_since=None if seen is None else seen[1],
                               launched_at=self._launched.get(job_id, now), silent_after_s=self.config.jobs.silent_after_s)
        self._judge(job_id, live, findings + self._device_findings.get(job_id, []), now)
        return found

    def _judge(self, job_id: str, live: LiveJob, findings: list[Finding], now: float) -> None:
        """Record what is new, act on it (jobs.misbehaviour), and finish a stop under way."""
        known = {f.kind for f in self.findings.get(job_id, [])}
        self.findings[job_id] = findings
        for f in findings:
            if f.kind in known:
                continue
            log.warning("%s does not cooperate: %s", job_id, f.line())
            if self.storage is not None:
                self.storage.add_event(now, "misbehaving", job_id, check=f.kind, detail=f.detail)
        opportunistic = live.record.role is Role.OPPORTUNISTIC
        action = self.config.jobs.misbehaviour
        # A stop under way (a cancel's, a migration's or this one) is finished by the daemon's own
        # SIGKILL after jobs.cancel_grace_s (Daemon._kill_after_grace), which records it.
        if findings and opportunistic and action in ("stop", "requeue") and live.stop_sent_at is None:
            live.stop_sent_at = now
            checks = sorted({f.kind for f in findings})
            if action == "requeue":  # the daemon queues it again once it has ended (Daemon.finish)
                live.requeue = "misbehaving: " + ", ".join(checks)
            log.warning("%s stopped: an opportunistic job that does not cooperate (jobs.misbehaviour = \"%s\")",
                        job_id, action)
            if self.storage is not None:
                self.storage.add_event(now, "misbehaviour_stop", job_id, signal="SIGTERM", action=action,
                                       checks=checks)
            self.signal(live.handle, signal.SIGTERM)

    def refresh(self, now: float) -> None:
        """First thing in each tick: with NVML and containment, each GPU's compute processes
        (nvmlDeviceGetComputeRunningProcesses) against the jobs' cgroups and limits: a job over
        its limit is `over_limit` (judged with its stats), a process of no job on a managed GPU
        `unmanaged` (an event once, a `status` warning while it lasts). Without containment the
        pids cannot be told apart from a job's: not checked."""
        super().refresh(now)
        nvml = getattr(self.devices, "_nvml", None)
        if nvml is None or getattr(self.devices, "kind", "") != "nvml" or not self.containment.active:
            return
        try:
            processes = read_gpu_processes(nvml, [g.id for g in self.devices.inventory()])
        except Exception as e:  # noqa: BLE001 - NVML errors (a lost GPU): the check waits for the next tick
            log.debug("NVML per-process read failed: %r", e)
            return
        owner = {pid: job_dir.name for job_dir, cg in self._cgroups.items() for pid in self.containment.pids(cg)}
        limits = {(job, gpu): limit for job, per_gpu in self._limits.items() for gpu, limit in per_gpu.items()}
        found = check_gpu_processes(processes, owner, limits)
        self._taken = taken_by_gpu(found)
        self._device_findings = {}
        for f in found:
            if f.job_id is not None:
                self._device_findings.setdefault(f.job_id, []).append(f)
        unmanaged = {f"GPU {f.gpu}": [g for g in found if g.job_id is None and g.gpu == f.gpu]
                     for f in found if f.job_id is None}
        for key, items in unmanaged.items():
            if key not in self.findings:
                log.warning("%s", "; ".join(f.line() for f in items))
                if self.storage is not None:
                    for f in items:
                        self.storage.add_event(now, "misbehaving", None, check=f.kind, gpu=f.gpu, detail=f.detail,
                                               bytes_taken=f.bytes_taken)
        for key in [k for k in self.findings if k.startswith("GPU ") and k not in unmanaged]:
            del self.findings[key]
        self.findings.update(unmanaged)

    def taken_bytes(self, gpu: int) -> int:
        """The bytes the last NVML read saw on `gpu` that no job's limit controls (a process of
        no job, what a job holds above its limit): the coordinator does not hand them out."""
        return self._taken.get(gpu, 0)

    def _track(self, job_id: str, share: float) -> None:
        self._launched[job_id] = self.clock()
        self._sent[job_id] = Sent(0, share, ((0, share),), self.clock())
        self._stats_seen.pop(job_id, None)
        self.findings.pop(job_id, None)

    def kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> list[int]:
        killed = super().kill_leftovers(record, job_dir, pid, start)
        cg = self._launch_cgroup(record)
        if cg is not None and cg.v2.is_dir():
            killed += [p for p in self._end(cg) if p not in killed]
        return killed

    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]:
        keep = [f"{r.id}-{r.launch_token}" for r in running if r.launch_token]
        for cg in self.containment.stale(keep):
            killed = self._end(cg)
            if killed:
                log.warning("cgroup %s: %d process(es) of a launch the store no longer runs killed", cg.v2, len(killed))
        return super().recover(running, now)

    def freeze(self, handle: ProcessHandle, frozen: bool) -> bool:
        """Stop (or let go on) every process of the job; False where it has no cgroup or no freezer."""
        cg = self._cgroups.get(handle.job_dir)
        return cg is not None and self.containment.freeze(cg, frozen)

    def cgroup_of(self, handle: ProcessHandle) -> JobCgroup | None:
        return self._cgroups.get(handle.job_dir)

    # -- inside -----------------------------------------------------------------------------------

    def _launch_cgroup(self, record: JobRecord) -> JobCgroup | None:
        return None if not record.launch_token else self.containment.cgroup(record.id, record.launch_token)

    def _end_handle(self, handle: ProcessHandle) -> None:
        job_id = handle.job_dir.name  # LocalJobHost's layout: jobs_dir/<job id>
        for table in (self.findings, self._sent, self._stats_seen, self._launched, self._limits,
                      self._device_findings):
            table.pop(job_id, None)
        cg = self._cgroups.pop(handle.job_dir, None)
        if cg is not None:
            self._end(cg)

    def _end(self, cg: JobCgroup) -> list[int]:
        killed = self.containment.kill(cg)
        self.containment.remove(cg)
        return killed


def _signal_member(pid: int, cg: JobCgroup, sig: int, skip_group: int) -> bool:
    """`sig` to `pid` only while it is still a member of `cg` and not in process group
    `skip_group` (signalled as a group already: a process must not get a cancel's SIGTERM twice):
    through a pidfd taken before the checks, so a pid reused by another process between the
    listing and the signal is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            if not any(line.startswith("0::") and line.rstrip("\n").endswith("/" + cg.name) for line in f):
                return False
        if os.getpgid(pid) == skip_group:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def local_job_host(config: Config, storage: Storage | None = None,
                   clock: Callable[[], float] = time.time) -> LocalJobHost:
    """The daemon's host on this machine: contained where it can be, its jobs' reports checked
    (ContainedJobHost)."""
    return ContainedJobHost(config, storage=storage, clock=clock)


__all__ = ["ContainedJobHost", "local_job_host"]
