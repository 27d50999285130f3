"""The node host: one per node, a Ray actor pinned there; it starts and watches that node's jobs.

It holds no policy. The cluster's job host (scheduler_lite.cluster.host, in the global scheduler)
tells it what to start and which control.json to write; it answers with what its jobs report
(`report`: exits, stats.json). Everything that touches a job's process or files is done by the
single-machine daemon's own job host, a `LocalJobHost` (scheduler_lite.jobhost) on the job's
node: its launcher (wrapper, pid file, exit status, launch token), the job environment, the job
directory, its stats.json and control.json.

A job on several nodes (a gang its tenant lets span nodes) has one *part* per node: a process
with that node's GPUs, rank `r`, and the launch token `<token>.<r>`, so every part is found again
by its own token after a restart even when several "nodes" share one machine (tests).

Fencing: a node host that hears nothing from the global scheduler for `fence_s` (half of
`cluster.node_timeout_s`) stops its jobs: by then the global scheduler, which declares a silent
node lost after `node_timeout_s`, may requeue them elsewhere, and a job must never run twice.
Every call of the global scheduler checks the silence before it acts (`_called`), so a node host
that was frozen (SIGSTOP, a stalled VM) fences its jobs before it answers, whichever of its
threads runs first. The parts it fenced are remembered with their launch tokens: reported once
(`report`), and told to a global scheduler that restarts (`info`), so that a job stopped while no
scheduler ran is requeued, not recorded as ended, and a late report never touches a later launch.
`sweep` stops processes of this node's jobs that the global scheduler no longer counts as
running (left behind by a node host that died while its node lived).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from scheduler_lite.cluster.booking import RELEASED_FILE, TASK_CLAIM_TIMEOUT_S, is_ray_task, task_env
from scheduler_lite.cluster.config import FENCE_FRACTION
from scheduler_lite.cluster.parts import part_token
from scheduler_lite.config import Config
from scheduler_lite.isolation import read_job_stats, read_log, read_small_int
from scheduler_lite.jobenv import job_environment
from scheduler_lite.jobhost import LocalJobHost, control_file_seq
from scheduler_lite.launcher import (
    EXIT_STATUS_FILE,
    PID_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    ExitInfo,
    ProcessHandle,
    process_name,
    process_running,
    process_start_ticks,
    read_exit,
    wrappers_under,
)
from scheduler_lite.model import Gpu
from scheduler_lite.storage import JobRecord
from tf_antman.protocol import Control, ProtocolError, Stats, write_control

log = logging.getLogger("scheduler_lite.cluster")

FENCED_KEPT: Final = 1000  # fenced parts remembered for a restarting global scheduler (the newest)

@dataclass(frozen=True, slots=True)
class PartReport:
    """What one job part on this node looks like now."""

    exit: ExitInfo | None  # None while it runs
    stats: Stats | None
    stats_error: str | None


@dataclass(frozen=True, slots=True)
class NodeReport:
    node: str
    host_pid: int
    parts: dict[str, PartReport] = field(default_factory=dict)  # job id -> its part here
    utilisation: dict[int, float] | None = None  # local GPU id -> reading (NVML); None: emulated
    fenced: tuple[tuple[str, str], ...] = ()  # (job id, part token) fenced since the last report (module docstring)


@dataclass(slots=True)
class _Booking(ProcessHandle):
    """A Ray task's booking (scheduler_lite.cluster.tasks): Ray starts the process, not this node
    host. `pid` is 0 until the task claims the booking (its pid file); `env` is what the task must
    run with; `booked_at` bounds the wait for that claim."""

    job_id: str = ""
    env: dict[str, str] = field(default_factory=dict)
    booked_at: float = 0.0


@dataclass
class _Part:
    job_id: str
    token: str
    uid: int | None
    handle: ProcessHandle  # a _Booking for a Ray task: _BookedTasks runs its verbs, not the launcher
    ended: ExitInfo | None = None


class _BookedTasks:
    """The local host's process verbs (poll, signal, stop, cleanup) for Ray tasks' bookings."""

    def poll(self, b: _Booking) -> ExitInfo | None:
        """A Ray task's end: its recorded exit status, its process gone, or no claim in time."""
        if b.pid == 0:
            pid = read_small_int(b.job_dir / PID_FILE)
            if pid is not None:  # claimed: the task's process wrote its pid
                b.pid, b.start_ticks = pid, process_start_ticks(pid)
            elif (b.job_dir / RELEASED_FILE).exists():  # cancelled before any task claimed it
                return ExitInfo(None)
            elif time.monotonic() - b.booked_at > TASK_CLAIM_TIMEOUT_S:
                log.warning("%s: no Ray task claimed its booking in %.0f s: released", b.job_id,
                            TASK_CLAIM_TIMEOUT_S)
                self.release(b)
                return ExitInfo(None)
        if (b.job_dir / EXIT_STATUS_FILE).exists():
            return read_exit(b.job_dir)
        # Its worker died (killed, crashed): not the same pid and start time (a start time not read
        # means it was gone already), or a zombie (its parent, the raylet, reaps it; it runs nothing).
        if b.pid != 0 and (b.start_ticks is None or not process_running(b.pid, b.start_ticks)):
            return read_exit(b.job_dir) or ExitInfo(None)
        return None

    @staticmethod
    def release(b: _Booking, sig: int | None = None) -> None:
        """No Ray task may run under this booking any more: marked released (a task that starts
        later refuses to run), and its process, if it runs, gets `sig` (the process alone: a Ray
        worker shares its process group with the raylet's other workers)."""
        with contextlib.suppress(OSError):
            (b.job_dir / RELEASED_FILE).write_text("released\n")
        pid = read_small_int(b.job_dir / PID_FILE) if b.pid == 0 else b.pid
        if sig is not None and pid is not None and pid > 1:
            if b.start_ticks is None or process_start_ticks(pid) == b.start_ticks:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def signal(self, b: _Booking, sig: int) -> bool:
        if self.poll(b) is not None:
            return False
        self.release(b, sig)
        return True

    def stop(self, b: _Booking, grace_s: float) -> ExitInfo:
        self.signal(b, signal.SIGTERM)  # released, and its process told, unless it has ended
        deadline = time.monotonic() + grace_s
        while (ended := self.poll(b)) is None and b.pid != 0:
            if time.monotonic() >= deadline:
                self.release(b, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.02)
        self.release(b)
        return ended or ExitInfo(None)

    def cleanup(self, b: _Booking) -> None:
        self.release(b)  # the worker is Ray's: it ends by itself (max_calls=1)


