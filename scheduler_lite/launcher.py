"""Starts job processes, notices their exits, stops them; finds them again after a daemon restart.

Each job runs in its own session and process group (a Ctrl-C on the daemon's terminal does not
reach it, and a cancel reaches all of its children), under a small wrapper that records how the
command ended in `<job dir>/exit_status` (format below): a job that ends while the daemon is down
still leaves its status, and the time it ended, behind. stdout and stderr go to `stdout.log` /
`stderr.log` in the job directory.

The wrapper is a few lines of Python (`-I -S`: nothing of the job's environment or site-packages
changes it) run by the daemon's interpreter, or by /usr/bin/python3 when the job's user cannot run
that one (a virtualenv under /root); it waits for the command with waitpid, so a command killed by
signal N and one that exited with status 128+N are told apart. When no interpreter the user can
run is found, a /bin/sh wrapper does the same job but cannot tell those two apart (`$?` is 128+N
for both): it writes the legacy format and re-raises the signal for 129..159.

`exit_status` holds one line: `exit N` (the command exited with status N) or `signal N` (it was
killed by signal N). A bare number `N` is the legacy format (the /bin/sh wrapper, wrappers started
before an upgrade, cluster mode's worker tasks): 129..159 reads as signal N - 128, as the shell
reports a signal. Its modification time is when the job ended.

A process is identified by (pid, start time in clock ticks since boot, from /proc/<pid>/stat), so a
pid reused by an unrelated process after a reboot or a long outage is not mistaken for the job,
and by the launch token in the wrapper's command line (`scheduler-lite:<job id>:<token>`), which
the daemon records before it starts the process: a restart that finds no pid recorded and no pid
file yet can still find the process (`find`), so it never starts the job a second time. The
processes a job leaves behind carry its job directory in their environment
(`SCHEDULER_LITE_JOB_DIR`): what is left of a job that ended while the daemon was down is found by
that and by its process group (`kill_leftovers`), never by a group id alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from scheduler_lite.isolation import JobUser, read_job_file, small_int
from tf_antman.protocol import ProtocolError

EXIT_STATUS_FILE: Final = "exit_status"
PID_FILE: Final = "pid"  # the wrapper's pid, written first: found again if the daemon dies mid-launch
STDOUT_FILE: Final = "stdout.log"
STDERR_FILE: Final = "stderr.log"
PROGRAM_PREFIX: Final = "scheduler-lite:"  # every wrapper's $0 starts with it (process_name)
JOB_DIR_VARIABLE: Final = "SCHEDULER_LITE_JOB_DIR"  # in the environment of every process of a job
# Interpreters tried for the wrapper of a job that runs as another user (the first it can run).
WRAPPER_PYTHONS: Final = (sys.executable, "/usr/bin/python3")
# Popen returns once execve has closed the child's close-on-exec descriptors, before the kernel
# has put the new program's arguments in place: until then /proc/<pid>/cmdline reads empty (for
# milliseconds, longer on a loaded machine). `adopt` waits up to this long for the command line
# of a live process before it judges by it (without the wait, a restart right after a launch took
# the job for a reused pid, recorded it as ended and SIGKILLed it as its own leftover).
EXEC_GRACE_S: Final = 5.0
_PF_KTHREAD: Final = 0x00200000  # in the flags of /proc/<pid>/stat: a kernel thread (never a command line)

# The wrapper (Python 3.6+: /usr/bin/python3 may be old). argv: -c, its name, the command. It
# catches SIGTERM/SIGINT/SIGHUP (the command still gets them: a cancel signals the whole group;
# caught signals are reset to their default by exec) so that it outlives the command, records how
# it ended and then ends the same way (dies of the same signal, without a core dump of its own),
# which its parent sees as usual. The command gets the environment the wrapper was started with
# (/proc/self/environ: Python may have added LC_CTYPE to its own, PEP 538), SIGPIPE and SIGXFSZ at
# their defaults (Python ignores them; exec would keep that), and enters SCHEDULER_LITE_WORKDIR
# (set for a job of another user: see Launcher.start) as its user; if it cannot, it fails as a
# shell would (2: no such directory, 127: no such command, 126: not executable). The status goes
# to a temporary file first and is renamed, so a reader never sees a half-written line. No
# comments inside: the code is the wrapper's command line, shown by `ps`.
_PY_WRAPPER: Final = r"""
import errno, os, signal, sys
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda *_: None)
d = os.environ["SCHEDULER_LITE_JOB_DIR"]
def put(name, text):
    try:
        with open(os.path.join(d, "." + name + ".tmp"), "w") as f:
            f.write(text)
        os.rename(os.path.join(d, "." + name + ".tmp"), os.path.join(d, name))
    except OSError:
        pass
