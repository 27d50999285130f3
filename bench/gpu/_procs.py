"""Running bench/gpu's binaries without letting one hang or crash the bench (run.py): each in its
own process group, killed whole at its timeout; their JSON line, exit status and error text kept
for the one JSON line run.py prints whatever happened."""

from __future__ import annotations

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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return None, out, err


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


def run_json(cmd: list[str], what: str, timeout: float) -> Run:
    """Runs a bench binary that prints one JSON line; never raises for what the binary does."""
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
        if rc == SKIP:  # after the probe found a device
            error += f" ({(result or {}).get('skipped', 'skipped')}, though the probe found a device)"
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


def stop_opportunist(opp: subprocess.Popen, stuck: bool) -> None:
    """SIGTERM to its process group (it then prints its line and exits 0), SIGKILL if it is still
    there 30 s later; SIGKILL at once if it is `stuck` (never printed READY). Signals go to the
    group only while its leader is not reaped (its id cannot have been reused)."""
    if opp.poll() is not None:
        return
    if not stuck:
        try:
            os.killpg(opp.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            opp.send_signal(signal.SIGTERM)
        try:
            opp.wait(30)
            return
        except subprocess.TimeoutExpired:
            pass
    kill_group(opp)
    opp.wait()
