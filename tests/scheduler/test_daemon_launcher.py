"""The launcher with real short subprocesses: exit status, captured output, groups, stop, adoption."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from scheduler_lite.isolation import job_user, prepare_job_dir
from scheduler_lite.launcher import (
    EXIT_STATUS_FILE,
    PID_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    WRAPPER_PYTHONS,
    ExitInfo,
    Launcher,
    LaunchError,
    LaunchSpec,
    ProcessHandle,
    describe_exit,
    process_name,
    process_running,
    process_start_ticks,
    read_exit,
    wrappers_under,
)
from tests.scheduler.test_daemon_fakes import wait_for


def spec(tmp_path: Path, code: str, env: dict[str, str] | None = None) -> LaunchSpec:
    return LaunchSpec("job-1", [sys.executable, "-c", code], tmp_path, {**os.environ, **(env or {})},
                      tmp_path / "job")


def wait_exit(launcher: Launcher, handle: ProcessHandle) -> ExitInfo:
    found: list[ExitInfo] = []

    def ended() -> bool:
        e = launcher.poll(handle)
        if e is not None:
            found.append(e)
        return e is not None

    assert wait_for(ended, timeout=20)
    return found[-1]


def test_runs_in_its_own_group_with_its_env_and_captures_output(tmp_path: Path) -> None:
    launcher = Launcher()
    code = ("import os, sys; print('out', os.environ['MY_VAR'], os.getpgrp()); "
            "print('err', file=sys.stderr); sys.exit(3)")
    handle = launcher.start(spec(tmp_path, code, {"MY_VAR": "hello"}))
    assert os.getpgid(handle.pid) == handle.pid  # a group of its own: a cancel reaches its children
    assert os.getpgid(handle.pid) != os.getpgrp()
    ended = wait_exit(launcher, handle)
    assert ended.exit_code == 3 and describe_exit(ended.exit_code) == "exit status 3"
    job_dir = tmp_path / "job"
    assert (job_dir / STDOUT_FILE).read_text() == f"out hello {handle.pid}\n"  # the job is in the group
    assert (job_dir / STDERR_FILE).read_text() == "err\n"
    assert (job_dir / EXIT_STATUS_FILE).read_text() == "exit 3\n"
    assert int((job_dir / PID_FILE).read_text()) == handle.pid


def test_stop_terminates_the_whole_group(tmp_path: Path) -> None:
    launcher = Launcher()
    # The job starts a grandchild; both must go.
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    handle = launcher.start(spec(tmp_path, code))
    out = tmp_path / "job" / STDOUT_FILE
    assert wait_for(lambda: out.read_text().strip() != "")
    grandchild = int(out.read_text())
    ended = launcher.stop(handle, grace_s=10)
    assert ended.exit_code == -signal.SIGTERM and describe_exit(ended.exit_code) == "killed by SIGTERM"
    assert wait_for(lambda: process_start_ticks(grandchild) is None or _is_zombie(grandchild))


def test_stop_escalates_to_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    launcher = Launcher()
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")
    # sh ignores nothing: make the wrapper ignore SIGTERM too, as a stubborn job would.
    handle = launcher.start(LaunchSpec("job-1", ["sh", "-c", f"trap '' TERM; exec {sys.executable} -c \"{code}\""],
                                       tmp_path, dict(os.environ), tmp_path / "job"))
    out = tmp_path / "job" / STDOUT_FILE
    assert wait_for(lambda: out.exists() and "ready" in out.read_text())
    ended = launcher.stop(handle, grace_s=0.3)
    assert ended.exit_code == -signal.SIGKILL


def test_adopt_finds_a_running_job_and_then_its_exit_status(tmp_path: Path) -> None:
    first = Launcher()
    handle = first.start(spec(tmp_path, "import time, sys; time.sleep(0.5); sys.exit(7)"))
    # A new launcher (the daemon restarted): no Popen, only pid + start time + job dir.
    later = Launcher()
    adopted = later.adopt(handle.pid, handle.start_ticks, tmp_path / "job")
    assert isinstance(adopted, ProcessHandle) and adopted.popen is None
    assert later.poll(adopted) is None
    ended = wait_exit(later, adopted)
    assert ended.exit_code == 7  # from the zombie's status or the wrapper's exit_status file
    handle.popen = None  # the first launcher's Popen must not be what reaped it


def test_adopt_of_a_gone_job_reads_the_status_file(tmp_path: Path) -> None:
    launcher = Launcher()
    handle = launcher.start(spec(tmp_path, "import sys; sys.exit(5)"))
    assert wait_exit(launcher, handle).exit_code == 5
    found = Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job")
    assert found == ExitInfo(5, (tmp_path / "job" / EXIT_STATUS_FILE).stat().st_mtime)  # with when it ended
    (tmp_path / "job" / EXIT_STATUS_FILE).unlink()
    assert Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job") == ExitInfo(None)


def test_a_job_killed_by_a_signal_reads_the_same_whether_watched_or_adopted(tmp_path: Path) -> None:
    """The daemon's own child reports SIGTERM as -15; after a restart only the wrapper's status
    file is left, which names the signal: both must read as the signal."""
    launcher = Launcher()
    handle = launcher.start(spec(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"))
    assert wait_exit(launcher, handle).exit_code == -signal.SIGTERM
    assert (tmp_path / "job" / EXIT_STATUS_FILE).read_text() == "signal 15\n"
    assert Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job").exit_code == -signal.SIGTERM


@pytest.mark.parametrize("status", [137, 143, 129, 159])
def test_an_exit_status_above_128_is_not_a_signal(tmp_path: Path, status: int) -> None:
    """`exit 137` is an exit status, watched or adopted; only a real signal death reads as one."""
    launcher = Launcher()
    handle = launcher.start(spec(tmp_path, f"import sys; sys.exit({status})"))
    ended = wait_exit(launcher, handle)
    assert ended.exit_code == status and describe_exit(ended.exit_code) == f"exit status {status}"
    assert (tmp_path / "job" / EXIT_STATUS_FILE).read_text() == f"exit {status}\n"
    assert Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job").exit_code == status


@pytest.mark.parametrize(("text", "code"), [
    ("exit 0\n", 0), ("exit 137\n", 137), ("signal 9\n", -signal.SIGKILL), ("signal 15\n", -signal.SIGTERM),
    # The legacy format (the /bin/sh wrapper, wrappers from before an upgrade): 128+N is signal N.
    ("0\n", 0), ("3\n", 3), ("128\n", 128), ("137\n", -signal.SIGKILL), ("160\n", 160),
    # Anything else: it ended, how is unknown.
    ("exit\n", None), ("exit 256\n", None), ("signal 0\n", None), ("signal -9\n", None), ("oops\n", None),
])
def test_exit_status_formats_new_and_legacy(tmp_path: Path, text: str, code: int | None) -> None:
    (tmp_path / EXIT_STATUS_FILE).write_text(text)
    os.utime(tmp_path / EXIT_STATUS_FILE, (1000.0, 1000.0))
    assert read_exit(tmp_path) == ExitInfo(code, 1000.0)  # with when it ended: the file's time
    assert Launcher().adopt(2**22 + 1, None, tmp_path).exit_code == code  # no such pid: gone


def test_a_job_that_never_ran_is_described_as_such() -> None:
    """`show` on a job cancelled while queued (or rejected): no exit status was ever to be had."""
    assert describe_exit(None, ran=False) == "never ran"
    assert describe_exit(None) == "exit status unknown"  # it ran; how it ended is not known
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL" and describe_exit(137) == "exit status 137"


def test_the_shell_wrapper_still_runs_jobs_where_no_python_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for a job user that can run no interpreter: the command runs, and its status
    is written in the legacy format (where 128+N cannot be told from signal N)."""
    job = spec(tmp_path, "import sys; sys.exit(3)")
    monkeypatch.setattr("scheduler_lite.launcher.sys.executable", "")
    launcher = Launcher()
    handle = launcher.start(job)
    assert _cmdline(handle.pid)[:2] == ["/bin/sh", "-c"]
    assert wait_exit(launcher, handle).exit_code == 3
    assert (tmp_path / "job" / EXIT_STATUS_FILE).read_text() == "3\n"


