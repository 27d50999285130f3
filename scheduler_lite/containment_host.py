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
  freeze     stops every process of the job at once.

Where containment is inactive (`Containment.active` False: an unprivileged daemon, no cgroup2),
every verb is LocalJobHost's alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler_lite.containment import Containment, JobCgroup, device_minors
from scheduler_lite.devices import DeviceBackend
from scheduler_lite.jobhost import LocalJobHost
from scheduler_lite.launcher import ExitInfo, Launcher, LaunchError, ProcessHandle
from scheduler_lite.model import Gpu

if TYPE_CHECKING:
    from scheduler_lite.config import Config
    from scheduler_lite.storage import JobRecord

log = logging.getLogger("scheduler_lite")


class ContainedJobHost(LocalJobHost):
    def __init__(self, config: Config, devices: DeviceBackend | None = None, launcher: Launcher | None = None,
                 jobs_dir: Path | None = None, containment: Containment | None = None) -> None:
        super().__init__(config, devices, launcher, jobs_dir)
        self.containment = containment if containment is not None else Containment(
            config.state_dir, config.jobs.containment)
        self._cgroups: dict[Path, JobCgroup] = {}  # by job directory: the handles' launches
        if self.containment.active:
            log.info("containment: %s", self.containment.describe())
        else:
            log.warning("containment off: %s (docs/security.md)", self.containment.describe())

    def launch(self, record: JobRecord, gpus: Sequence[Gpu], limit: int, share: float, job_dir: Path, token: str,
               extra_env: Mapping[str, str] | None = None) -> ProcessHandle:
        cg = self.containment.cgroup(record.id, token)
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
            self.containment.kill(cg)
            self.containment.remove(cg)
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
        if cg is not None:
            for pid in self.containment.pids(cg):
                sent = _signal_member(pid, cg, sig) or sent
        return sent

    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo:
        info = super().stop(handle, grace_s)
        self._end_handle(handle)
        return info

    def cleanup(self, handle: ProcessHandle) -> None:
        super().cleanup(handle)
        self._end_handle(handle)

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
        cg = self._cgroups.pop(handle.job_dir, None)
        if cg is not None:
            self._end(cg)

    def _end(self, cg: JobCgroup) -> list[int]:
        killed = self.containment.kill(cg)
        self.containment.remove(cg)
        return killed


def _signal_member(pid: int, cg: JobCgroup, sig: int) -> bool:
    """`sig` to `pid` only while it is still a member of `cg`: through a pidfd taken before the
    check, so a pid reused by another process between the listing and the signal is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            if not any(line.startswith("0::") and line.rstrip("\n").endswith("/" + cg.name) for line in f):
                return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def local_job_host(config: Config) -> LocalJobHost:
    """The daemon's host on this machine: contained where it can be (ContainedJobHost)."""
    return ContainedJobHost(config)


__all__ = ["ContainedJobHost", "local_job_host"]
