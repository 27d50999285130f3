"""bench/gpu_colocate.py stops every job it started on any exit: its solo jobs (each in a session of
its own) and the jobs its scheduler_lite daemon started (sessions of their own too, with
`--seconds 100000`), when it is stopped by SIGTERM / SIGINT mid-run or its --budget runs out. The
bench's job-starting path runs for real (its daemon on an emulated GPU, as in the CPU dry run);
only the PyTorch job is a stand-in (a script that writes step lines to its --log and keeps a
grandchild), so no torch is needed: CI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent

# The job stand-in: bench/_torch_job.py's command line, step lines in --log, a grandchild.
JOB = r'''
import json, os, subprocess, sys, time
here = {here!r}
args = sys.argv[1:]
log = args[args.index("--log") + 1] if "--log" in args else None
seconds = float(args[args.index("--seconds") + 1]) if "--seconds" in args else 0.3
child = subprocess.Popen(["sleep", "300"])
with open(os.path.join(here, "pids.txt"), "a") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}\n")
if "ANTMAN_JOB_DIR" in os.environ:  # started by the daemon
    with open(os.path.join(here, "daemon_jobs.txt"), "a") as f:
        f.write(f"{{os.getpid()}} {{args[args.index('--model') + 1]}}\n")
end = time.monotonic() + min(seconds, 0.3)
while seconds > 1000 or time.monotonic() < end:
    if log:
        with open(log, "a") as f:
            f.write(f"{{time.time()}} 20.0\n")
    time.sleep(0.02)
child.kill()
print(json.dumps({{"peak_in_use": 1 << 20, "median_ms": 20.0}}), flush=True)
'''

# gpu_colocate.main() with the stand-in job and without a GPU, torch or native libraries.
WRAPPER = r'''
import sys
sys.path.insert(0, {bench!r})
import _gpu_jobs
_gpu_jobs.JOB[:] = [sys.executable, {job!r}]
import gpu_colocate
gpu_colocate.gpu_or_exit = lambda device: (4 << 30, "stand-in")
gpu_colocate.check_native = lambda: None
gpu_colocate.build_op_hook = lambda prof: None
sys.argv = ["gpu_colocate.py", "--part", "1", "--device", "cpu", "--quick", *sys.argv[1:]]
sys.exit(gpu_colocate.main())
'''


def start_bench(tmp: Path, *extra: str) -> subprocess.Popen[str]:
    (tmp / "job.py").write_text(JOB.format(here=str(tmp)))
    (tmp / "wrapper.py").write_text(WRAPPER.format(bench=str(REPO / "bench"), job=str(tmp / "job.py")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen([sys.executable, str(tmp / "wrapper.py"), "--out", str(tmp / "out"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))


def pids(tmp: Path) -> list[int]:
    f = tmp / "pids.txt"
    return [int(p) for p in f.read_text().split()] if f.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


@pytest.fixture(autouse=True)
def _end_leftovers(tmp_path: Path):  # noqa: ANN202 - a fixture
    """If the bench left a job (the test is then red), end it here: only the listed pids, and
    only while they are still the stand-in or its sleep."""
    yield
    for pid in pids(tmp_path):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(tmp_path) in cmdline or cmdline.startswith("sleep 300"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopped_mid_run_leaves_no_job(tmp_path: Path, sig: signal.Signals) -> None:
    proc = start_bench(tmp_path)
    try:
        # The daemon has started an opportunistic job and the guarantee job (ResNet-50).
        deadline = time.monotonic() + 90
        daemon_jobs = tmp_path / "daemon_jobs.txt"
        while not (daemon_jobs.exists() and "resnet50" in daemon_jobs.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        started = [int(line.split()[0]) for line in daemon_jobs.read_text().splitlines()]
        assert len(started) >= 2 and all(alive(p) for p in started)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # red: do not leave the bench behind
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    time.sleep(0.2)
    left = [p for p in pids(tmp_path) if alive(p)]
    assert not left, f"still running: {left}"


def test_budget_ends_the_run_with_its_rows_and_no_job_left(tmp_path: Path) -> None:
    proc = start_bench(tmp_path, "--budget", "3")
    try:
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-3000:]
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last["cut_at_budget"] is True and last["budget_s"] == 3 and last["rows_done"] == []
    time.sleep(0.2)
    assert pids(tmp_path), "no job was started before the budget ran out"
    left = [p for p in pids(tmp_path) if alive(p)]
    assert not left, f"still running: {left}"