_TASKS: Final = _BookedTasks()


class NodeHost:
    """The node host's logic, usable without Ray (unit tests); `Nodes` makes it the Ray actor."""

    def __init__(self, node: str, config: Config, fence: bool = True) -> None:
        assert config.cluster is not None
        self.node = node
        self.config = config
        self.jobs_dir = config.cluster.node_jobs_dir(config.state_dir, node)
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        # This node's jobs, as the single-machine daemon runs its own: every process and file of
        # a part goes through it (its launcher, job directories, control.json, exit status).
        self.local = LocalJobHost(config, jobs_dir=self.jobs_dir)
        self.parts: dict[str, _Part] = {}
        self.fence_s = config.cluster.node_timeout_s * FENCE_FRACTION
        self._contact = time.monotonic()
        self._lock = threading.Lock()
        self._fenced: dict[str, str] = {}  # job id -> part token of the parts fencing killed (FENCED_KEPT)
        self._fenced_unreported: list[tuple[str, str]] = []  # of those, not in a report yet
        if fence:
            threading.Thread(target=self._fence_loop, name="fence", daemon=True).start()

    # -- identity ---------------------------------------------------------------------------------

    def info(self) -> dict[str, object]:
        """Who answers, the node's GPUs with their local ids, the parts it runs and the parts it
        fenced (job id -> part token: a restarting global scheduler requeues those jobs)."""
        with self._called():
            return {"node": self.node, "hostname": socket.gethostname(), "pid": os.getpid(),
                    "jobs_dir": str(self.jobs_dir), "gpus": list(self.local.devices.inventory()),
                    "parts": sorted(self.parts), "fenced": dict(self._fenced)}

    @contextlib.contextmanager
    def _called(self) -> Iterator[None]:
        """A call of the global scheduler, under the lock: fence first if it has been silent for
        `fence_s` (a frozen node host that resumes must not act on jobs the scheduler may have
        requeued), then its silence starts again."""
        with self._lock:
            self._fence_if_silent()
            self._contact = time.monotonic()
            yield

    # -- jobs -------------------------------------------------------------------------------------

    def start(self, record: JobRecord, rank: int, gpus: list[Gpu], limit: int, share: float,
              extra_env: dict[str, str]) -> tuple[int, int | None, str]:
        """Start the job's part on this node's `gpus` (local ids): (pid, start ticks, job dir). A
        Ray task is booked instead (pid 0): no process is started (Ray starts it), its environment
        is kept for the client (`task_options`)."""
        assert record.launch_token is not None
        with self._called():
            self._fenced.pop(record.id, None)  # a new launch: the old one's fencing is settled
            job_dir = self.local.prepare_dir(record.id, record.uid)
            token = part_token(record.launch_token, rank)
            handle: ProcessHandle
            if is_ray_task(record.command):
                env = job_environment(self.config, record, gpus, limit, share, job_dir, base={})
                handle = _Booking(0, None, job_dir, job_id=record.id, env=task_env({**env, **extra_env}),
                                  booked_at=time.monotonic())
            else:
                handle = self.local.launch(record, gpus, limit, share, job_dir, token, extra_env)
            self.parts[record.id] = _Part(record.id, token, record.uid, handle)
            return handle.pid, handle.start_ticks, str(job_dir)

    def task_options(self, job_id: str) -> dict[str, str] | None:
        """The environment of a booked Ray task (the client's half of `start`); None if this
        node holds no such booking (not made yet, or released)."""
        with self._lock:
            part = self.parts.get(job_id)
            if part is None or not isinstance(part.handle, _Booking) or part.ended is not None:
                return None
            return dict(part.handle.env)

    def _via(self, part: _Part) -> Any:
        """Who runs the part's process verbs: the local host, or _BookedTasks for a Ray task."""
        return _TASKS if isinstance(part.handle, _Booking) else self.local

    def report(self) -> NodeReport:
        """Exits and the latest stats.json of every part here (one call per node per tick)."""
        with self._called():
            out: dict[str, PartReport] = {}
            for job_id, part in self.parts.items():
                if part.ended is None:
                    part.ended = self._via(part).poll(part.handle)
                stats, error = None, None
                try:
                    stats = read_job_stats(part.handle.job_dir, part.uid)
                except (ProtocolError, OSError) as e:
                    error = str(e)
                out[job_id] = PartReport(part.ended, stats, error)
            util = None
            if self.local.devices.kind != "emulated":
                util = self.local.devices.utilisation({})
            fenced, self._fenced_unreported = tuple(self._fenced_unreported), []
            return NodeReport(self.node, os.getpid(), out, util, fenced)

    def signal(self, job_id: str, sig: int) -> bool:
        with self._called():
            part = self.parts.get(job_id)
            return part is not None and bool(self._via(part).signal(part.handle, sig))

    def stop(self, job_id: str, grace_s: float) -> ExitInfo | None:
        """SIGTERM, SIGKILL after grace_s, wait; the part is forgotten. None: no such part here."""
        with self._called():
            part = self.parts.pop(job_id, None)
        if part is None:
            # Processes of the job here that this node host does not hold (a sweep kept them for
            # an adoption that did not follow, a node host before this one started them): a stop
            # means nothing of the job runs here afterwards.
            self._kill_wrappers(lambda name: name.split(":")[1] != job_id)
            return None
        return self._via(part).stop(part.handle, grace_s)

    def _kill_wrappers(self, keep: Callable[[str], bool]) -> list[str]:
        """SIGKILL the process groups of the wrappers under this node's jobs directory whose name
        (launcher.process_name) `keep` refuses; the ids of their jobs."""
        killed = []
        for pid, name in wrappers_under(self.jobs_dir):
            if not keep(name):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                killed.append(name.split(":")[1])
        return killed

    def _kill(self, part: _Part) -> None:
        """SIGKILL the part, whatever runs it (a Ray task: its booking released too)."""
        self._via(part).signal(part.handle, signal.SIGKILL)
        self._via(part).cleanup(part.handle)

    def cleanup(self, job_id: str) -> None:
        """The global scheduler recorded the part's end: kill what it left behind, forget it."""
        with self._called():
            part = self.parts.pop(job_id, None)
            if part is not None:
                self._via(part).cleanup(part.handle)

    def write_control(self, job_id: str, control: Control) -> None:
        with self._called():
            write_control(self.local.job_dir(job_id), control)

    # -- after a restart of the global scheduler -----------------------------------------------

    def find(self, job_id: str, token: str, rank: int, uid: int | None) -> int | None:
        """The pid of the part started with this launch token: pid file, else the token (/proc).
        A Ray task booked here with this token: 0 until its process claims it."""
        with self._called():
            part = self.parts.get(job_id)
            if part is not None and isinstance(part.handle, _Booking) and part.token == part_token(token, rank):
                return part.handle.pid
        return self.local.find_launch(job_id, part_token(token, rank), uid, self.local.job_dir(job_id), named=True)

    def adopt(self, job_id: str, token: str, rank: int, uid: int | None, pid: int | None,
              start_ticks: int | None) -> tuple[int, int | None] | ExitInfo:
        """Take the part back: (pid, start ticks) while it runs, else how it ended (and when)."""
        with self._called():
            part = self.parts.get(job_id)
            if part is not None and part.token == part_token(token, rank):
                ended = part.ended or self._via(part).poll(part.handle)
                return ended if ended is not None else (part.handle.pid, part.handle.start_ticks)
        job_dir = self.local.job_dir(job_id)
        if pid is None:
            pid = self.find(job_id, token, rank, uid)
        if pid is None:
            return read_exit(job_dir) or ExitInfo(None)
        found = self.local.launcher.adopt(pid, start_ticks, job_dir, part_token(token, rank), job_id)
        if isinstance(found, ExitInfo):
            return found
        with self._lock:
            self.parts[job_id] = _Part(job_id, part_token(token, rank), uid, found)
        return found.pid, found.start_ticks

    def prepare(self, job_id: str) -> None:
        """A launch of the job here is being booked: the files an earlier launch left go first
        (JobHost.prepare says why), a Ray task's release with them."""
        with self._called():
            self.local.clear(job_id, (RELEASED_FILE,))

    def read_log(self, job_id: str, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to `limit` bytes of the part's stdout/stderr from `offset` (`scheduler-lite logs`)."""
        return read_log(self.jobs_dir / job_id / (STDERR_FILE if stderr else STDOUT_FILE), offset, limit)

    def recorded_exit(self, job_id: str) -> ExitInfo | None:
        return read_exit(self.local.job_dir(job_id))  # with when it ended, as on one machine

    def control_seq(self, job_id: str) -> int:
        return control_file_seq(self.local.job_dir(job_id))

    def sweep(self, keep: list[tuple[str, str]]) -> tuple[list[str], dict[str, str]]:
        """SIGKILL the processes of this node's jobs whose (job id, part token) is not in `keep`:
        the jobs stopped, and the parts fenced (as `info`: this call may have fenced them). Found
        by the wrapper's name and its job directory under this node's."""
        wanted = {process_name(j, t) for j, t in keep}
        stopped = []
        with self._called():
            for job_id, part in list(self.parts.items()):
                if process_name(job_id, part.token) not in wanted:
                    self._kill(part)
                    del self.parts[job_id]
                    stopped.append(job_id)
        stopped += self._kill_wrappers(wanted.__contains__)
        with self._lock:
            fenced = dict(self._fenced)
        return sorted(set(stopped)), fenced

    # -- fencing ----------------------------------------------------------------------------------

    def _fence_loop(self) -> None:
        while True:
            time.sleep(min(1.0, self.fence_s / 4))
            with self._lock:
                self._fence_if_silent()

    def _fence_if_silent(self) -> None:
        """Lock held: SIGKILL every part here if the global scheduler has been silent for
        `fence_s`, and remember them (job id -> part token) for the next report and `info`."""
        silent = time.monotonic() - self._contact
        if silent < self.fence_s or not self.parts:
            return
        log.error("%s: no word from the global scheduler for %.1f s: stopping %d job(s)",
                  self.node, silent, len(self.parts))
        for part in self.parts.values():
            self._kill(part)
            self._fenced.pop(part.job_id, None)  # to the end: the newest are kept
            self._fenced[part.job_id] = part.token
            self._fenced_unreported.append((part.job_id, part.token))
        self.parts.clear()
        for old in list(self._fenced)[:-FENCED_KEPT]:  # oldest first (insertion order)
            del self._fenced[old]
