"""Processes of the benches that start jobs on a GPU (bench/gpu/check.py, bench/gpu_colocate.py),
run so that none can outlive the bench: each child in its own session (its own process group),
killed whole at its timeout; a child's JSON line, exit status and error text kept for the bench's
record whatever happened. Every child group started here is listed until its leader is reaped,
and on any exit of the bench (a normal one, an exception, SIGTERM or SIGINT: a device call's time
limit, Ctrl-C) every listed group is SIGKILLed, then every process still descended from the bench
(/proc: jobs that a scheduler_lite daemon inside the bench started in sessions of their own, and
their children), so that none is left loading a GPU. A process that left both (a daemon that
double-forked to init) is out of reach; the benches start none."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SKIP = 77  # a binary's "no device": exit status of the skip convention
ERROR_TAIL = 1500  # characters of a failed binary's stderr kept in the JSON line
MARGIN_S = 5.0  # of --budget, kept for stopping processes and printing the line
KILL_WAIT_S = 10.0  # at most this long for a SIGKILLed process to be reaped (uninterruptible sleep)

# Process groups of the children started by start_child() whose leader is not reaped yet (a group id
# cannot have been reused while its leader is unreaped). Changed only in the main thread.
_live: set[int] = set()
_starting = False  # inside start_child(): a signal then waits for the new child to be listed
_stop_signal: int | None = None  # the first stop signal received
_pending: int | None = None  # a stop signal that came inside start_child(), handled on its way out
_raise_on_stop = False  # install_stop_handlers(raise_in_main=True): finally blocks run first
_on_stop: Callable[[int], None] | None = None


class Stopped(SystemExit):
    """Raised in the main thread by SIGTERM / SIGINT when the bench asked for it (its finally
    blocks then stop what they started); exit status 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def kill_all() -> None:
    """SIGKILL to every process descended from this one (with its group), then to every listed
    child group (at exit, on SIGTERM / SIGINT). The tree first, while it is whole: a child killed
    first would leave its own children (a daemon's jobs, in sessions of their own) to init."""
    kill_tree()
    for pgid in list(_live):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def descendants(root: int | None = None) -> list[int]:
    """Process ids descended from `root` (default: this process), read from /proc; [] where
    there is no /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(root: int | None = None) -> list[int]:
    """SIGKILLs every descendant of `root` (default: this process) and its process group (never
    this process's own group), all listed before the first signal; twice, for children forked
    while the first pass ran. Returns the pids signalled."""
    own = os.getpgrp()
    hit: list[int] = []
    for _ in range(2):
        for pid in descendants(root):
            try:
                pgid = os.getpgid(pid)
                if pgid != own:
                    os.killpg(pgid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
                hit.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return hit


def _stop_now(signum: int) -> None:
    if _raise_on_stop:
        raise Stopped(signum)
    kill_all()
    if _on_stop is not None:
        try:
            _on_stop(signum)
        except Exception:  # noqa: BLE001, S110 - nothing may keep the bench from exiting
            pass
    os.write(2, f"bench: stopped by {signal.Signals(signum).name}: child processes killed\n".encode())
    os._exit(128 + signum)


def _on_signal(signum: int, _frame: object) -> None:
    global _stop_signal, _pending
    if _stop_signal is not None:  # already stopping (a second signal during the clean-up)
        return
    _stop_signal = signum
    if _starting:
        _pending = signum
    else:
        _stop_now(signum)


def install_stop_handlers(raise_in_main: bool = False,
                          on_stop: Callable[[int], None] | None = None) -> None:
    """SIGTERM and SIGINT stop the bench; a normal exit kills what is left too (atexit).
    Default: every child group and descendant is SIGKILLed at once, `on_stop(signum)` runs (it
    may write a last record), and the process ends with 128 + the signal. `raise_in_main`:
    Stopped is raised in the main thread instead, so that the bench's finally blocks stop what
    they started (a daemon's jobs, with a grace) before it exits; atexit then kills what is left."""
    global _raise_on_stop, _on_stop
    _raise_on_stop = raise_in_main
    _on_stop = on_stop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    atexit.register(kill_all)


def start_child(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen in a new session (its own process group), listed until reaped (see forget)."""
    global _starting, _pending
    _starting = True
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        _live.add(proc.pid)
        return proc
    finally:
        _starting = False
        if _pending is not None:  # a signal came while the child was being started
            signum, _pending = _pending, None
            _stop_now(signum)


def forget(proc: subprocess.Popen) -> None:
    """Unlists a child once it is reaped (its group id may then be reused)."""
    if proc.returncode is not None:
        _live.discard(proc.pid)


class BenchError(RuntimeError):
    pass


class Budget:
    """The whole command's wall-time allowance: every process gets at most what is left of it,
    less `margin` s kept for stopping processes and writing the last record."""

    def __init__(self, seconds: float, margin: float = MARGIN_S) -> None:
        self.seconds = seconds
        self.margin = margin
        self.start = time.monotonic()
        self.end = self.start + seconds

    def timeout(self, cap: float, what: str) -> float:
        left = self.end - self.margin - time.monotonic()
        if left < min(1.0, self.margin):
            raise BenchError(f"{what}: not run, --budget spent")
        return min(cap, left)

    def left(self) -> float:
        """Seconds left of the whole allowance (the margin included)."""
        return self.end - time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.start


def describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def tail(text: str, n: int = ERROR_TAIL) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def run_captured(cmd: list[str], timeout: float, env: dict[str, str] | None = None
                 ) -> tuple[int | None, str, str]:
    """Runs `cmd` in its own process group; (exit status or None if killed at `timeout`, stdout,
    stderr). The whole group is killed at the timeout, so a child holding the pipes cannot hang
    the bench."""
    proc = start_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                       env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            out, err = proc.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            # Something that left the group (a session of its own) still holds the pipes: the
            # output is given up rather than waited for.
            try:
                proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            return None, "", "(output lost: a process outside its group kept its pipes open)"
        return None, out, err
    finally:
        forget(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's descendants (those in sessions of their own too), then its group."""
    if proc.poll() is None:  # not reaped: its pid is still its own
        kill_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


def wait_ready(opp: subprocess.Popen, timeout: float) -> str | None:
    """The opportunist's first stdout line, or None if it printed none within `timeout` s (a
    thread reads it: a stuck process cannot hang the bench)."""
    lines: queue.Queue[str] = queue.Queue()
    assert opp.stdout is not None
    stdout = opp.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return None


def stop_opportunist(opp: subprocess.Popen, stuck: bool, grace: float) -> str | None:
    """SIGTERM to its process group (it then prints its line and exits 0), SIGKILL if it is still
    there `grace` s later (the caller keeps that inside --budget); SIGKILL at once if it is
    `stuck` (never printed READY). Signals go to the group only while its leader is not reaped
    (its id cannot have been reused). None once it is reaped; else (not reaped KILL_WAIT_S after
    SIGKILL: uninterruptible sleep) what is left, for the JSON line."""
    if opp.poll() is not None:
        forget(opp)
        return None
    if not stuck and grace > 0:
        try:
            os.killpg(opp.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            opp.send_signal(signal.SIGTERM)
        try:
            opp.wait(grace)
            forget(opp)
            return None
        except subprocess.TimeoutExpired:
            pass
    kill_group(opp)
    try:
        opp.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        note = f"pid {opp.pid} not ended {KILL_WAIT_S:.0f} s after SIGKILL (left running)"
        sys.stderr.write(f"bench/gpu: opportunist: {note}\n")
        return note
    forget(opp)
    return None
