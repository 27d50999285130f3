"""Starts job processes, notices their exits, stops them; finds them again after a daemon restart.

Each job runs in its own session and process group (a Ctrl-C on the daemon's terminal does not
reach it, and a cancel reaches all of its children), under a small /bin/sh wrapper that writes the
command's exit status to `<job dir>/exit_status`: a job that ends while the daemon is down still
leaves its status behind. stdout and stderr go to `stdout.log` / `stderr.log` in the job directory.

A process is identified by (pid, start time in clock ticks since boot, from /proc/<pid>/stat), so a
pid reused by an unrelated process after a reboot or a long outage is not mistaken for the job,
and by the launch token in the wrapper's command line (`scheduler-lite:<job id>:<token>`), which
the daemon records before it starts the process: a restart that finds no pid recorded and no pid
file yet can still find the process (`find`), so it never starts the job a second time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from scheduler_lite.isolation import JobUser, read_small_int

EXIT_STATUS_FILE: Final = "exit_status"
PID_FILE: Final = "pid"  # the wrapper's pid, written first: found again if the daemon dies mid-launch
STDOUT_FILE: Final = "stdout.log"
STDERR_FILE: Final = "stderr.log"
PROGRAM_PREFIX: Final = "scheduler-lite:"  # every wrapper's $0 starts with it (process_name)
# "$@" runs the command without a shell parsing it. The wrapper catches SIGTERM/SIGINT/SIGHUP (the
# command still gets them: a cancel signals the whole group, and caught signals are reset to their
# default in the child) so that it outlives the command, records its status and then dies of the
# same signal, which its parent sees as usual. The status goes to a temporary file first and is
# renamed, so a reader never sees a half-written number.
_WRAPPER: Final = (
    'echo "$$" > "$SCHEDULER_LITE_JOB_DIR/pid"; '
    'trap : TERM INT HUP; '
    # Jobs of other users enter their working directory as themselves (see Launcher.start).
    'if [ -n "${SCHEDULER_LITE_WORKDIR:-}" ]; then cd -- "$SCHEDULER_LITE_WORKDIR" && "$@"; else "$@"; fi; rc=$?; '
    'printf "%s\\n" "$rc" > "$SCHEDULER_LITE_JOB_DIR/.exit_status.tmp" && '
    'mv -f "$SCHEDULER_LITE_JOB_DIR/.exit_status.tmp" "$SCHEDULER_LITE_JOB_DIR/exit_status"; '
    'if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ]; then trap - TERM INT HUP; kill -"$((rc - 128))" "$$"; fi; '
    'exit "$rc"'
)


class LaunchError(RuntimeError):
    """The process could not be started (bad working directory, no /bin/sh...)."""


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    job_id: str
    command: Sequence[str]
    workdir: Path
    env: Mapping[str, str]  # the complete environment of the job
    job_dir: Path
    token: str = ""  # the launch token recorded before the start (see the module docstring)
    user: JobUser | None = None  # run as this account (root daemon only); None: as the daemon's user


@dataclass(slots=True)
class ProcessHandle:
    pid: int  # also the process group id
    start_ticks: int | None
    job_dir: Path
    popen: subprocess.Popen[bytes] | None = None  # None for a process adopted after a restart


@dataclass(frozen=True, slots=True)
class ExitInfo:
    exit_code: int | None  # None: it ended, but nobody could tell how
    # Negative: killed by that signal (as subprocess reports it).

    def describe(self) -> str:
        return describe_exit(self.exit_code)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit status {code}"


def process_name(job_id: str, token: str) -> str:
    """The wrapper's $0: names the job and its launch in `ps` and /proc/<pid>/cmdline."""
    return f"{PROGRAM_PREFIX}{job_id}:{token}" if token else f"{PROGRAM_PREFIX}{job_id}"


def wrappers_under(jobs_dir: Path) -> list[tuple[int, str]]:
    """(pid, wrapper name) of the live job wrappers whose job directory lies under `jobs_dir`
    (scans /proc). An exited wrapper not yet reaped has an empty command line: never listed. Each
    wrapper leads its own process group: the wrapper's fork that is about to become the command
    bears the wrapper's name for an instant, but not its group, and is not listed."""
    out = []
    prefix = f"SCHEDULER_LITE_JOB_DIR={jobs_dir}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if len(argv) < 4 or not argv[3].startswith(PROGRAM_PREFIX.encode()):
                continue  # /bin/sh -c <wrapper> <name> ...
            environ = (entry / "environ").read_bytes().split(b"\0")
            leader = os.getpgid(int(entry.name)) == int(entry.name)
        except OSError:
            continue
        if leader and any(v.startswith(prefix) for v in environ):
            out.append((int(entry.name), argv[3].decode(errors="replace")))
    return out


def _has_name(pid: int, name: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return name.encode() in argv[:5]


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat); None if gone."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])