def test_the_command_gets_the_environment_and_signals_it_was_given(tmp_path: Path) -> None:
    """The Python wrapper adds nothing to the job: no LC_CTYPE of its own (PEP 538 coercion under
    the C locale), SIGPIPE and SIGXFSZ not ignored (Python ignores them; exec would keep that),
    its argv as given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "LANG"}
    launcher = Launcher()
    handle = launcher.start(LaunchSpec("job-1", ["sh", "-c", 'echo "${LC_CTYPE-unset}" "$@"; grep SigIgn /proc/self/status',
                                                 "sh", "a  b", "", "-c"], tmp_path, {**env, "LANG": "C"},
                                       tmp_path / "job"))
    assert wait_exit(launcher, handle).exit_code == 0
    words, ignored = (tmp_path / "job" / STDOUT_FILE).read_text().splitlines()
    assert words == "unset a  b  -c"
    mask = int(ignored.split()[1], 16)
    assert not mask & (1 << (signal.SIGPIPE - 1)) and not mask & (1 << (signal.SIGXFSZ - 1)), ignored


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd")
def test_a_job_of_another_user_gets_a_python_wrapper_that_user_can_run() -> None:
    """A root daemon's interpreter may sit where other users cannot reach it (a venv under /root):
    the wrapper then runs with one they can, and still tells an exit status from a signal."""
    name = f"slw{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", "-N", "-d", "/nonexistent", "-s", "/bin/sh", name], check=True,
                   capture_output=True)
    tmp_path = Path(tempfile.mkdtemp(prefix="sl-wrapper-", dir="/tmp"))  # pytest's is root's alone
    try:
        user = job_user(pwd.getpwnam(name).pw_uid)
        assert user is not None
        work = tmp_path / "work"
        work.mkdir()
        os.chown(work, user.uid, user.gid)
        tmp_path.chmod(0o755)
        launcher = Launcher()
        for i, (command, code) in enumerate([("id -u; pwd; exit 137", 137), ("kill -KILL $$", -signal.SIGKILL)]):
            job_dir = tmp_path / f"job-{i}"
            prepare_job_dir(job_dir, user)
            handle = launcher.start(LaunchSpec(f"job-{i}", ["sh", "-c", command], work, {"PATH": "/usr/bin:/bin"},
                                               job_dir, "t", user))
            python = _cmdline(handle.pid)[0]
            assert wait_exit(launcher, handle).exit_code == code, (job_dir / STDERR_FILE).read_text()
            assert read_exit(job_dir).exit_code == code  # type: ignore[union-attr]
        assert python != "/bin/sh" and python in WRAPPER_PYTHONS  # where one can: here, there is
        assert (tmp_path / "job-0" / STDOUT_FILE).read_text() == f"{user.uid}\n{work}\n"
    finally:
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(tmp_path)


def test_a_command_that_cannot_start_fails_like_in_a_shell(tmp_path: Path) -> None:
    launcher = Launcher()
    handle = launcher.start(LaunchSpec("job-1", ["no-such-program-here"], tmp_path, dict(os.environ),
                                       tmp_path / "job"))
    assert wait_exit(launcher, handle).exit_code == 127
    assert "no-such-program-here" in (tmp_path / "job" / STDERR_FILE).read_text()


def test_leftovers_of_a_job_that_ended_unwatched_are_killed_and_nothing_else(tmp_path: Path) -> None:
    """kill_leftovers: the job's processes in its group (they carry its job directory), not a
    process of another job, not a process of the same group id that does not carry it."""
    launcher = Launcher()
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(p.pid, flush=True)")  # leaves its child behind and exits
    handle = launcher.start(spec(tmp_path, code))
    other = launcher.start(LaunchSpec("job-2", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path,
                                      dict(os.environ), tmp_path / "job2"))
    try:
        # Ended, not yet seen by poll (which kills the group of a child it sees end): as a job
        # that ended while no daemon watched.
        assert wait_for(lambda: _is_zombie(handle.pid))
        left = int((tmp_path / "job" / STDOUT_FILE).read_text())
        assert process_running(left, None) and os.getpgid(left) == handle.pid
        assert launcher.kill_leftovers(tmp_path / "job2", handle.pid, None) == []  # not in job 2's group
        assert launcher.kill_leftovers(tmp_path / "job", handle.pid, process_start_ticks(left) + 1) == []
        assert launcher.kill_leftovers(tmp_path / "job", handle.pid, handle.start_ticks) == [left]
        assert wait_for(lambda: not process_running(left, None))
        assert wait_exit(launcher, handle).exit_code == 0
        assert launcher.poll(other) is None  # the other job runs on
    finally:
        launcher.stop(other, grace_s=1)


def test_a_watched_job_that_ends_takes_its_leftovers_with_it_before_it_is_reaped(tmp_path: Path) -> None:
    """poll kills the rest of the group while the ended leader is still a zombie (the group id
    cannot belong to anyone else then): after the reap it could."""
    launcher = Launcher()
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(p.pid, flush=True)")  # leaves its child behind and exits
    handle = launcher.start(spec(tmp_path, code))
    assert wait_exit(launcher, handle).exit_code == 0
    left = int((tmp_path / "job" / STDOUT_FILE).read_text())
    assert wait_for(lambda: process_start_ticks(left) is None or _is_zombie(left))


def test_cleanup_of_an_adopted_job_never_kills_a_group_by_its_id_alone(tmp_path: Path) -> None:
    """A security review: after a restart the job is not our child and init reaps it at once;
    its group id is free, and the job's user can steer the kernel into giving it to another
    user's new session, which a bare killpg as root then killed. Cleanup goes by the job's
    marker and start time."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ticks = process_start_ticks(victim.pid)
        assert ticks is not None
        # The job's old wrapper had this pid (and group id) and started earlier.
        Launcher.cleanup(ProcessHandle(victim.pid, ticks - 1, tmp_path / "job"))
        assert victim.poll() is None and process_running(victim.pid, ticks)
    finally:
        victim.kill()
        victim.wait()