put("pid", "%d\n" % os.getpid())
try:
    with open("/proc/self/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
except OSError:
    env = os.environ
argv, work = sys.argv[2:], os.environ.get("SCHEDULER_LITE_WORKDIR")
child = os.fork()
if child == 0:
    code = 2
    try:
        for s in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)
        if work:
            os.chdir(work)
        code = 127
        os.execvpe(argv[0], argv, env)
    except BaseException as e:
        code = 126 if code == 127 and getattr(e, "errno", None) != errno.ENOENT else code
        what = "run %s" % argv[0] if code > 2 else "enter %s" % work
        sys.stderr.write("scheduler-lite: cannot %s: %s\n" % (what, getattr(e, "strerror", None) or e))
        sys.stderr.flush()
    os._exit(code)
while True:
    try:
        status = os.waitpid(child, 0)[1]
        break
    except InterruptedError:
        pass
sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
put("exit_status", "signal %d\n" % sig if sig else "exit %d\n" % os.WEXITSTATUS(status))
if sig:
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), sig)
os._exit(128 + sig if sig else os.WEXITSTATUS(status))
"""
# The fallback: "$@" runs the command without a shell parsing it; the legacy exit_status format.
_SH_WRAPPER: Final = (
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
    # When it ended, where the wrapper's exit_status file tells (its modification time); None:
    # when the daemon noticed (it watched the job end).
    ended_at: float | None = None


def describe_exit(code: int | None, *, ran: bool = True) -> str:
    """How a job ended, for people; `ran=False`: it never ran (cancelled while queued, rejected)."""
    if not ran:
        return "never ran"
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
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if len(argv) < 4 or not argv[3].startswith(PROGRAM_PREFIX.encode()):
                continue  # /bin/sh -c <wrapper> <name> ...
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            leader = os.getpgid(pid) == pid
        except OSError:
            continue
        if leader and any(v.startswith(prefix) for v in environ):
            out.append((pid, argv[3].decode(errors="replace")))
    return out


def _pids() -> list[int]:
    """The pids in /proc now."""
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _cmdline(pid: int) -> bytes | None:
    """/proc/<pid>/cmdline, None if it cannot be read (gone). Empty for a process inside execve
    (see EXEC_GRACE_S), a kernel thread, or one whose memory is already released as it exits."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def has_name(pid: int, name: str) -> bool:
    """The process's command line carries `name` (`process_name`: a wrapper's job and launch token)."""
    cmdline = _cmdline(pid)
    return cmdline is not None and name.encode() in cmdline.split(b"\0")[:5]


def _shows(pid: int, start_ticks: int | None, name: str) -> bool:
    """`has_name(pid, name)`, once `pid` (the process started at `start_ticks`, when given) is not
    inside execve: its command line is in place, or it is gone, a zombie, a kernel thread, or
    EXEC_GRACE_S passed."""
    deadline = time.monotonic() + EXEC_GRACE_S
    while True:
        fields = _proc_stat(pid)
        if (fields is None or fields[0] == "Z" or int(fields[6]) & _PF_KTHREAD
                or (start_ticks is not None and int(fields[19]) != start_ticks)
                or _cmdline(pid) != b"" or time.monotonic() >= deadline):
            return has_name(pid, name)
        time.sleep(0.01)


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat); None if gone."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])