def process_running(pid: int, start_ticks: int | None) -> bool:
    """`pid` runs (is not a zombie) and, when `start_ticks` is given, is the process started then."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] != "Z" and (start_ticks is None or int(fields[19]) == start_ticks)


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    return text[text.rindex(")") + 2 :].split()  # fields 3.. : state is [0], starttime is [19]


class Launcher:
    def start(self, spec: LaunchSpec) -> ProcessHandle:
        spec.job_dir.mkdir(parents=True, exist_ok=True)
        for stale in (EXIT_STATUS_FILE, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (spec.job_dir / stale).unlink()
        env = dict(spec.env)
        env["SCHEDULER_LITE_JOB_DIR"] = str(spec.job_dir)
        cwd, switch = spec.workdir, {}
        if spec.user is not None:
            # All of the account (extra_groups too: else root's groups stay). The wrapper changes
            # into the working directory as the user: a chdir made as root would give the job a
            # directory its user cannot reach.
            switch = {"user": spec.user.uid, "group": spec.user.gid, "extra_groups": list(spec.user.gids),
                      "umask": 0o022}
            cwd = Path("/")
            env["SCHEDULER_LITE_WORKDIR"] = str(spec.workdir)
        try:
            with open(spec.job_dir / STDOUT_FILE, "ab") as out, open(spec.job_dir / STDERR_FILE, "ab") as err:
                popen = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, process_name(spec.job_id, spec.token), *spec.command],
                    cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True, close_fds=True, **switch,  # type: ignore[call-overload]
                )
        except OSError as e:
            raise LaunchError(f"cannot start {spec.job_id}: {e.strerror or e} ({spec.workdir})") from None
        return ProcessHandle(popen.pid, process_start_ticks(popen.pid), spec.job_dir, popen)

    def adopt(self, pid: int, start_ticks: int | None, job_dir: Path, token: str | None = None,
              job_id: str = "") -> ProcessHandle | ExitInfo:
        """The process of a job started before a restart, or how it ended if it is gone.

        The pid must name a process with the recorded start time (when one was recorded) and
        with the launch token in its command line (when there is a token): a pid reused by
        another process reads as the job having ended.
        """
        if token and start_ticks is None:
            if not _has_name(pid, process_name(job_id, token)):
                return ExitInfo(self._status_file(job_dir, None))
            start_ticks = process_start_ticks(pid)
        handle = ProcessHandle(pid, start_ticks, job_dir)
        ended = self.poll(handle)
        if ended is None and token and not _has_name(pid, process_name(job_id, token)):
            return ExitInfo(self._status_file(job_dir, None))
        return handle if ended is None else ended

    @staticmethod
    def find(job_id: str, token: str) -> int | None:
        """The pid of a live process started with this launch token, if any (scans /proc)."""
        name = process_name(job_id, token)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _has_name(int(entry.name), name) and process_running(int(entry.name), None):
                return int(entry.name)
        return None

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        """None while the process runs; how it ended otherwise (reaps it if it is our child)."""
        if handle.popen is not None:
            code = handle.popen.poll()
            if code is None:
                return None
            return ExitInfo(code if code < 0 else self._status_file(handle.job_dir, code))
        fields = _proc_stat(handle.pid)
        if fields is not None and (handle.start_ticks is None or int(fields[19]) == handle.start_ticks):
            if fields[0] != "Z":
                return None
            # A zombie: our child from an earlier Launcher of this process (tests, library use).
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(handle.pid, os.WNOHANG)
                code = os.waitstatus_to_exitcode(status)
                return ExitInfo(code if code < 0 else self._status_file(handle.job_dir, code))
        return ExitInfo(self._status_file(handle.job_dir, None))

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        """Send `sig` to the job's whole process group; False if it is gone."""
        if self.poll(handle) is not None:
            return False
        try:
            os.killpg(handle.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def stop(self, handle: ProcessHandle, grace_s: float, poll_s: float = 0.02) -> ExitInfo:
        """SIGTERM, then SIGKILL after `grace_s`; blocks until the process has ended."""
        self.signal(handle, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while (ended := self.poll(handle)) is None:
            if time.monotonic() >= deadline:
                self.signal(handle, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(poll_s)
        self.cleanup(handle)
        return ended

    @staticmethod
    def cleanup(handle: ProcessHandle) -> None:
        """SIGKILL what is left of an ended job's group (children it left behind, holding memory).

        Only after the leader has ended: the group id cannot be reused while any member lives.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handle.pid, signal.SIGKILL)

    @staticmethod
    def _status_file(job_dir: Path, fallback: int | None) -> int | None:
        return read_exit_status(job_dir, fallback)


def read_exit_status(job_dir: Path, fallback: int | None = None) -> int | None:
    """The status the wrapper recorded in `exit_status`, or `fallback` when there is none.

    The job's user writes the file: it is read without following a link or blocking on a FIFO.
    """
    code = read_small_int(job_dir / EXIT_STATUS_FILE)
    if code is None:
        return fallback
    # The shell's 128+N for a command killed by signal N: as a signal, the way a job the daemon
    # still watches as its child reports it (the wrapper re-raises the signal; Popen gives -N).
    return -(code - 128) if 128 < code < 160 else code