def test_a_reused_pid_is_not_mistaken_for_the_job(tmp_path: Path) -> None:
    launcher = Launcher()
    # This test process stands in for an unrelated process that got the job's old pid.
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert ticks is not None
    found = launcher.adopt(me, ticks + 1, tmp_path)
    assert found == ExitInfo(None)
    assert isinstance(launcher.adopt(me, ticks, tmp_path), ProcessHandle)


def test_wrappers_under_lists_the_live_jobs_of_one_jobs_dir(tmp_path: Path) -> None:
    launcher = Launcher()
    code = "import time; time.sleep(60)"
    # Two stores whose jobs dirs share a prefix ("jobs" and "jobs2"), the same job id in both.
    mine = launcher.start(LaunchSpec("job-1", [sys.executable, "-c", code], tmp_path, dict(os.environ),
                                     tmp_path / "jobs" / "job-1", token="t1"))
    other = launcher.start(LaunchSpec("job-1", [sys.executable, "-c", code], tmp_path, dict(os.environ),
                                      tmp_path / "jobs2" / "job-1", token="t2"))
    try:
        # At once: the wrapper's fork about to become the command bears its name but is not listed.
        assert wrappers_under(tmp_path / "jobs") == [(mine.pid, process_name("job-1", "t1"))]
        launcher.stop(mine, grace_s=10)  # reaped: gone from /proc
        assert wrappers_under(tmp_path / "jobs") == []
        assert wrappers_under(tmp_path / "jobs2") == [(other.pid, process_name("job-1", "t2"))]
    finally:
        launcher.stop(other, grace_s=10)


def test_a_bad_workdir_is_a_launch_error(tmp_path: Path) -> None:
    bad = LaunchSpec("job-1", ["true"], tmp_path / "missing", dict(os.environ), tmp_path / "job")
    try:
        Launcher().start(bad)
    except LaunchError as e:
        assert "job-1" in str(e) and "missing" in str(e)
    else:
        raise AssertionError("no LaunchError")


def _is_zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return text[text.rindex(")") + 2] == "Z"


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
