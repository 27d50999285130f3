"""The rehearsal of the one GPU check (bench/gpu/check.py) without a GPU: every program it runs is
answered by a stand-in (a small Python script that prints what the real one prints, or fails,
hangs, holds the pipes through a grandchild, ignores SIGTERM), and the budget is scaled down
(--time-scale), so that the whole command runs here in seconds. It proves the order of the steps,
each step's timeout and the overall budget (a step that cannot have its minimum is skipped for
time), the per-step JSON lines and the summary, the refusal on a busy GPU, and that no process it
started survives it, also when it is stopped by SIGTERM mid-step. No GPU, nvcc or torch: CI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
CHECK = REPO / "bench" / "gpu" / "check.py"
sys.path.insert(0, str(REPO / "bench" / "gpu"))
sys.path.insert(0, str(REPO / "bench"))
import check  # noqa: E402 - bench/gpu/check.py

SCALE = 0.05  # the 480 s budget becomes 24 s; every cap, minimum and margin likewise
ORDER = ["gpu_idle", "binaries", "memory", "compute_long", "compute_short", "op_hook_build", "torch_smoke",
         "interference", "colocate"]

# One script for every program; its name says which. MODES (modes.json beside it) picks a
# behaviour per program or "program:subcommand". Every start is traced (trace.txt) and every
# process it leaves is listed (pids.txt) so that the test can prove none survives.
STAND_IN = r'''#!{python}
import json, os, signal, subprocess, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
sub = args[0] if name == "compute_bench" and args else ""
if sub == "share" and "--kernel-us" in args:
    sub = "share_short"
key = f"{{name}}:{{sub}}" if sub else name
modes = json.load(open(os.path.join(HERE, "modes.json")))
mode = modes.get(key, modes.get(name, "ok"))
with open(os.path.join(HERE, "trace.txt"), "a") as f:
    f.write(key + "\n")
with open(os.path.join(HERE, "pids.txt"), "a") as f:
    f.write(f"{{os.getpid()}}\n")

def emit(obj):
    print(json.dumps(obj), flush=True)

def hang(ignore_term=False, escape=False):
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a grandchild holding the pipes: only a group kill ends both; `escape`: in a session of its
    # own, as a scheduler_lite daemon starts its jobs: no group kill reaches it
    child = subprocess.Popen(["sleep", "300"], start_new_session=escape)
    with open(os.path.join(HERE, "pids.txt"), "a") as f:
        f.write(f"{{child.pid}}\n")
    with open(os.path.join(HERE, "hanging.txt"), "a") as f:
        f.write(key + "\n")
    time.sleep(300)
    sys.exit(9)

if mode in ("hang", "hang_ignore_term", "hang_escape"):
    hang(mode == "hang_ignore_term", mode == "hang_escape")
if mode == "fail":
    sys.stderr.write(f"{{key}}: failing on purpose\n")
    sys.exit(1)

if name == "gpu_procs":
    procs = [{{"pid": 4242, "used_memory_bytes": 1 << 30}}] if mode == "busy" else []
    emit({{"device": "Stand-in GPU", "driver": "0.0", "memory_total_bytes": 80 << 30,
           "memory_used_bytes": 0, "compute_processes": procs}})
elif name == "build":
    open(os.path.join(HERE, "built.txt"), "w").close()
    out = args[-1]
    for b in ("memory_bench", "compute_bench"):
        open(os.path.join(out, b), "w").close()
elif name == "memory_bench":
    ok = mode != "check_failed"
    if not ok:
        sys.stderr.write("CHECK FAILED: fallback: host-backed results equal device-backed ones and the CPU reference\n")
    emit({{"bench": "gpu_memory", "version": 1, "device": "Stand-in GPU", "shrink_gib": 16.0,
           "shrink_gib_per_ms": 1.0, "shrink_inflight_gib": 16.0, "shrink_inflight_gib_per_ms": 0.9,
           "shrink_inflight_kernel_running_after": 3, "limit_overshoot_bytes": 0, "host_fallback_ok": ok,
           "host_fallback_slowdown": 9.0, "checks_ok": ok}})
    sys.exit(0 if ok else 1)
elif name == "compute_bench" and sub == "probe":
    if mode == "loader_error_until_built" and not os.path.exists(os.path.join(HERE, "built.txt")):
        sys.stderr.write("compute_bench: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.99' not found\n")
        sys.exit(1)
    if mode == "no_device":
        emit({{"skipped": "no CUDA device or driver: stand-in"}})
        sys.exit(77)
elif name == "compute_bench" and sub.startswith("share"):
    off = 0.10 if mode == "off" else 0.0
    now = time.time()
    phases = []
    for i, t in enumerate((1.0, 0.25, 0.5, 0.75)):
        share = min(t + (off if i else 0.0), 1.0)
        phases.append({{"target": t, "kernels": int(1000 * share), "seconds": 1.0,
                        "epoch": [now - 8 + 2 * i, now - 7 + 2 * i], "busy_ns": int(share * 1e9),
                        "window_ns": int(1e9), "manager_share_window": t}})
    emit({{"bench": "gpu_compute_share", "version": 2, "mode": "short" if "short" in sub else "long",
           "fma_iters": 1000, "cupti": True, "cupti_error": None, "phases": phases, "gate_errors": 0}})
elif name == "compute_bench" and sub == "guarantee":
    # time slicing as the docs model it: beside an opportunist busy a fraction f of the time,
    # the guarantee job takes 1 / (1 - f) as long
    kernels = int(args[args.index("--kernels") + 1])
    open(os.path.join(HERE, "kernels.txt"), "w").write(str(kernels))
    f = float(open(os.path.join(HERE, "beside.txt")).read()) if os.path.exists(os.path.join(HERE, "beside.txt")) else 0.0
    t0 = time.time()
    time.sleep(0.2)
    emit({{"bench": "gpu_compute_guarantee", "version": 2, "kernels": kernels, "wall_s": 1.0 / (1.0 - f),
           "epoch": [t0, time.time()]}})
elif name == "compute_bench" and sub == "opportunist":
    share = float(args[args.index("--share") + 1])
    if mode == "double":  # gets twice its share done, as an under-charged opportunist would
        share *= 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    open(os.path.join(HERE, "beside.txt"), "w").write(str(share))
    print("READY", flush=True)
    # the work it gets done: a fraction `share` of the time at the guarantee's kernel time alone
    # (1 s / K), in progress lines as compute_bench prints them
    k = int(open(os.path.join(HERE, "kernels.txt")).read())
    t0 = time.time()
    while not stop:
        print(f"P {{time.time():.6f}} {{share * (time.time() - t0) * k:.3f}}", flush=True)
        time.sleep(0.01)
    os.remove(os.path.join(HERE, "beside.txt"))
    wall = time.time() - t0
    print(f"P {{time.time():.6f}} {{share * wall * k:.3f}}", flush=True)
    burst = int(args[args.index("--burst-us") + 1]) * 1000 if "--burst-us" in args else 2000000
    emit({{"bench": "gpu_compute_opportunist", "version": 2, "kernels": round(share * wall * k), "wall_s": wall,
           "manager_share_window": share, "device_burst_ns": burst}})
elif name == "op_hook_build":
    emit({{"op_hook_s": 0.01, "allocator_s": 0.02}})
elif name == "torch_smoke":
    # activated as the wheel would: ANTMAN_* set and the .pth line's sitecustomize first on the path
    site = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    ok = (os.environ.get("ANTMAN_DEVICE") == "cuda" and os.environ.get("ANTMAN_MEMORY_LIMIT") == "2GiB"
          and os.path.exists(os.path.join(site, "sitecustomize.py")))
    emit({{"bench": "gpu_torch_smoke", "checks": {{"antman_active": ok, "over_limit_on_host": True}}}})
elif name == "gpu_colocate":
    out = args[args.index("--out") + 1]
    with open(os.path.join(out, "rows.jsonl"), "a") as f:
        f.write(json.dumps({{"row": "repeat 1", "rg_slowdown": 0.01}}) + "\n")
    emit({{"bench": "gpu_colocate", "rg_slowdown": 0.01, "op_progress_ratio": 0.6, "failed_jobs": 0}})
'''


def stand_ins(tmp: Path, modes: dict[str, str] | None = None) -> Path:
    d = tmp / "stand_ins"
    d.mkdir()
    (d / "modes.json").write_text(json.dumps(modes or {}))
    for name in check.PROGRAMS:
        path = d / name
        path.write_text(STAND_IN.format(python=sys.executable))
        path.chmod(0o755)
    return d


def carried_bin(tmp: Path) -> Path:
    b = tmp / "bin"
    b.mkdir()
    for name in ("memory_bench", "compute_bench"):
        (b / name).write_text("")
    return b


# With -S (below) and the packages on PYTHONPATH, not through site: the GPU image's packages (absl,
# pynvml) are there, but no .pth file runs, so tf_antman is not installed, as on the GPU machine
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")},
       "PYTHONPATH": sysconfig.get_paths()["purelib"]}


def command(tmp: Path, si: Path, *extra: str, bin_dir: Path | None = None) -> list[str]:
    # -S: no site, so tf_antman comes from the checkout, as on the GPU machine (ENV)
    return [sys.executable, "-S", str(CHECK), "--out", str(tmp / "out"), "--bin", str(bin_dir or carried_bin(tmp)),
            "--stand-ins", str(si), "--time-scale", str(SCALE), *extra]


def rehearse(tmp: Path, modes: dict[str, str] | None = None, *extra: str, bin_dir: Path | None = None
             ) -> tuple[subprocess.CompletedProcess[str], list[dict], list[str]]:
    si = stand_ins(tmp, modes)
    proc = subprocess.run(command(tmp, si, *extra, bin_dir=bin_dir), capture_output=True, text=True,
                          timeout=120, env=ENV)
    lines = [json.loads(x) for x in (tmp / "out" / "check.jsonl").read_text().splitlines()]
    assert [json.loads(x) for x in proc.stdout.splitlines()] == lines  # the same lines on stdout
    trace = (si / "trace.txt").read_text().split() if (si / "trace.txt").exists() else []
    return proc, lines, trace


def assert_none_left(si: Path) -> None:
    """Every process a stand-in started (itself, its grandchild) is gone (or a zombie)."""
    time.sleep(0.2)
    for pid in (int(p) for p in (si / "pids.txt").read_text().split()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{pid}/stat")
        assert stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z", f"process {pid} still runs"


@pytest.fixture(autouse=True)
def _end_leftovers(tmp_path: Path):  # noqa: ANN202 - a fixture
    """If check.py failed to end a stand-in (the test is then red), end it here: only the pids the
    stand-ins listed, and only while they are still a stand-in or its sleep."""
    yield
    pids = tmp_path / "stand_ins" / "pids.txt"
    if not pids.exists():
        return
    for pid in (int(p) for p in pids.read_text().split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(tmp_path) in cmdline or cmdline.startswith("sleep 300"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_whole_check_runs_its_steps_in_order_with_one_line_each(tmp_path: Path) -> None:
    proc, lines, trace = rehearse(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in lines] == [*ORDER, "summary"]
    assert all(r["status"] == "passed" for r in lines[:-1]), [(r["step"], r.get("error")) for r in lines]
    # The programs in the order of value; the interference rounds alternate their order.
    first = [t for t in trace if not t.startswith("compute_bench:guarantee") and t != "compute_bench:opportunist"]
    assert first == ["gpu_procs", "compute_bench:probe", "memory_bench", "compute_bench:share",
                     "compute_bench:share_short", "op_hook_build", "torch_smoke", "gpu_colocate"]
    assert trace.index("torch_smoke") < trace.index("compute_bench:guarantee") < trace.index("gpu_colocate")
    assert trace.count("compute_bench:opportunist") == 2 * len(check.INTERFERENCE_CASES)
    # Each step ran under its own timeout, no more than its cap (scaled) or the budget left.
    for r, spec in zip(lines[:-1], check.STEPS, strict=True):
        assert 0 < r["timeout_s"] <= spec.cap_s * SCALE + 1e-6, r
    summary = lines[-1]
    assert summary["ran"] == ORDER and summary["passed"] == ORDER and summary["failed"] == []
    assert summary["skipped_for_time"] == [] and summary["not_reached"] == [] and summary["ok"] is True
    assert summary["rehearsal"] is True and summary["budget_s"] == pytest.approx(480 * SCALE)
    steps = {r["step"]: r for r in lines}
    assert steps["binaries"]["carried"] is True and "build_s" not in steps["binaries"]
    assert steps["compute_long"]["share_error_points_cupti"] == 0.0
    assert steps["compute_long"]["share_witness"] == "cupti"
    assert steps["torch_smoke"]["checks"]["antman_active"] is True  # ANTMAN_* and the sitecustomize
    assert steps["op_hook_build"]["op_hook_s"] == 0.01 and steps["op_hook_build"]["allocator_s"] == 0.02
    rows = steps["interference"]["rows"]
    shares = [share for share, _ in check.INTERFERENCE_CASES]
    assert [r["opportunist_share"] for r in rows] == shares
    # Judged: the library's default burst; the other bursts are reported beside it, not checked.
    assert [r["judged"] for r in rows] == [burst is None for _, burst in check.INTERFERENCE_CASES]
    assert sorted(steps["interference"]["checks"]) == sorted(
        [f"slowdown_le_bound_at_{s:g}" for s in check.INTERFERENCE_SHARES]
        + [f"opportunist_not_starved_at_{s:g}" for s in check.INTERFERENCE_SHARES if s > 0]
        + [f"opportunist_within_share_at_{s:g}" for s in check.INTERFERENCE_SHARES])
    # the opportunist's busy fraction inside the guarantee's run, from its progress lines: its share
    assert [r["opportunist_busy_fraction"] for r in rows] == pytest.approx(shares, abs=0.02)
    assert all(r["guarantee_slowdown"] <= r["time_slicing_bound"] + 0.01 for r in rows)
    assert steps["colocate"]["rows"] == [{"row": "repeat 1", "rg_slowdown": 0.01}]
    assert_none_left(tmp_path / "stand_ins")


def test_binaries_not_carried_are_built_there_and_timed(tmp_path: Path) -> None:
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    proc, lines, trace = rehearse(tmp_path, {}, "--only", "gpu_idle,binaries", bin_dir=empty)
    assert proc.returncode == 0, proc.stderr[-3000:]
    binaries = next(r for r in lines if r["step"] == "binaries")
    assert binaries["carried"] is False and binaries["build_s"] >= 0
    assert trace == ["gpu_procs", "build", "compute_bench:probe"]


def test_carried_binaries_that_do_not_load_are_built_again(tmp_path: Path) -> None:
    proc, lines, trace = rehearse(tmp_path, {"compute_bench:probe": "loader_error_until_built"}, "--only",
                                  "gpu_idle,binaries,memory")
    assert proc.returncode == 0, proc.stderr[-3000:]
    binaries = next(r for r in lines if r["step"] == "binaries")
    assert binaries["status"] == "passed" and binaries["carried"] is True and "GLIBC_2.99" in binaries["carried_error"]
    assert trace == ["gpu_procs", "compute_bench:probe", "build", "compute_bench:probe", "memory_bench"]


def test_a_busy_gpu_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc, lines, trace = rehearse(tmp_path, {"gpu_procs": "busy"})
    assert proc.returncode == check.REFUSED
    assert [r["step"] for r in lines] == ["gpu_idle", "summary"]
    assert lines[0]["status"] == "refused" and "pid 4242 (1024 MiB)" in lines[0]["error"]
    assert lines[1]["failed"] == ["gpu_idle"] and lines[1]["ok"] is False
    assert trace == ["gpu_procs"]
    assert "refused: the GPU already has compute processes" in proc.stderr


def test_a_hanging_step_is_killed_at_its_timeout_and_the_rest_runs(tmp_path: Path) -> None:
    proc, lines, _ = rehearse(tmp_path, {"memory_bench": "hang"})
    assert proc.returncode == 1
    steps = {r["step"]: r for r in lines}
    memory = steps["memory"]
    assert memory["status"] == "failed" and memory["timed_out"] is True
    assert memory["timeout_s"] == pytest.approx(check.STEPS[2].cap_s * SCALE)
    assert "no answer within" in memory["error"]
    assert steps["compute_long"]["status"] == "passed"  # the next steps still ran
    assert lines[-1]["failed"] == ["memory"] and lines[-1]["ok"] is False
    assert_none_left(tmp_path / "stand_ins")  # the stand-in and its grandchild


def test_the_budget_holds_and_a_step_without_its_minimum_is_skipped_for_time(tmp_path: Path) -> None:
    # 200 s (10 s scaled): the hanging memory step takes its 6 s, then too little is left for
    # the colocate step's minimum.
    proc, lines, trace = rehearse(tmp_path, {"memory_bench": "hang"}, "--budget", "200")
    assert proc.returncode == 1
    steps = {r["step"]: r for r in lines}
    assert steps["colocate"]["status"] == "skipped_for_time"
    assert steps["colocate"]["reason"].startswith(f"needs {check.STEPS[-1].min_s * SCALE:.1f} s")
    assert "gpu_colocate" not in trace
    summary = lines[-1]
    assert "colocate" in summary["skipped_for_time"] and summary["budget_s"] == pytest.approx(200 * SCALE)
    # By its own clock (the margin is kept for the kill and the summary); 2 s for a loaded CI host.
    assert summary["wall_s"] <= summary["budget_s"] + 2.0
    for r in lines[:-1]:
        if "timeout_s" in r:  # no step was given more than was left of the budget at its start
            assert r["started_at_s"] + r["timeout_s"] <= summary["budget_s"] + 1e-3, r


def test_a_failed_check_keeps_the_figures_and_names_the_check(tmp_path: Path) -> None:
    proc, lines, _ = rehearse(tmp_path, {"memory_bench": "check_failed"}, "--only", "gpu_idle,binaries,memory")
    assert proc.returncode == 1
    memory = next(r for r in lines if r["step"] == "memory")
    assert memory["status"] == "failed" and memory["shrink_gib"] == 16.0  # the figures are kept
    assert memory["host_fallback_ok"] is False and memory["checks"]["host_fallback_zero_copy_ok"] is False
    assert memory["error"] == ("memory_bench: exit 1; failed checks: fallback: host-backed results equal "
                               "device-backed ones and the CPU reference")


def test_a_job_in_a_session_of_its_own_is_killed_with_the_step(tmp_path: Path) -> None:
    # gpu_colocate's daemon starts its jobs in sessions of their own: at the step's timeout they
    # go with it (the tree is killed before the group), not to init.
    proc, lines, _ = rehearse(tmp_path, {"gpu_colocate": "hang_escape"}, "--budget", "240", "--only",
                              "gpu_idle,binaries,op_hook_build,colocate")
    assert proc.returncode == 1
    colocate = next(r for r in lines if r["step"] == "colocate")
    assert colocate["status"] == "failed" and "no answer within" in colocate["error"]
    assert_none_left(tmp_path / "stand_ins")


def test_share_off_target_fails_the_compute_step_naming_the_check(tmp_path: Path) -> None:
    proc, lines, _ = rehearse(tmp_path, {"compute_bench:share": "off"}, "--only",
                              "gpu_idle,binaries,compute_long,compute_short")
    assert proc.returncode == 1
    steps = {r["step"]: r for r in lines}
    assert steps["compute_long"]["status"] == "failed"
    assert steps["compute_long"]["share_error_points_cupti"] == pytest.approx(10.0)
    assert "share_error_le_2_points" in steps["compute_long"]["error"]
    assert steps["compute_short"]["status"] == "passed"


def test_an_opportunist_doing_more_than_its_share_fails_the_interference_step(tmp_path: Path) -> None:
    # The H200's run 2: f 0.109 at share 0.05, its manager reading 0.049. The guarantee job's
    # slowdown stays within f / (1 - f), so only the opportunist's own figure can show it.
    proc, lines, _ = rehearse(tmp_path, {"compute_bench:opportunist": "double"}, "--only",
                              "gpu_idle,binaries,compute_long,interference")
    assert proc.returncode == 1
    step = next(r for r in lines if r["step"] == "interference")
    assert step["status"] == "failed"
    assert step["checks"]["opportunist_within_share_at_0.05"] is False
    assert step["checks"]["opportunist_within_share_at_0"] is True  # twice nothing is nothing
    assert "opportunist_within_share_at_0.05" in step["error"]
    assert all(r["within_share"] is (r["opportunist_share"] == 0) for r in step["rows"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopped_mid_step_leaves_no_process_and_writes_the_summary(tmp_path: Path, sig: signal.Signals) -> None:
    # An opportunist (runs until told to stop) beside a guarantee that hangs, as at a device
    # call's time limit (SIGTERM) or Ctrl-C (SIGINT).
    si = stand_ins(tmp_path, {"compute_bench:guarantee": "hang_ignore_term"})
    proc = subprocess.Popen(command(tmp_path, si, "--only", "gpu_idle,binaries,compute_long,interference"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (si / "hanging.txt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # red: do not leave check.py behind
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert_none_left(si)
    last = json.loads(stdout.splitlines()[-1])
    assert last["step"] == "summary" and last["stopped_by"] == sig.name and last["ok"] is False
    assert last["stopped_in_step"] == "interference"


def test_judge_share_uses_the_work_done_without_cupti() -> None:
    phases = [{"target": t, "kernels": int(1000 * t), "seconds": 1.0, "busy_ns": -1, "window_ns": -1,
               "epoch": [0, 1]} for t in (1.0, 0.25, 0.5, 0.75)]
    sampler = check.NvmlSampler()
    sampler.samples = [(0.5, 0.9)]  # NVML's natural share: 0.9
    out = check.judge_share({"phases": phases, "gate_errors": 0}, sampler, "long")
    assert out["share_witness"] == "work" and out["natural_witness"] == "nvml"
    # work at 0.25: 0.9 x 250/1000 = 0.225 against min(0.25, 0.9): 2.5 points; the worst is 0.75's 7.5
    assert out["share_work"] == [0.225, 0.45, 0.675]
    assert out["share_error_points_max"] == pytest.approx(7.5)
    assert out["checks"]["share_error_le_2_points"] is False


def test_kernels_at_interpolates_the_progress_lines() -> None:
    progress = [(10.0, 0.0), (11.0, 100.0), (12.0, 100.0)]
    assert check.kernels_at(progress, 9.0) == 0.0
    assert check.kernels_at(progress, 10.5) == 50.0
    assert check.kernels_at(progress, 11.5) == 100.0
    assert check.kernels_at(progress, 13.0) == 100.0


def test_judge_share_drops_cupti_records_read_wrong() -> None:
    # busy > window at share 1: a record layout other than the one compiled in; the work done judges
    phases = [{"target": t, "kernels": int(1000 * t), "seconds": 1.0, "busy_ns": int(3e9 * t), "window_ns": int(1e9),
               "epoch": [0, 1]} for t in (1.0, 0.25, 0.5, 0.75)]
    sampler = check.NvmlSampler()
    sampler.samples = [(0.5, 1.0)]
    out = check.judge_share({"phases": phases, "gate_errors": 0}, sampler, "long")
    assert out["share_cupti"] == [None, None, None] and "outside (0, 1]" in out["cupti_error"]
    assert out["share_witness"] == "work" and out["share_error_points_max"] == 0.0


def test_bad_arguments_are_refused_naming_the_field(tmp_path: Path) -> None:
    for args, message in [(["--budget", "600"], "--budget: 600.0 is outside the accepted range (0, 480]"),
                          (["--time-scale", "0"], "--time-scale: 0.0 is outside"),
                          (["--only", "memory,turbo"], "--only: unknown steps ['turbo']"),
                          (["--stand-ins", str(tmp_path)], "lacks gpu_procs")]:
        proc = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path / "o"), *args],
                              capture_output=True, text=True, timeout=60, env=ENV)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
