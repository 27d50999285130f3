"""Running bench/gpu's binaries without letting one hang or crash the bench (run.py): each in its
own process group, killed whole at its timeout; their JSON line, exit status and error text kept
for the one JSON line run.py prints whatever happened. Every child group started here is listed
until its leader is reaped, so that run.py can kill them all when it is itself stopped (SIGTERM,
SIGINT: a device call's time limit, Ctrl-C) or exits: none is left loading a warm GPU."""

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
from typing import Any

SKIP = 77  # a binary's "no device": exit status of the skip convention (run.py)
ERROR_TAIL = 1500  # characters of a failed binary's stderr kept in the JSON line
MARGIN_S = 5.0  # of --budget, kept for stopping processes and printing the line
KILL_WAIT_S = 10.0  # at most this long for a SIGKILLed process to be reaped (uninterruptible sleep)

# Process groups of the children started by start_child() whose leader is not reaped yet (a group id
# cannot have been reused while its leader is unreaped). Changed only in the main thread.
_live: set[int] = set()
_starting = False  # inside start_child(): a signal then waits for the new child to be listed
_stop_signal: int | None = None


def kill_all() -> None:
    """SIGKILL to every listed child group (at exit, on SIGTERM / SIGINT)."""
    for pgid in list(_live):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_now(signum: int) -> None:
    kill_all()
    os.write(2, f"bench/gpu: stopped by {signal.Signals(signum).name}: child processes killed\n".encode())
    os._exit(128 + signum)


def _on_signal(signum: int, _frame: object) -> None:
    global _stop_signal
    _stop_signal = signum
    if not _starting:
        _stop_now(signum)


def install_stop_handlers() -> None:
    """SIGTERM and SIGINT kill every child group and end the process (128 + the signal); a
    normal exit kills what is left too."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    atexit.register(kill_all)


def start_child(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen in a new session (its own process group), listed until reaped (see forget)."""
    global _starting
    _starting = True
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        _live.add(proc.pid)
        return proc
    finally:
        _starting = False
        if _stop_signal is not None:  # a signal came while the child was being started
            _stop_now(_stop_signal)


def forget(proc: subprocess.Popen) -> None:
    """Unlists a child once it is reaped (its group id may then be reused)."""
    if proc.returncode is not None:
        _live.discard(proc.pid)


class BenchError(RuntimeError):
    pass


class Budget:
    """The whole command's wall-time allowance: every process gets at most what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def timeout(self, cap: float, what: str) -> float:
        left = self.end - MARGIN_S - time.monotonic()
        if left < 1.0:
            raise BenchError(f"{what}: not run, --budget spent")
        return min(cap, left)

    def left(self) -> float:
        """Seconds left of the whole allowance (the margin included)."""
        return self.end - time.monotonic()


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


def run_captured(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Runs `cmd` in its own process group; (exit status or None if killed at `timeout`, stdout,
    stderr). The whole group is killed at the timeout, so a child holding the pipes cannot hang
    the bench."""
    proc = start_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
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


class Run:
    """One run of a bench binary: its exit status, its JSON line and what went wrong."""

    def __init__(self, what: str, rc: int | None, result: dict[str, Any] | None, stderr: str,
                 error: str | None) -> None:
        self.what, self.rc, self.result, self.stderr, self.error = what, rc, result, stderr, error


def run_json(cmd: list[str], what: str, timeout: float, probe_found_device: bool = True) -> Run:
    """Runs a bench binary that prints one JSON line; never raises for what the binary does.
    `probe_found_device`: False when compute_bench probe failed (then a skip exit is not said to
    contradict it)."""
    try:
        rc, out, err = run_captured(cmd, timeout)
    except OSError as e:
        return Run(what, None, None, "", f"{what}: cannot run: {e}")
    if err:
        sys.stderr.write(err if err.endswith("\n") else err + "\n")  # its progress, for the log
        sys.stderr.flush()
    result = last_json(out)
    if rc is None:
        error = f"{what}: no answer within {timeout:.0f} s (killed)"
    elif rc != 0:
        error = f"{what}: {describe_rc(rc)}"
        if rc == SKIP:
            why = (result or {}).get("skipped", "skipped")
            error += f" ({why}, though the probe found a device)" if probe_found_device else f" ({why})"
    elif result is None:
        error = f"{what}: printed no JSON line"
    else:
        error = None
    if error is not None and result is None:
        # Nothing of its own says why: a crash, a CUDA error before the line, a hang.
        if rc is not None and rc != 0:
            error += ", printed no JSON line"
        if err.strip():
            error += f"; stderr: {tail(err)}"
    return Run(what, rc, result, err, error)


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
