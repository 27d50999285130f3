"""The launcher with real short subprocesses: exit status, captured output, groups, stop, adoption."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

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
    process_name,
    process_start_ticks,
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
    assert ended.exit_code == 3 and ended.describe() == "exit status 3"
    job_dir = tmp_path / "job"
    assert (job_dir / STDOUT_FILE).read_text() == f"out hello {handle.pid}\n"  # the job is in the group
    assert (job_dir / STDERR_FILE).read_text() == "err\n"
    assert (job_dir / EXIT_STATUS_FILE).read_text().strip() == "3"
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
    assert ended.exit_code == -signal.SIGTERM and ended.describe() == "killed by SIGTERM"
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
    assert found == ExitInfo(5)
    (tmp_path / "job" / EXIT_STATUS_FILE).unlink()
    assert Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job") == ExitInfo(None)


def test_a_job_killed_by_a_signal_reads_the_same_whether_watched_or_adopted(tmp_path: Path) -> None:
    """The daemon's own child reports SIGTERM as -15; after a restart only the wrapper's status
    file is left, where the shell wrote 143: both must read as the signal."""
    launcher = Launcher()
    handle = launcher.start(spec(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"))
    assert wait_exit(launcher, handle).exit_code == -signal.SIGTERM
    assert (tmp_path / "job" / EXIT_STATUS_FILE).read_text() == "143\n"
    assert Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job") == ExitInfo(-signal.SIGTERM)
    for text, code in (("0\n", 0), ("3\n", 3), ("128\n", 128), ("137\n", -signal.SIGKILL), ("160\n", 160)):
        (tmp_path / "job" / EXIT_STATUS_FILE).write_text(text)
        assert Launcher().adopt(handle.pid, handle.start_ticks, tmp_path / "job") == ExitInfo(code), text


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
