"""Each job in a cgroup of its own: what the kernel, not pid bookkeeping, says belongs to a job.

A job's processes can leave its process group (`setsid`, `start_new_session=True`) and write its
pid file; they cannot leave a cgroup they were put in (moving a process needs write access to the
cgroup.procs of the common ancestor, root's). So with containment on:

  - every process of a job is in `<daemon's cgroup>/scheduler-lite-<state dir hash>/<job>-<token>`
    of the cgroup v2 hierarchy (the token is the launch's, from the store: a relaunch gets a new
    cgroup, a restarted daemon finds the old one);
  - at the job's end and at a cancel's SIGKILL, `cgroup.kill` ends everything in it (kernel 5.14+;
    before that, freeze, SIGKILL each member, thaw);
  - `freeze` stops every process of the job at once (`cgroup.freeze`, kernel 5.2+);
  - a restarted daemon finds a job's wrapper among its cgroup's members, carrying its launch
    token, never from the pid file the job can write;
  - where the cgroup v1 `devices` controller is mounted (a hybrid hierarchy), the job's processes
    are put in a devices cgroup too that denies the NVIDIA device nodes (`c 195:N`) of the
    managed GPUs it was not placed on (as Slurm's ConstrainDevices): unsetting
    CUDA_VISIBLE_DEVICES does not reach another GPU. On a pure cgroup v2 machine this needs a
    BPF_PROG_TYPE_CGROUP_DEVICE program, which is not implemented: devices are not limited there,
    and `detail` says so.

How a process gets in: the wrapper (scheduler_lite.launcher) starts, the daemon writes its pid
into the cgroup right after Popen returns, then moves whatever the wrapper has started meanwhile
(its descendants, from /proc/<pid>/task/*/children) until no new one appears. The wrapper is a
Python interpreter starting up (tens of ms) before it forks the command, so in practice the
command starts inside; a descendant that forked and was re-parented away inside that window
would not be found (docs/security.md says so).

Where cgroups cannot be used (a daemon without write access to its cgroup: not root and no
delegated subtree; no cgroup2 mounted), `Containment.active` is False, jobs run as before (process
groups, pid files, launch tokens), and `detail` says why: `status` and the daemon's log show it.
`jobs.containment = "required"` refuses to start instead; `"off"` never uses cgroups.

What it does not do: limit memory, CPU or I/O (no controllers are enabled: on a hybrid machine
they are bound to v1, and the GPU shares are tf-antman's); nothing inside the job's cgroup is
protected from the job itself (it may create sub-cgroups only if it owns them, which it does not).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final

from scheduler_lite.launcher import signal_if

log = logging.getLogger("scheduler_lite")

CONTAINMENT_MODES: Final = ("auto", "off", "required")
NVIDIA_MAJOR: Final = 195  # /dev/nvidiaN is c 195:N (nvidiactl is 195:255, left allowed)
KILL_WAIT_S: Final = 5.0  # how long `end` waits for the cgroup to empty
SWEEP_ROUNDS: Final = 20  # `enter`'s passes over the wrapper's descendants until none is new


class ContainmentUnavailable(RuntimeError):
    """jobs.containment = "required" on a machine where it cannot be had; the message says why."""


@dataclass(frozen=True, slots=True)
class JobCgroup:
    """The cgroups of one launch of one job."""

    name: str  # <job id>-<launch token>
    v2: Path  # its directory in the cgroup2 hierarchy
    devices: Path | None  # its v1 devices cgroup, where that controller is mounted


def mounts(mountinfo: str) -> tuple[Path | None, Path | None]:
    """(cgroup2 mount point, cgroup v1 devices mount point) from /proc/self/mountinfo's text."""
    v2 = devices = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:  # no " - " separator: no tail
            continue
        point = Path(fields[4].replace("\\040", " "))
        if tail[0] == "cgroup2" and v2 is None:
            v2 = point
        elif tail[0] == "cgroup" and "devices" in tail[2].split(",") and devices is None:
            devices = point
    return v2, devices


def own_cgroups(text: str) -> tuple[str | None, str | None]:
    """(this process's cgroup2 path, its v1 devices path) from /proc/self/cgroup's text."""
    v2 = devices = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "devices" in parts[1].split(","):
            devices = parts[2]
    return v2, devices


