"""bench/gpu/run.py when a half fails: with stand-in `memory_bench` / `compute_bench` executables
(small Python scripts that print what the real binaries print, then fail a check, crash or hang),
the command still runs both halves and the RG rounds where it can, prints exactly ONE JSON line on
stdout with each part's exit status, error text and failed checks, and exits 1 after it. No GPU,
no nvcc, no torch: this runs in CI."""

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
RUN = REPO / "bench" / "gpu" / "run.py"

# One script for both binaries; MODES is filled in per test.
STAND_IN = r'''#!{python}
import json, os, signal, subprocess, sys, time
MODES = {modes!r}
PIDS = {pids!r}
name = os.path.basename(sys.argv[0])
cmd = sys.argv[1] if name == "compute_bench" else "memory"
mode = MODES.get(cmd, "ok")

def emit(obj):
    print(json.dumps(obj), flush=True)

def hang():
    # a grandchild holding our stdout and stderr too: killing only this process would leave the
    # pipes open
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(PIDS, cmd + ".pids"), "a") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}\n")
    time.sleep(300)

if cmd == "memory":
    if mode == "hang":
        hang()
    if mode == "escape":  # a grandchild in a session of its own keeps the pipes: no group kill reaches it
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        with open(os.path.join(PIDS, "escaped.pids"), "a") as f:
            f.write(f"{{child.pid}}\n")
        with open(os.path.join(PIDS, "memory.pids"), "a") as f:
            f.write(f"{{os.getpid()}}\n")
        time.sleep(300)
    if mode == "crash":
        sys.stderr.write("shrink 0: 2.00 GiB in 9 regions\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSEGV)
    ok = mode == "ok"
    if not ok:
        sys.stderr.write("shrink 0: 2.00 GiB in 9 regions\nCHECK FAILED: limit: kernels on allocated blocks "
                         "(launched, and every launch and sync succeeded)\nCHECK FAILED: limit: no overshoot\n")
    emit({{"bench": "gpu_memory", "version": 1, "quick": True, "device": "Stand-in GPU",
          "shrink_gib_per_ms": 1.5, "limit_overshoot_bytes": 0 if ok else 4096, "host_fallback_ok": True,
          "host_fallback_slowdown": 9.0, "checks_ok": ok}})
    sys.exit(0 if ok else 1)
if cmd == "probe":
    sys.exit(1 if mode == "fail" else 0)
if cmd == "share":
    if mode == "skip":
        emit({{"skipped": "no CUDA device"}})
        sys.exit(77)
    if mode == "crash":
        sys.stderr.write("compute_bench: cudaStreamSynchronize(job.stream) failed: an illegal memory access\n")
        sys.stderr.flush()
        os.abort()
    errors = 3 if mode == "gate_errors" else 0
    now = time.time()
    emit({{"bench": "gpu_compute_share", "version": 1, "share_achieved": [0.25, 0.5, 0.75],
          "share_error_points_max": 0.4, "natural_share": 0.99, "mean_kernel_ms": 0.5, "fma_iters": 1000,
          "manager_share_window": [0.25, 0.5, 0.75], "gate_errors": errors, "gate_anchor_uncertainty_ns": 100,
          "phase_epoch_s": [[now - 8 + 2 * i, now - 7 + 2 * i] for i in range(4)]}})
    sys.exit(1 if errors else 0)
if cmd == "guarantee":
    # hang_beside: hangs once an opportunist has started (the first run of a round is alone)
    if mode == "hang_beside" and os.path.exists(os.path.join(PIDS, "opportunist.pids")):
        hang()
    emit({{"bench": "gpu_compute_guarantee", "version": 1, "kernels": 200, "wall_s": 0.01}})
    sys.exit(0)
if cmd == "opportunist":
    if mode == "hang":
        hang()
    if mode == "exit":
        sys.stderr.write("compute_bench: antman_gate_create: no driver\n")
        sys.exit(1)
    with open(os.path.join(PIDS, "opportunist.pids"), "a") as f:
        f.write(f"{{os.getpid()}}\n")
    stop = []
    if mode == "ignore_term":  # a stuck one: only SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("READY", flush=True)
    while not stop:
        time.sleep(0.01)
    emit({{"bench": "gpu_compute_opportunist", "version": 1, "share": 0.05}})
    sys.exit(0)
sys.exit(2)
'''