def _child_exited(pid: int) -> bool | None:
    """Whether our child `pid` has exited, without reaping it (it stays a zombie, holding its
    group id); None when it is not waitable (already reaped)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return None


def _kill_group(pgid: int) -> None:
    """SIGKILL a group whose leader is an unreaped zombie: the id cannot belong to anyone else."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
        env[JOB_DIR_VARIABLE] = str(spec.job_dir)
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
                    [*wrapper_command(spec.user), process_name(spec.job_id, spec.token), *spec.command],
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
        another process reads as the job having ended. A live process whose command line is
        still empty (inside execve) is waited for, up to EXEC_GRACE_S.
        """
        name = process_name(job_id, token) if token else ""
        if name and start_ticks is None:
            if not _shows(pid, None, name):
                return _recorded(job_dir)
            start_ticks = process_start_ticks(pid)
        handle = ProcessHandle(pid, start_ticks, job_dir)
        ended = self.poll(handle)
        # Recorded right after Popen returned, its command line may not be in place yet.
        if ended is None and name and not _shows(pid, start_ticks, name):
            return _recorded(job_dir)
        return handle if ended is None else ended

    @staticmethod
    def find(job_id: str, token: str) -> int | None:
        """The pid of a live process started with this launch token, if any (scans /proc)."""
        name = process_name(job_id, token)
        return next((pid for pid in _pids() if has_name(pid, name) and process_running(pid, None)), None)

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        """None while the process runs; how it ended otherwise (reaps it if it is our child)."""
        if handle.popen is not None:
            if handle.popen.returncode is None:
                exited = _child_exited(handle.pid)
                if exited is False:
                    return None
                if exited:
                    _kill_group(handle.pid)  # before the reap (`cleanup` says why)
            code = handle.popen.poll()
            if code is None:
                return None
            # Our child: the daemon watched it end (now), its status is exact.
            return ExitInfo(_recorded(handle.job_dir, code).exit_code)
        fields = _proc_stat(handle.pid)
        if fields is not None and (handle.start_ticks is None or int(fields[19]) == handle.start_ticks):
            if fields[0] != "Z":
                return None
            # A zombie: our child from an earlier Launcher of this process (tests, library use),
            # which no one watched end: when, its exit_status file tells. Its group goes first,
            # while the zombie still holds the group's id.
            _kill_group(handle.pid)
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(handle.pid, os.WNOHANG)
                return _recorded(handle.job_dir, os.waitstatus_to_exitcode(status))
        return _recorded(handle.job_dir)

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
        killed = False
        while (ended := self.poll(handle)) is None:
            if time.monotonic() >= deadline:
                killed = self.signal(handle, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(poll_s)
        self.cleanup(handle)
        return after_sigkill(ended, killed)

    @staticmethod
    def cleanup(handle: ProcessHandle) -> None:
        """SIGKILL what is left of an ended job's group (children it left behind, holding memory).

        A group id is free for the kernel to give away once its last member is gone, so a bare
        killpg after the leader was reaped could hit an unrelated group, as root: a job's user
        who empties the group and steers the pid counter gets another user's new session killed
        (a security review did). Our child's group was killed by `poll` while the leader was an
        unreaped zombie (the id still taken); a process adopted after a restart is not our child
        (init reaps it at once), so what is left of it is found by its marker and start time
        (`kill_leftovers`), never by the id alone.
        """
        if handle.popen is None:
            Launcher.kill_leftovers(handle.job_dir, handle.pid, handle.start_ticks)

    @staticmethod
    def kill_leftovers(job_dir: Path, pgid: int | None, not_before_ticks: int | None) -> list[int]:
        """SIGKILL what is left of a job that ended while no daemon watched it; returns the pids.

        `cleanup` kills a watched job's group right after its leader ended. Here the group may
        have emptied since and the kernel given its id to an unrelated process: the group id is
        not enough. A process is the job's if it carries the job's directory in its environment
        (JOB_DIR_VARIABLE, set for the wrapper and inherited by what it starts), is in the job's
        group `pgid` (any group when the wrapper's pid is unknown) and started no earlier than
        the wrapper (`not_before_ticks`, its start time, when known). One that cleared its
        environment is not found.
        """
        marker = f"{JOB_DIR_VARIABLE}={job_dir}".encode()
        killed = []
        for pid in _pids():
            fields = _proc_stat(pid)  # fields[2]: the process group
            if fields is None or fields[0] == "Z" or (pgid is not None and int(fields[2]) != pgid):
                continue
            start = int(fields[19])
            if not_before_ticks is not None and start < not_before_ticks:
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ and signal_if(pid, signal.SIGKILL,
                                               lambda pid=pid, start=start: process_start_ticks(pid) == start):
                killed.append(pid)
        return killed


def wrapper_command(user: JobUser | None) -> list[str]:
    """The wrapper's argv up to its name: Python where the job's user can run an interpreter,
    else /bin/sh (which cannot tell a signal from an exit status 128+N; module docstring)."""
    python = sys.executable if user is None else _python_for(user)
    return ["/bin/sh", "-c", _SH_WRAPPER] if not python else [python, "-ISc", _PY_WRAPPER]


@functools.cache
def _python_for(user: JobUser) -> str | None:
    """The first of WRAPPER_PYTHONS that `user` can run (None: the /bin/sh wrapper), tried once per
    user: an interpreter in a virtualenv under /root is not reachable by other users."""
    return next((p for p in WRAPPER_PYTHONS if p and _runs_as(p, user)), None)


def _runs_as(python: str, user: JobUser) -> bool:
    try:
        done = subprocess.run([python, "-ISc", "pass"], cwd="/", env={"PATH": "/usr/bin:/bin"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              user=user.uid, group=user.gid, extra_groups=list(user.gids), timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def after_sigkill(ended: ExitInfo, sigkill_sent: bool) -> ExitInfo:
    """`ended`, an unknown status read as SIGKILL where SIGKILL went to the job's group: the
    wrapper records every end it outlives (it catches SIGTERM, SIGINT, SIGHUP), SIGKILL kills it
    too. Without this a job the daemon killed after a restart (not its child) read as unknown."""
    return ExitInfo(-signal.SIGKILL, ended.ended_at) if sigkill_sent and ended.exit_code is None else ended


def signal_if(pid: int, sig: int, still: Callable[[], bool]) -> bool:
    """`sig` to `pid` if `still()` (it is still the process meant: its start time, its cgroup),
    through a pidfd taken before the check: a pid reused by another process meanwhile is never
    hit. Without pidfds (Linux < 5.3): check, then signal."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:
        fd = None
    try:
        if not still():
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:  # gone (or left what `still` checks) meanwhile
        return False
    finally:
        if fd is not None:
            os.close(fd)


def read_exit(job_dir: Path) -> ExitInfo | None:
    """How the wrapper recorded the job's end in `exit_status` (formats: the module docstring),
    with when (the file's modification time); None when there is no such file, an unknown status
    when it cannot be read (the job's user writes it: read as isolation.read_job_file reads, a
    link or worse planted there refused: it ended, how is not told) or parsed."""
    try:
        found = read_job_file(job_dir / EXIT_STATUS_FILE, any_owner=True)
    except (ProtocolError, OSError):
        return ExitInfo(None)
    if found is None:
        return None
    words, mtime = found[0].split(), found[1]
    n = small_int(words[-1]) if len(words) in (1, 2) else None
    match words:
        case ["exit", _] if n is not None and 0 <= n <= 255:
            return ExitInfo(n, mtime)
        case ["signal", _] if n is not None and 0 < n < 128:
            return ExitInfo(-n, mtime)
        case [_] if n is not None:
            # The shell's 128+N for a command killed by signal N, as the /bin/sh wrapper wrote
            # it: as a signal, the way Popen reports the wrapper that re-raised it (-N).
            return ExitInfo(-(n - 128) if 128 < n < 160 else n, mtime)
    return ExitInfo(None, mtime)


def _recorded(job_dir: Path, code: int | None = None) -> ExitInfo:
    """How a job that is gone ended: `code` (its wait status, None: not known) unless that is an
    exit status and its exit_status file records one (the wrapper's exact word: a signal is told
    from an exit 128+N there); when, as the file tells."""
    found = read_exit(job_dir) or ExitInfo(None)
    if code is not None and (code < 0 or found.exit_code is None):
        return ExitInfo(code, found.ended_at)
    return found
