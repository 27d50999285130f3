"""Co-location of PyTorch jobs on one real GPU through scheduler_lite (paper §3.3, §5.1, Table 2).

    python bench/gpu_colocate.py --part 1 [--quick]    # guarantee job + two opportunistic jobs
    python bench/gpu_colocate.py --part 2 [--quick]    # the paper's Table 2 scenario

Needs one NVIDIA GPU (NVML), PyTorch with CUDA, a C++ compiler for the op hook, and the native
libraries (tf_antman/_native/libantman_torch.so, libantman_core.so). Without a GPU it prints one
line and exits 77. Every figure is measured in the same run as its baseline, from the jobs' own
step clocks (bench/_torch_job.py), not from tf-antman's statistics.

1. The scheduler_lite daemon (devices.kind = "nvml") runs a resource-guarantee job (ResNet-50)
   alone, then with two opportunistic jobs (ResNet-18, MobileNetV2) that its local coordinator
   scales, then alone again. rg_slowdown = RG median step co-located / RG median step in the two
   solo windows around it - 1 (paper <= 3.5%). op_progress_ratio = an opportunistic job's
   steps/s co-located / its steps/s alone on the GPU under tf-antman at share 1, run just before
   (paper 57% for ResNet-50). failed_jobs counts every job that did not finish or was not ended by
   the bench. Saves docs/gpu_colocate_timeline.png.
2. Table 2: opportunistic job A (ResNet-50, batch sized to ~60% of the GPU's memory) runs; a
   guarantee job B (batch sized to ~50%) arrives. JCTs under FIFO (B waits for A: A's and B's
   solo runs), Pack (stock PyTorch, both at once, no tf-antman: B runs out of memory), UMem
   (tf-antman memory, no coordinator: B's limit is the memory free at its arrival, the rest in
   host memory) and tf-antman (the daemon shrinks A, B gets its memory). Batch sizes come from a
   calibration run that measures ResNet-50's memory per sample on this GPU.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
JOB = [sys.executable, str(REPO / "bench" / "_torch_job.py")]
NO_GPU_EXIT = 77
GiB = 1 << 30


def gpu_or_exit() -> int:
    """Total memory of GPU 0 in bytes; exits 77 with one line when there is no GPU."""
    import importlib.util

    why = ""
    if importlib.util.find_spec("torch") is None:
        why = "PyTorch is not installed"
    else:
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
            why = "NVML reports no GPU"
        except Exception as err:  # noqa: BLE001 - no driver, no pynvml: no GPU to measure on
            why = f"no NVIDIA GPU ({type(err).__name__}: {err})"
    print(f"gpu_colocate: skipped, {why}: nothing measured", flush=True)
    sys.exit(NO_GPU_EXIT)


def gpu_free() -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)


def env_for(antman: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(PYTHONUNBUFFERED="1")  # PYTHONPATH: set up by autoload_like_the_wheel()
    env.update(antman or {})
    return env


def start(args: list[str], antman: dict[str, str] | None) -> subprocess.Popen[str]:
    return subprocess.Popen([*JOB, *args], env=env_for(antman), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(p: subprocess.Popen[str], t0: float, deadline_s: float = 3600.0) -> tuple[float, str, dict]:
    """JCT, final state and the job's JSON line. A job still running `deadline_s` after t0 is
    killed and reported as unfinished (its JCT is then only a lower bound)."""
    try:
        out, err = p.communicate(timeout=max(1.0, deadline_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return time.monotonic() - t0, f"unfinished after {deadline_s:.0f} s (killed)", {}
    jct = time.monotonic() - t0
    result = next((json.loads(x) for x in reversed(out.splitlines()) if x.startswith("{")), {})
    if p.returncode == 0:
        return jct, "finished", result
    oom = "out of memory" in err.lower() or "OutOfMemoryError" in err
    return jct, "failed (OOM)" if oom else f"failed (rc {p.returncode}: {err.strip().splitlines()[-1:] or ''})", result


def read_log(path: Path) -> list[tuple[float, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        t, ms = line.split()
        rows.append((float(t), float(ms)))
    return rows


def in_window(rows: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [r for r in rows if lo <= r[0] < hi]


def rate(rows: list[tuple[float, float]], lo: float, hi: float) -> float:
    return len(in_window(rows, lo, hi)) / (hi - lo) if hi > lo else 0.0


def autoload_like_the_wheel(tmp: Path) -> None:
    """Jobs activate tf-antman at `import torch` as with the installed wheel, whose .pth line
    runs at interpreter start. Here the package runs from the checkout (the wheel pins
    tensorflow, which GPU machines need not have), so the same line goes into a sitecustomize
    module on PYTHONPATH, which every job (also those the daemon starts) inherits."""
    from tf_antman.importhook import PTH_LINE

    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PTH_LINE)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(REPO), old) if p)


def make_daemon(state_dir: Path, round_s: float):  # noqa: ANN201 - scheduler_lite.daemon.Daemon
    from scheduler_lite.config import parse_config
    from scheduler_lite.daemon import Daemon
    from scheduler_lite.storage import SqliteStorage

    cfg = parse_config({
        "version": 1,
        "paths": {"state_dir": str(state_dir)},
        "devices": {"kind": "nvml"},
        "tenants": [{"name": "research", "gpu_quota": 1}, {"name": "batch", "gpu_quota": 0}],
        "jobs": {"host_memory": "64GiB", "cancel_grace_s": 10},
        "daemon": {"tick_interval_s": 0.25, "schedule_interval_s": 1, "utilisation_window_s": 10},
        # GPU defaults of docs/policies.md except a shorter round, so a short bench sees rounds.
        "coordinator": {"round_interval_s": round_s},
    }, base_dir=state_dir)
    return Daemon(cfg, SqliteStorage(cfg.db_path))


def sample(d, names: dict[str, str], t0: float, rows: list[dict]) -> None:  # noqa: ANN001
    now = time.monotonic() - t0
    for g in d.status().gpus:
        for j in g.jobs:
            rows.append({"t": now, "job": names.get(j.job_id, j.job_id), "limit": j.memory_limit_bytes,
                         "share": j.compute_share, "median_ms": j.step_ms_median,
                         "host": j.host_in_use_bytes, "phase": g.coordinator_phase})


def plot_timeline(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for job in sorted({r["job"] for r in rows}):
        rs = [r for r in rows if r["job"] == job]
        t = [r["t"] for r in rs]
        axes[0].plot(t, [(r["limit"] or 0) / GiB for r in rs], label=job)
        axes[1].plot(t, [r["share"] for r in rs], label=job)
        axes[2].plot(t, [r["median_ms"] if r["median_ms"] else float("nan") for r in rs], label=job)
    axes[0].set_ylabel("memory limit (GiB)")
    axes[1].set_ylabel("compute share")
    axes[2].set_ylabel("step time, median (ms)")
    axes[2].set_xlabel("time (s)")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_title("tf-antman, PyTorch jobs on one GPU (bench/gpu_colocate.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


RG = ["--model", "resnet50", "--batch", "64"]
OPS = {"op-resnet18": ["--model", "resnet18", "--batch", "128"],
       "op-mobilenet": ["--model", "mobilenet_v2", "--batch", "128"]}


def colocate_once(rep: int, quick: bool, windows: tuple[int, int, int, int], op_solo: dict[str, float],
                  tmp: Path, timeline: list[dict]) -> tuple[dict, int]:
    """RG alone, with the two opportunistic jobs, alone again, under one daemon."""
    solo_s, settle_s, co_s, solo2_s = windows
    d = make_daemon(tmp / f"daemon{rep}", round_s=2 if quick else 5)
    t0 = time.monotonic()
    names: dict[str, str] = {}

    def run_for(seconds: float, until: object = None) -> None:
        def step(dd: object) -> bool:
            sample(dd, names, t0, timeline)
            return bool(until(dd)) if callable(until) else False

        d.run_until(step, timeout=seconds)

    rg_log = tmp / f"rg{rep}.log"
    rg = d.submit([*JOB, *RG, "--seconds", "100000", "--log", str(rg_log)], tenant="research",
                  kind="guarantee", memory_bytes=16 * GiB, name="rg-resnet50")
    names[rg] = "rg-resnet50"
    run_for(300, lambda dd: len(read_log(rg_log)) > 10)
    run_for(solo_s)
    t_ops = time.time()
    ops: dict[str, tuple[str, Path]] = {}
    for name, args in OPS.items():
        log = tmp / f"{name}{rep}.log"
        job_id = d.submit([*JOB, *args, "--seconds", "100000", "--log", str(log)], tenant="batch",
                          kind="opportunistic", name=name)
        ops[name] = (job_id, log)
        names[job_id] = name
    run_for(settle_s + co_s)
    t_co_end = time.time()
    t_co_start = t_co_end - co_s
    for job_id, _ in ops.values():
        d.cancel(job_id)
    run_for(60, lambda dd: all(dd.job(j).state.done for j, _ in ops.values()))
    t_solo2 = time.time() + 3
    run_for(solo2_s + 3)
    d.cancel(rg)
    run_for(60, lambda dd: dd.job(rg).state.done)
    failed = 0
    for job_id in [rg, *(j for j, _ in ops.values())]:
        rec = d.job(job_id)
        failed += rec.state.value == "failed" and not rec.cancel_requested
    d.stop_all_jobs()
    rows = read_log(rg_log)
    solo = [ms for _, ms in in_window(rows, rows[10][0], t_ops)] + \
        [ms for _, ms in in_window(rows, t_solo2, time.time())]
    co = [ms for _, ms in in_window(rows, t_co_start, t_co_end)]
    op_ratio = {n: rate(read_log(log), t_co_start, t_co_end) / op_solo[n] if op_solo[n] else 0.0
                for n, (_, log) in ops.items()}
    r = {"rg_solo_ms": statistics.median(solo), "rg_colocated_ms": statistics.median(co),
         "rg_solo_steps": len(solo), "rg_co_steps": len(co), "op_progress_ratio": op_ratio}
    r["rg_slowdown"] = r["rg_colocated_ms"] / r["rg_solo_ms"] - 1
    return r, failed


def part1(quick: bool, repeats: int, tmp: Path) -> dict:
    solo_s, settle_s, co_s, solo2_s = (20, 30, 40, 15) if quick else (40, 60, 90, 30)
    cuda = {"ANTMAN_ENABLE": "1", "ANTMAN_DEVICE": "cuda"}
    failed = 0
    # Opportunistic jobs alone on the GPU under tf-antman at share 1: their progress baseline.
    op_solo: dict[str, float] = {}
    for name, args in OPS.items():
        log = tmp / f"{name}-solo.log"
        _, state, _ = finish(start([*args, "--seconds", str(solo_s + 10), "--log", str(log)], cuda), time.monotonic())
        failed += state != "finished"
        rows = read_log(log)
        op_solo[name] = rate(rows, rows[0][0] + 10, rows[-1][0]) if len(rows) > 2 else 0.0
        print(f"   {name} alone: {op_solo[name]:.2f} steps/s ({state})", flush=True)

    results: list[dict] = []
    timeline: list[dict] = []
    for rep in range(repeats):
        r, f = colocate_once(rep, quick, (solo_s, settle_s, co_s, solo2_s), op_solo, tmp, timeline)
        failed += f
        print(f"   repeat {rep + 1}: RG {r['rg_solo_ms']:.1f} -> {r['rg_colocated_ms']:.1f} ms "
              f"({100 * r['rg_slowdown']:+.1f}%), op progress "
              f"{ {k: round(v, 3) for k, v in r['op_progress_ratio'].items()} }", flush=True)
        results.append(r)
    plot = REPO / "docs" / "gpu_colocate_timeline.png"
    plot_timeline(timeline, plot)
    print(f"   timeline plot: {plot}")
    slow = [r["rg_slowdown"] for r in results]
    ratios = [v for r in results for v in r["op_progress_ratio"].values()]
    return {"rg_slowdown": round(statistics.median(slow), 4), "rg_slowdown_worst": round(max(slow), 4),
            "op_progress_ratio": round(statistics.median(ratios), 3), "op_progress_ratio_worst": round(min(ratios), 3),
            "failed_jobs": failed, "repeats": repeats, "runs": results, "op_solo_steps_per_s": op_solo}


def part2(quick: bool, capacity: int, tmp: Path) -> dict:
    cuda = {"ANTMAN_ENABLE": "1", "ANTMAN_DEVICE": "cuda"}
    # Calibration: ResNet-50 memory and time per sample on this GPU (peak in use / batch).
    _, state, cal = finish(start(["--model", "resnet50", "--batch", "32", "--steps", "15"], cuda), time.monotonic(), 300)
    if state != "finished" or "peak_in_use" not in cal:
        raise SystemExit(f"gpu_colocate: calibration run {state}: {cal}")
    per_sample = cal["peak_in_use"] / 32
    ms_per_sample = cal["median_ms"] / 32
    a_batch = int(0.60 * capacity / per_sample)
    b_batch = int(0.50 * capacity / per_sample)
    # Host-memory fallback can make a job many times slower: every run has a deadline so that a
    # part fits one device call (10 min); a job killed at it is reported as unfinished.
    target_a, target_b, arrival, deadline = (30.0, 20.0, 10.0, 90.0) if quick else (120.0, 80.0, 40.0, 900.0)
    a_args = ["--model", "resnet50", "--batch", str(a_batch),
              "--steps", str(max(20, int(target_a * 1000 / (ms_per_sample * a_batch))))]
    b_args = ["--model", "resnet50", "--batch", str(b_batch),
              "--steps", str(max(20, int(target_b * 1000 / (ms_per_sample * b_batch))))]
    b_need = int(1.1 * b_batch * per_sample)
    print(f"   calibration: {per_sample / (1 << 20):.0f} MiB and {ms_per_sample:.2f} ms per sample; "
          f"A batch {a_batch}, B batch {b_batch} (needs ~{b_need / GiB:.1f} GiB) on {capacity / GiB:.0f} GiB", flush=True)
    res: dict[str, dict] = {}

    t0 = time.monotonic()
    a_solo, a_state, _ = finish(start(a_args, cuda), t0, deadline)
    t0 = time.monotonic()
    b_solo, b_state, _ = finish(start(b_args, cuda), t0, deadline)
    res["FIFO"] = {"A": a_solo, "A_state": a_state, "B": max(0.0, a_solo - arrival) + b_solo,
                   "B_state": f"{b_state} (waited for A)"}

    # Pack: stock PyTorch for both (no ANTMAN_*): B gets what A's caching allocator left.
    t0 = time.monotonic()
    a = start(a_args, None)
    time.sleep(arrival)
    tb = time.monotonic()
    b_jct, b_state, _ = finish(start(b_args, None), tb, deadline)
    a_jct, a_state, _ = finish(a, t0, deadline)
    res["Pack"] = {"A": a_jct, "A_state": a_state, "B": b_jct, "B_state": b_state}

    # UMem: tf-antman memory for both, no coordinator: B's limit is what is free when it arrives.
    t0 = time.monotonic()
    a = start(a_args, {**cuda, "ANTMAN_HOST_MEMORY": "64GiB"})
    time.sleep(arrival)
    free = gpu_free()
    tb = time.monotonic()
    b_jct, b_state, b_out = finish(start(b_args, {**cuda, "ANTMAN_MEMORY_LIMIT": str(max(free - GiB, 1 << 20)),
                                                  "ANTMAN_HOST_MEMORY": "64GiB"}), tb, deadline)
    a_jct, a_state, _ = finish(a, t0, deadline)
    res["UMem"] = {"A": a_jct, "A_state": a_state, "B": b_jct, "B_state": b_state,
                   "B_host_fallbacks": b_out.get("host_fallbacks")}

    # tf-antman: the daemon places both and its coordinator shrinks A for B.
    d = make_daemon(tmp / "table2", round_s=2 if quick else 5)
    a_id = d.submit([*JOB, *a_args], tenant="batch", kind="opportunistic", name="A")
    d.run_until(lambda dd: dd.job(a_id).started_at is not None, timeout=120)
    time.sleep(arrival)
    b_id = d.submit([*JOB, *b_args], tenant="research", kind="guarantee", memory_bytes=b_need, name="B")
    d.run_until(lambda dd: dd.job(a_id).state.done and dd.job(b_id).state.done, timeout=deadline)
    d.stop_all_jobs()
    ra, rb = d.job(a_id), d.job(b_id)

    def outcome(rec: object, since: float) -> tuple[float, str]:
        if rec.ended_at is None or rec.cancel_requested:  # still running at the deadline
            return deadline, f"unfinished after {deadline:.0f} s (stopped)"
        return rec.ended_at - since, rec.state.value

    a_jct, a_state = outcome(ra, ra.started_at)
    b_jct, b_state = outcome(rb, rb.submit_time)
    res["tf-antman"] = {"A": a_jct, "A_state": a_state, "B": b_jct, "B_state": b_state}
    return {"table2": {k: {kk: (round(vv, 1) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                       for k, v in res.items()},
            "a_batch": a_batch, "b_batch": b_batch, "capacity_bytes": capacity,
            "failed_jobs": int(res["tf-antman"]["A_state"] != "finished") + int(res["tf-antman"]["B_state"] != "finished")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("1", "2"), required=True, help="1: co-location, 2: Table 2")
    p.add_argument("--quick", action="store_true", help="shorter windows and jobs (each part < 8 min)")
    p.add_argument("--repeats", type=int, default=0, help="part 1 repeats (default 1 quick, 2 full)")
    a = p.parse_args()
    capacity = gpu_or_exit()
    for lib in ("libantman_torch.so", "libantman_core.so"):
        if not (REPO / "tf_antman" / "_native" / lib).exists():
            raise SystemExit(f"gpu_colocate: tf_antman/_native/{lib} is missing: build it with "
                             "`python setup.py build_native` and carry tf_antman/_native")
    tmp = Path(tempfile.mkdtemp(prefix="tf-antman-gpu-colocate-"))
    autoload_like_the_wheel(tmp)
    # Build the op hook once, before any timing (later jobs load it from PyTorch's cache).
    subprocess.run([sys.executable, "-c", "from tf_antman.torch.compute import build_hook; build_hook(True)"],
                   env=env_for(None), check=True)
    if a.part == "1":
        print("1. guarantee ResNet-50 + two opportunistic jobs on one GPU (scheduler_lite, nvml)", flush=True)
        out = part1(a.quick, a.repeats or (1 if a.quick else 2), tmp)
    else:
        print("2. Table 2: A (opportunistic) running, B (guarantee) arrives", flush=True)
        out = part2(a.quick, capacity, tmp)
        for k, v in out["table2"].items():
            print(f"   {k:<10} JCT A {v['A']:>8} s  {v['A_state']:<14} JCT B {v['B']:>8} s  {v['B_state']}")
    out.update(part=int(a.part), quick=a.quick)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