def subtree_name(state_dir: Path) -> str:
    """The cgroup under which the jobs of the daemon of `state_dir` run (whether or not it
    exists). One subtree per store: several daemons (tests, users) on one machine never meet."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return f"scheduler-lite-{digest}"


def own_dirs(proc: Path) -> tuple[Path | None, Path | None]:
    """This process's cgroup2 directory and its v1 devices cgroup directory (None: no such
    hierarchy mounted), from /proc/self; OSError where that cannot be read."""
    v2_mount, devices_mount = mounts((proc / "self" / "mountinfo").read_text())
    own_v2, own_devices = own_cgroups((proc / "self" / "cgroup").read_text())
    return (None if v2_mount is None or own_v2 is None else v2_mount / own_v2.lstrip("/"),
            None if devices_mount is None or own_devices is None else devices_mount / own_devices.lstrip("/"))


def subtrees(proc: Path = Path("/proc")) -> set[str]:
    """The names of the daemons' subtrees present under this process's cgroup2 directory (where a
    daemon started by this process puts them); empty where cgroups cannot be read."""
    try:
        own_v2 = own_dirs(proc)[0]
        return set() if own_v2 is None else {p.name for p in own_v2.glob("scheduler-lite-*")}
    except OSError:
        return set()


class Containment:
    """The cgroups of one daemon's jobs (one state directory); inactive where they cannot be had."""

    def __init__(self, state_dir: Path, mode: str = "auto", *, proc: Path = Path("/proc")) -> None:
        if mode not in CONTAINMENT_MODES:
            raise ValueError(f"jobs.containment={mode!r} is invalid: accepted " + ", ".join(CONTAINMENT_MODES))
        self.proc = proc
        self.subtree = subtree_name(state_dir)
        self.v2_root: Path | None = None
        self.devices_root: Path | None = None
        self.can_kill = self.can_freeze = False
        # One line for `status` and the log: what is contained, or why nothing is.
        self.detail = "jobs.containment = \"off\""
        if mode != "off":
            self.detail = self._detect()
            if self.v2_root is None and mode == "required":
                raise ContainmentUnavailable(f"jobs.containment = \"required\" but {self.detail}")

    @property
    def active(self) -> bool:
        return self.v2_root is not None

    def _detect(self) -> str:
        try:
            own_v2, own_devices = own_dirs(self.proc)
        except OSError as e:
            return f"cgroups cannot be read ({e.strerror}): jobs are not contained"
        if own_v2 is None:
            return "no cgroup2 hierarchy is mounted: jobs are not contained (process groups only)"
        root = own_v2 / self.subtree
        try:
            root.mkdir(exist_ok=True)
        except OSError as e:
            return (f"the daemon cannot create cgroups under {root.parent} ({e.strerror}: run it as root, or give "
                    "it a delegated subtree): jobs are not contained (process groups only)")
        self.can_kill = (root / "cgroup.kill").exists()
        self.can_freeze = (root / "cgroup.freeze").exists()
        self.v2_root = root
        with contextlib.suppress(OSError):  # made again with the first job (create): none left behind
            root.rmdir()
        how = "cgroup.kill" if self.can_kill else "freeze + SIGKILL" if self.can_freeze else "SIGKILL of each member"
        devices = ("GPU device nodes not limited (cgroup v2 needs a BPF device program, not implemented; no v1 "
                   "devices controller is mounted)")
        if own_devices is not None:
            droot = own_devices / self.subtree
            try:
                droot.mkdir(exist_ok=True)
                self.devices_root = droot
                with contextlib.suppress(OSError):
                    droot.rmdir()
                devices = "GPU device nodes limited to the placed GPUs (cgroup v1 devices controller)"
            except OSError as e:
                devices = f"GPU device nodes not limited ({droot.parent}: {e.strerror})"
        return f"each job in a cgroup of its own under {root} (ended by {how}); {devices}"

    # -- one job ----------------------------------------------------------------------------------

    def cgroup(self, job_id: str, token: str) -> JobCgroup | None:
        """The cgroups of this launch (whether or not they exist); None when containment is off."""
        if self.v2_root is None:
            return None
        name = f"{job_id}-{token}"
        if "/" in name or name.startswith("."):
            raise ValueError(f"cgroup name {name!r}: a job id and a launch token without '/'")
        return self._named(name)

    def _named(self, name: str) -> JobCgroup:
        assert self.v2_root is not None
        return JobCgroup(name, self.v2_root / name, None if self.devices_root is None else self.devices_root / name)

    def create(self, cg: JobCgroup, denied_gpus: Iterable[int] = ()) -> None:
        """Make the launch's cgroups; its devices cgroup denies the device nodes of `denied_gpus`
        (their NVIDIA minor numbers: the managed GPUs it was not placed on)."""
        # parents: the subtree goes when its last job's cgroup does (remove)
        cg.v2.mkdir(parents=True, exist_ok=True)
        if cg.devices is not None:
            cg.devices.mkdir(parents=True, exist_ok=True)
            for minor in sorted(set(denied_gpus)):
                (cg.devices / "devices.deny").write_text(f"c {NVIDIA_MAJOR}:{minor} rwm\n")

    def enter(self, cg: JobCgroup, pid: int) -> None:
        """Put `pid` and everything it has started so far into the job's cgroups."""
        seen: set[int] = set()
        for _ in range(SWEEP_ROUNDS):
            found = [p for p in [pid, *self._descendants(pid)] if p not in seen]
            if not found:
                return
            for p in found:
                # The devices cgroup first: once a process is in the v2 one, it counts as contained.
                for target in (cg.devices, cg.v2):
                    if target is not None:
                        try:
                            (target / "cgroup.procs").write_text(str(p))
                        except OSError as e:
                            if e.errno != errno.ESRCH:  # ESRCH: gone meanwhile
                                raise
                seen.add(p)

    def pids(self, cg: JobCgroup) -> list[int]:
        """The processes in the job's cgroup (empty if it is gone)."""
        try:
            text = (cg.v2 / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def end(self, cg: JobCgroup) -> list[int]:
        """End every process in the job's cgroup (returns those that were there) and remove it
        (`remove`): nothing of the job runs on. Waits (up to KILL_WAIT_S) until it is empty: a
        process being killed can still be listed."""
        members = self.pids(cg)
        if members and self.can_kill:
            with contextlib.suppress(FileNotFoundError):
                (cg.v2 / "cgroup.kill").write_text("1")
        elif members:  # frozen first, so nothing forks between the reading and the killing
            self.freeze(cg, True)
            for p in self.pids(cg):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            self.freeze(cg, False)
        deadline = time.monotonic() + KILL_WAIT_S
        while members and self.pids(cg) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.remove(cg)
        return members

    def signal(self, cg: JobCgroup, sig: int, skip_group: int) -> bool:
        """`sig` to each member of the job's cgroup outside process group `skip_group` (signalled
        as a group already: a process must not get a cancel's SIGTERM twice), each only while it
        is still a member (`signal_if`: a pid reused after the listing is never hit)."""
        def member(pid: int) -> bool:
            with open(f"/proc/{pid}/cgroup") as f:
                inside = any(line.startswith("0::") and line.rstrip("\n").endswith("/" + cg.name) for line in f)
            return inside and os.getpgid(pid) != skip_group

        sent = False
        for pid in self.pids(cg):
            sent = signal_if(pid, sig, partial(member, pid)) or sent
        return sent

    def freeze(self, cg: JobCgroup, frozen: bool) -> bool:
        """Stop (or let go on) every process of the job at once; False where no freezer is."""
        if not self.can_freeze:
            return False
        (cg.v2 / "cgroup.freeze").write_text("1" if frozen else "0")
        return True

    def frozen(self, cg: JobCgroup) -> bool:
        try:
            events = (cg.v2 / "cgroup.events").read_text().split()
        except FileNotFoundError:
            return False
        return "frozen" in events and events[events.index("frozen") + 1] == "1"

    def remove(self, cg: JobCgroup) -> None:
        """Remove the launch's (empty) cgroups, and this daemon's subtree when it was the last."""
        for path in (cg.v2, cg.devices):
            if path is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                try:
                    path.rmdir()
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    log.warning("cgroup %s still has processes; left in place", path)
                    continue
            with contextlib.suppress(OSError):  # busy while other jobs run: kept
                path.parent.rmdir()

    def stale(self, keep: Sequence[str]) -> list[JobCgroup]:
        """This daemon's job cgroups not named in `keep`: launches whose jobs ended while it was down."""
        if self.v2_root is None:
            return []
        try:
            return [self._named(e.name) for e in sorted(self.v2_root.iterdir()) if e.is_dir() and e.name not in keep]
        except FileNotFoundError:
            return []

    def _descendants(self, pid: int) -> list[int]:
        out: list[int] = []
        todo = [pid]
        while todo:
            p = todo.pop()
            try:
                tasks = list((self.proc / str(p) / "task").iterdir())
            except OSError:
                continue
            for task in tasks:
                with contextlib.suppress(OSError):
                    children = [int(c) for c in (task / "children").read_text().split()]
                    out += children
                    todo += children
        return out


def sweep(state_dir: Path) -> list[int]:
    """End and remove every job cgroup of one state directory's daemon (its subtree only: other
    daemons' are never touched); returns the pids killed. What a restarted daemon's recovery does
    for launches its store no longer runs, for when no daemon will start there again: a test's
    teardown (tests/conftest.py), after it stopped its daemon with jobs still running."""
    containment = Containment(state_dir)
    return [pid for cg in containment.stale(()) for pid in containment.end(cg)]


__all__ = ["CONTAINMENT_MODES", "Containment", "ContainmentUnavailable", "JobCgroup", "mounts", "own_cgroups",
           "own_dirs", "subtree_name", "subtrees", "sweep"]