def bench_cmd(tmp: Path, modes: dict[str, str] | None, *extra: str) -> list[str]:
    """run.py on stand-ins (none if `modes` is None) in tmp/out."""
    out = tmp / "out"
    out.mkdir()
    if modes is not None:
        for name in ("memory_bench", "compute_bench"):
            path = out / name
            path.write_text(STAND_IN.format(python=sys.executable, modes=modes, pids=str(tmp)))
            path.chmod(0o755)
    return [sys.executable, str(RUN), "--quick", "--no-build", "--rounds", "1", "--out", str(out), *extra]


ENV = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}


def run_bench(tmp: Path, modes: dict[str, str] | None, *extra: str, timeout: float = 120
              ) -> tuple[subprocess.CompletedProcess[str], dict, float]:
    cmd = bench_cmd(tmp, modes, *extra)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    wall = time.monotonic() - t0
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    return proc, json.loads(lines[0]), wall


@pytest.fixture(autouse=True)
def _end_stand_ins(tmp_path: Path):  # noqa: ANN202 - a fixture
    """If run.py failed to end a hanging stand-in (the test is then red), end it here: only the
    processes the stand-ins listed, and only while they still are the stand-in or its sleep."""
    yield
    for pid_file in tmp_path.glob("*.pids"):
        for pid in (int(p) for p in pid_file.read_text().split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(tmp_path) in cmdline or cmdline.startswith("sleep 300"):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass


def assert_dead(pid_file: Path) -> None:
    pids = [int(p) for p in pid_file.read_text().split()]
    time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie of an exited child is dead too.
        stat = Path(f"/proc/{pid}/stat")
        assert stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"), f"process {pid} still runs"


def test_all_passing_gives_ok_and_exit_0(tmp_path: Path) -> None:
    proc, out, _ = run_bench(tmp_path, {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["ok"] is True and out["failures"] == []
    assert out["bench"] == "gpu" and out["device"] == "Stand-in GPU"
    assert out["memory_rc"] == 0 and out["memory_error"] is None and out["memory_failed_checks"] == []
    assert out["compute_rc"] == 0 and out["compute_error"] is None and out["gate_errors"] == 0
    assert out["rg_error"] is None and out["rg_rounds_done"] == 1
    assert out["rg_slowdown_throttled"] == 0.0 and out["share_error_points_max"] == 0.4


def test_failed_memory_checks_and_gate_errors_still_run_everything(tmp_path: Path) -> None:
    proc, out, _ = run_bench(tmp_path, {"memory": "fail", "share": "gate_errors"})
    assert proc.returncode == 1
    assert out["ok"] is False and len(out["failures"]) == 2
    # The memory half's own figures, its status and which checks failed.
    assert out["memory_rc"] == 1 and out["memory_checks_ok"] is False
    assert out["limit_overshoot_bytes"] == 4096 and out["shrink_gib_per_ms"] == 1.5
    assert out["memory_failed_checks"] == [
        "limit: kernels on allocated blocks (launched, and every launch and sync succeeded)",
        "limit: no overshoot"]
    assert "limit: no overshoot" in out["memory_error"]
    # The compute half ran after it, reported its gate errors, and the RG rounds ran too.
    assert out["compute_rc"] == 1 and out["gate_errors"] == 3
    assert "gate_errors 3" in out["compute_error"]
    assert out["share_error_points_max"] == 0.4
    assert out["rg_error"] is None and out["rg_rounds_done"] == 1
    assert out["rg_slowdown_unthrottled"] is not None


def test_crashed_binaries_are_recorded_with_null_figures(tmp_path: Path) -> None:
    proc, out, _ = run_bench(tmp_path, {"memory": "crash", "share": "crash"})
    assert proc.returncode == 1
    assert out["ok"] is False and len(out["failures"]) == 3
    assert out["memory_rc"] == -11 and out["shrink_gib_per_ms"] is None and out["memory_checks_ok"] is None
    assert "killed by SIGSEGV" in out["memory_error"] and "printed no JSON line" in out["memory_error"]
    assert out["compute_rc"] == -6 and "killed by SIGABRT" in out["compute_error"]
    assert "illegal memory access" in out["compute_error"]  # its stderr, since it printed no line
    assert out["share_error_points_max"] is None and out["nvml_share_error_points_max"] is None
    # No calibration from the share run: the RG rounds cannot run, and say so.
    assert out["rg_rounds_done"] == 0 and out["rg_slowdown_throttled"] is None
    assert "not run" in out["rg_error"]


def test_hanging_memory_bench_is_killed_at_the_timeout(tmp_path: Path) -> None:
    proc, out, wall = run_bench(tmp_path, {"memory": "hang"}, "--timeout", "3")
    assert proc.returncode == 1
    assert out["memory_rc"] is None and "no answer within 3 s" in out["memory_error"]
    assert out["compute_error"] is None and out["rg_rounds_done"] == 1  # the rest ran
    assert wall < 60
    assert_dead(tmp_path / "memory.pids")  # and its grandchild, which held the pipes


def test_pipes_held_outside_the_group_do_not_hang_the_bench(tmp_path: Path) -> None:
    proc, out, wall = run_bench(tmp_path, {"memory": "escape"}, "--timeout", "3")
    assert proc.returncode == 1
    assert out["memory_rc"] is None and "kept its pipes open" in out["memory_error"]
    assert out["compute_error"] is None and out["rg_rounds_done"] == 1  # the rest ran
    assert wall < 60
    assert_dead(tmp_path / "memory.pids")  # the leader; the escaped sleep is the fixture's to end


def test_opportunist_without_ready_is_an_error_not_a_hang(tmp_path: Path) -> None:
    proc, out, wall = run_bench(tmp_path, {"opportunist": "hang"}, "--ready-timeout", "2")
    assert proc.returncode == 1
    assert out["failures"] == [out["rg_error"]]
    assert "no READY within 2 s" in out["rg_error"] and out["rg_rounds_done"] == 0
    assert out["memory_error"] is None and out["compute_error"] is None
    assert wall < 60
    assert_dead(tmp_path / "opportunist.pids")


def test_opportunist_that_exits_before_ready(tmp_path: Path) -> None:
    proc, out, _ = run_bench(tmp_path, {"opportunist": "exit"})
    assert proc.returncode == 1
    assert "ended before READY (exit 1)" in out["rg_error"] and "no driver" in out["rg_error"]


def test_skip_after_a_failed_probe_is_not_said_to_contradict_it(tmp_path: Path) -> None:
    proc, out, _ = run_bench(tmp_path, {"probe": "fail", "share": "skip"})
    assert proc.returncode == 1
    assert out["compute_error"] == "compute_bench probe: exit 1; compute_bench share: exit 77 (no CUDA device)"
    assert "probe_error" not in out  # folded into compute_error, as the docstring says


def test_missing_binaries(tmp_path: Path) -> None:
    proc, out, _ = run_bench(tmp_path, None)
    assert proc.returncode == 1 and out["ok"] is False
    assert "cannot run" in out["memory_error"] and "compute_bench probe" in out["compute_error"]
    assert "not run" in out["rg_error"]


def test_budget_bounds_the_whole_command(tmp_path: Path) -> None:
    # 8 s for everything (5 of them kept for stopping and printing): the hanging memory half gets
    # the rest, the compute half and the rounds are recorded as not run.
    proc, out, wall = run_bench(tmp_path, {"memory": "hang"}, "--budget", "8")
    assert proc.returncode == 1 and wall < 30
    assert "no answer within" in out["memory_error"]
    assert "--budget spent" in out["compute_error"]


def test_opportunist_ignoring_sigterm_stays_inside_the_budget(tmp_path: Path) -> None:
    # The guarantee hangs to its share of a 15 s budget; the opportunist beside it ignores
    # SIGTERM: SIGKILL comes within what is left of the budget, not 30 s later.
    proc, out, wall = run_bench(tmp_path, {"guarantee": "hang_beside", "opportunist": "ignore_term"}, "--budget", "15")
    assert proc.returncode == 1 and wall <= 15 + 3, wall
    assert "guarantee: no answer within" in out["rg_error"] and out["rg_rounds_done"] == 0
    assert_dead(tmp_path / "opportunist.pids")
    assert_dead(tmp_path / "guarantee.pids")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_killed_run_py_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    # As at a device call's time limit (SIGTERM) or Ctrl-C (SIGINT): an opportunist (which runs
    # until told to stop) and a hanging guarantee, each in its own process group.
    cmd = bench_cmd(tmp_path, {"guarantee": "hang_beside"})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "guarantee.pids").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:  # red: do not leave run.py behind
            proc.kill()
            proc.wait()
    assert time.monotonic() - t0 < 5
    assert_dead(tmp_path / "opportunist.pids")
    assert_dead(tmp_path / "guarantee.pids")  # and its grandchild
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert stdout == "" and f"stopped by {sig.name}" in stderr


@pytest.mark.parametrize("flag", ["--budget", "--timeout", "--ready-timeout"])
def test_non_positive_limits_are_usage_errors(flag: str) -> None:
    proc = subprocess.run([sys.executable, str(RUN), flag, "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be positive" in proc.stderr
