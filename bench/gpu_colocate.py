"""Co-location of PyTorch jobs on one real GPU through scheduler_lite (paper §3.3, §5.1, Table 2).

    python bench/gpu_colocate.py --part 1 [--quick]    # guarantee job + two opportunistic jobs
    python bench/gpu_colocate.py --part 2 [--quick]    # the paper's Table 2 scenario
    python bench/gpu_colocate.py --part 1|2 --device cpu   # CPU dry run of the whole pipeline
    ... [--out DIR]   # rows.jsonl there (default: the run's temporary directory)

Needs one NVIDIA GPU (NVML), PyTorch with CUDA, a C++ compiler and ninja for the op hook, and the
native libraries (tf_antman/_native/libantman_torch.so, libantman_core.so). Without a GPU it
prints one line and exits 77. Every figure is measured in the same run as its baseline, from the
jobs' own step clocks (bench/_torch_job.py), not from tf-antman's statistics.

`--device cpu` is a dry run, not a measurement: the same daemon, jobs, baselines, parts and JSON
on CPU PyTorch, with tiny conv nets on an emulated GPU (scheduler_lite `devices.kind =
"emulated"`, jobs on ANTMAN_DEVICE=emulated: compute shares gate their CPU ops, memory limits
bound nothing), short windows, and a nominal memory per sample in part 2. It checks that the GPU
command runs end to end before a GPU session spends its time on it. Its JSON says
`"device": "cpu", "dry_run": true`; none of its numbers is a GPU figure, and its plot goes to the
temporary directory, never to docs/.

1. Each repeat: the resource-guarantee job (ResNet-50) alone, each opportunistic job (ResNet-18,
   MobileNetV2) alone (plain jobs under tf-antman at share 1); then the scheduler_lite daemon
   (devices.kind = "nvml") runs the opportunistic jobs and the guarantee job arrives, which its
   local coordinator protects by scaling them (the paper's order: Algorithm 1 gives a GPU that
   reads busy at or above M no new opportunistic job, so they cannot join a running ResNet-50;
   the second one may wait for the GPU to read below M and is then listed in ops_not_placed);
   then the guarantee job alone again. rg_slowdown = RG median step in the co-located window /
   RG median step of the two solo runs - 1 (paper <= 3.5%). op_progress_ratio = an opportunistic
   job's steps/s in that window / its steps/s alone (paper 57% for ResNet-50). failed_jobs counts
   every job that did not finish or was not ended by the bench. Saves
   docs/gpu_colocate_timeline.png.
2. Table 2: opportunistic job A (ResNet-50, batch sized to ~60% of the GPU's memory) runs; a
   guarantee job B (batch sized to ~50%) arrives a fixed delay after A's first completed step
   (A's --log; by then A holds its peak memory, whatever its start-up took; a row whose A makes
   no step within the profile's first_step_s ends the bench with one line). JCTs under FIFO (B waits for A: A's and B's
   solo runs), Pack (stock PyTorch, both at once, no tf-antman: B runs out of memory), UMem
   (tf-antman memory, no coordinator: B's limit is the memory free at its arrival, the rest in
   host memory) and tf-antman (the daemon shrinks A, B gets its memory). Batch sizes come from a
   calibration run that measures ResNet-50's memory per sample on this GPU.
Last line: one JSON object. Each finished part-2 row (and the calibration, and each part-1
repeat) is also written as soon as it is done, one JSON line in DIR/rows.jsonl (--out) and one
`gpu_colocate: row ...` line on stderr: a run stopped at a device call's time limit keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _gpu_jobs import (  # bench/_gpu_jobs.py, beside this script
    CPU_CAPACITY,
    JOB,
    REPO,
    GiB,
    Profile,
    autoload_like_the_wheel,
    env_for,
    finish,
    gpu_free,
    gpu_or_exit,
    in_window,
    make_profile,
    rate,
    read_log,
    start,
    wait_first_step,
)
from _procs import describe_rc, forget, install_stop_handlers, kill_all, start_child  # bench/_procs.py

sys.path.insert(0, str(REPO))

from scheduler_lite.testing import run_until, stop_all_jobs  # noqa: E402 - after the path above

# Every daemon this run made: its jobs (each in a session of its own) are stopped on any exit.
_daemons: list = []


class BudgetSpent(Exception):  # noqa: N818 - raised by the --budget timer in the main thread
    pass


def _budget_spent(_signum: int, _frame: object) -> None:
    raise BudgetSpent


def stop_everything() -> None:
    """Stops every job this run started, whatever the exit: each daemon's jobs (SIGTERM to their
    groups, SIGKILL 2 s later), then every process group it started itself and every process
    still descended from it (bench/_procs.py)."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    for d in _daemons:
        try:
            stop_all_jobs(d, grace_s=2)
        except Exception as err:  # noqa: BLE001 - the kill below still runs
            print(f"gpu_colocate: stopping a daemon's jobs: {type(err).__name__}: {err}", file=sys.stderr)
    kill_all()


def make_daemon(state_dir: Path, prof: Profile):  # noqa: ANN201 - scheduler_lite.daemon.Daemon
    from scheduler_lite.config import parse_config
    from scheduler_lite.daemon import Daemon
    from scheduler_lite.storage import SqliteStorage

    devices: dict = {"kind": "nvml"}
    if prof.dry_run:
        devices = {"kind": "emulated", "emulated": [{"id": 0, "memory": str(CPU_CAPACITY)}]}
    cfg = parse_config({
        "version": 1,
        "paths": {"state_dir": str(state_dir)},
        "devices": devices,
        "tenants": [{"name": "research", "gpu_quota": 1}, {"name": "batch", "gpu_quota": 0}],
        "jobs": {"host_memory": "4GiB" if prof.dry_run else "64GiB", "cancel_grace_s": 10},
        "daemon": {"tick_interval_s": 0.25, "schedule_interval_s": 1, "utilisation_window_s": 10},
        # GPU defaults of docs/policies.md except a shorter round, so a short bench sees rounds.
        "coordinator": {"round_interval_s": prof.round_s},
    }, base_dir=state_dir)
    d = Daemon(cfg, SqliteStorage(cfg.db_path))
    _daemons.append(d)
    return d


def sample(d, names: dict[str, str], t0: float, rows: list[dict]) -> None:  # noqa: ANN001
    now = time.monotonic() - t0
    for g in d.status().gpus:
        for j in g.jobs:
            rows.append({"t": now, "job": names.get(j.job_id, j.job_id), "limit": j.memory_limit_bytes,
                         "share": j.compute_share, "median_ms": j.step_ms_median,
                         "host": j.host_in_use_bytes, "phase": g.coordinator_phase})


def plot_timeline(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for job in sorted({r["job"] for r in rows}):
        rs = [r for r in rows if r["job"] == job]
        t = [r["t"] for r in rs]
        nan = float("nan")  # before the job's first stats.json: nothing in force to draw
        axes[0].plot(t, [r["limit"] / GiB if r["limit"] is not None else nan for r in rs], label=job)
        axes[1].plot(t, [r["share"] if r["share"] is not None else nan for r in rs], label=job)
        axes[2].plot(t, [r["median_ms"] if r["median_ms"] else float("nan") for r in rs], label=job)
    axes[0].set_ylabel("memory limit (GiB)")
    axes[1].set_ylabel("compute share")
    axes[2].set_ylabel("step time, median (ms)")
    axes[2].set_xlabel("time (s)")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


RG = ["--model", "resnet50", "--batch", "64"]
OPS = {"op-resnet18": ["--model", "resnet18", "--batch", "128"],
       "op-mobilenet": ["--model", "mobilenet_v2", "--batch", "128"]}


def solo_run(prof: Profile, name: str, args: list[str], log: Path) -> tuple[list[float], float, str]:
    """One job alone on the device under tf-antman at share 1 (no daemon): its step times and
    steps/s after the warm-up, and its final state."""
    _, state, _ = finish(start(prof, [*args, "--seconds", str(prof.windows[0] + prof.warmup_s), "--log", str(log)],
                               prof.antman_env()), time.monotonic())
    rows = read_log(log)
    steady = in_window(rows, rows[0][0] + prof.warmup_s, rows[-1][0] + 1) if len(rows) > 2 else []
    steps_per_s = rate(rows, rows[0][0] + prof.warmup_s, rows[-1][0]) if len(rows) > 2 else 0.0
    print(f"   {name} alone: {steps_per_s:.2f} steps/s, median step "
          f"{statistics.median([ms for _, ms in steady]) if steady else float('nan'):.1f} ms ({state})", flush=True)
    return [ms for _, ms in steady], steps_per_s, state


def colocate_once(rep: int, prof: Profile, capacity: int, tmp: Path, timeline: list[dict]) -> tuple[dict, int]:
    """One repeat: RG alone, the opportunistic jobs alone, then under one daemon the opportunistic
    jobs run and the RG job arrives (the paper's order, and the only one Algorithm 1 allows: a GPU
    that a guarantee job keeps busy at or above the utilisation threshold M takes no new
    opportunistic job), then RG alone again. Solo runs are plain jobs under tf-antman at share 1."""
    solo_s, op_alone_s, settle_s, co_s = prof.windows
    failed = 0
    rg_solo, _, state = solo_run(prof, "rg-resnet50", RG, tmp / f"rg-solo-a{rep}.log")
    failed += state != "finished"
    op_solo: dict[str, float] = {}
    for name, args in OPS.items():
        _, op_solo[name], state = solo_run(prof, name, args, tmp / f"{name}-solo{rep}.log")
        failed += state != "finished"

    d = make_daemon(tmp / f"daemon{rep}", prof)
    t0 = time.monotonic()
    names: dict[str, str] = {}

    def run_for(seconds: float, until: object = None) -> bool:
        def step(dd: object) -> bool:
            sample(dd, names, t0, timeline)
            return bool(until(dd)) if callable(until) else False

        return run_until(d, step, timeout=seconds)

    ops: dict[str, tuple[str, Path]] = {}
    for name, args in OPS.items():
        log = tmp / f"{name}{rep}.log"
        job_id = d.submit([*JOB, *args, "--seconds", "100000", "--log", str(log), *prof.job_args], tenant="batch",
                          kind="opportunistic", name=name)
        ops[name] = (job_id, log)
        names[job_id] = name
    first_log = next(iter(ops.values()))[1]
    if not run_for(300, lambda dd: len(read_log(first_log)) > 10):
        raise SystemExit("gpu_colocate: the first opportunistic job made no 10 steps in 300 s")
    run_for(op_alone_s)
    rg_log = tmp / f"rg{rep}.log"
    rg = d.submit([*JOB, *RG, "--seconds", "100000", "--log", str(rg_log), *prof.job_args], tenant="research",
                  kind="guarantee", memory_bytes=capacity // 2, name="rg-resnet50")
    names[rg] = "rg-resnet50"
    if not run_for(300, lambda dd: len(read_log(rg_log)) > 10):
        raise SystemExit("gpu_colocate: the guarantee job made no 10 steps in 300 s under the daemon")
    run_for(settle_s + co_s)
    t_co_end = time.time()
    t_co_start = t_co_end - co_s
    jobs = [rg, *(j for j, _ in ops.values())]
    for job_id in jobs:
        d.cancel(job_id)
    run_for(60, lambda dd: all(dd.job(j).state.done for j in jobs))
    for job_id in jobs:
        rec = d.job(job_id)
        failed += rec.state.value == "failed" and not rec.cancel_requested
    stop_all_jobs(d)
    rg_solo2, _, state = solo_run(prof, "rg-resnet50 (again)", RG, tmp / f"rg-solo-b{rep}.log")
    failed += state != "finished"

    solo = rg_solo + rg_solo2
    co = [ms for _, ms in in_window(read_log(rg_log), t_co_start, t_co_end)]
    if not solo or not co:
        raise SystemExit(f"gpu_colocate: no RG steps to compare (solo {len(solo)}, co-located {len(co)})")
    # An opportunistic job that the scheduler had not placed by the window's end (the GPU read
    # busy) made no steps in it: listed, not counted as progress 0.
    op_ratio: dict[str, float] = {}
    not_placed: list[str] = []
    for n, (_, log) in ops.items():
        rows = read_log(log)
        if not rows or rows[0][0] >= t_co_end:
            not_placed.append(n)
        elif op_solo[n]:
            op_ratio[n] = rate(rows, max(t_co_start, rows[0][0]), t_co_end) / op_solo[n]
    r = {"rg_solo_ms": statistics.median(solo), "rg_colocated_ms": statistics.median(co),
         "rg_solo_ms_runs": [statistics.median(rg_solo) if rg_solo else None,
                             statistics.median(rg_solo2) if rg_solo2 else None],
         "rg_solo_steps": len(solo), "rg_co_steps": len(co), "op_progress_ratio": op_ratio,
         "op_solo_steps_per_s": op_solo, "ops_not_placed": not_placed}
    r["rg_slowdown"] = r["rg_colocated_ms"] / r["rg_solo_ms"] - 1
    return r, failed


def record_row(rows: Path, name: str, value: dict) -> None:
    """One finished row, at once: a JSON line appended to `rows` (kept if the run is killed
    later) and the same line on stderr."""
    line = json.dumps({"row": name, **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in value.items()}})
    with rows.open("a") as f:
        f.write(line + "\n")
    print(f"gpu_colocate: row {line}", file=sys.stderr, flush=True)


def part1(prof: Profile, capacity: int, repeats: int, tmp: Path, rows: Path) -> dict:
    failed = 0
    results: list[dict] = []
    timeline: list[dict] = []
    for rep in range(repeats):
        r, f = colocate_once(rep, prof, capacity, tmp, timeline)
        failed += f
        record_row(rows, f"repeat {rep + 1}", {**r, "failed_jobs": f})
        print(f"   repeat {rep + 1}: RG {r['rg_solo_ms']:.1f} -> {r['rg_colocated_ms']:.1f} ms "
              f"({100 * r['rg_slowdown']:+.1f}%), op progress "
              f"{ {k: round(v, 3) for k, v in r['op_progress_ratio'].items()} }"
              f"{', not placed: ' + ', '.join(r['ops_not_placed']) if r['ops_not_placed'] else ''}", flush=True)
        results.append(r)
    (tmp / "timeline.json").write_text(json.dumps(timeline))
    if prof.dry_run:  # never where a GPU figure belongs
        plot = tmp / "gpu_colocate_timeline_cpu_dry_run.png"
        title = "CPU dry run of bench/gpu_colocate.py (not a GPU measurement)"
    else:
        plot = REPO / "docs" / "gpu_colocate_timeline.png"
        title = "tf-antman, PyTorch jobs on one GPU (bench/gpu_colocate.py)"
    plot_error = None
    try:
        plot_timeline(timeline, plot, title)
        print(f"   timeline plot: {plot}")
    except ImportError as err:
        if not prof.dry_run:
            raise
        plot_error = f"no plot: {err} (the GPU image has matplotlib)"  # a dry run's venv may not
        print(f"   {plot_error}")
    slow = [r["rg_slowdown"] for r in results]
    ratios = [v for r in results for v in r["op_progress_ratio"].values()]
    out = {"rg_slowdown": round(statistics.median(slow), 4), "rg_slowdown_worst": round(max(slow), 4),
           "op_progress_ratio": round(statistics.median(ratios), 3) if ratios else None,
           "op_progress_ratio_worst": round(min(ratios), 3) if ratios else None,
           "ops_not_placed": sorted({n for r in results for n in r["ops_not_placed"]}),
           "failed_jobs": failed, "repeats": repeats, "runs": results,
           "timeline_plot": None if plot_error else str(plot), "timeline_json": str(tmp / "timeline.json")}
    if plot_error:
        out["timeline_plot_error"] = plot_error
    return out


def part2(prof: Profile, capacity: int, tmp: Path, rows: Path) -> dict:
    cuda = prof.antman_env()
    # Calibration: ResNet-50's peak memory and step time at two batch sizes on this GPU, fitted
    # as fixed + per-sample x batch (fixed: weights, gradients and optimizer state; launch
    # overhead), so that batches far from the calibration's get the memory and run time meant.
    cal: dict[int, dict] = {}
    for batch in (16, 32):
        _, state, cal[batch] = finish(start(prof, ["--model", "resnet50", "--batch", str(batch), "--steps", "15"], cuda),
                                      time.monotonic(), 300)
        if state != "finished" or "peak_in_use" not in cal[batch]:
            raise SystemExit(f"gpu_colocate: calibration run at batch {batch} {state}: {cal[batch]}")
    per_sample = (cal[32]["peak_in_use"] - cal[16]["peak_in_use"]) / 16
    fixed = cal[32]["peak_in_use"] - 32 * per_sample
    if prof.dry_run:
        # A dry run's tensors are not in the memory core (peak 0): a nominal size gives A and B
        # batches of 12 and 10.
        per_sample, fixed = capacity / 20, 0.0
    if per_sample <= 0 or fixed < 0:
        raise SystemExit(f"gpu_colocate: calibration measured no memory growth with the batch: {cal}")
    ms_per_sample = max((cal[32]["median_ms"] - cal[16]["median_ms"]) / 16, 1e-3)
    ms_fixed = max(cal[32]["median_ms"] - 32 * ms_per_sample, 0.0)
    a_batch = int((0.60 * capacity - fixed) / per_sample)
    b_batch = int((0.50 * capacity - fixed) / per_sample)
    # Host-memory fallback can make a job many times slower: every run has a deadline so that a
    # part fits one device call (10 min); a job killed at it is reported as unfinished.
    target_a, target_b, arrival, deadline = prof.table2

    def steps_for(seconds: float, batch: int) -> str:
        return str(max(20, int(seconds * 1000 / (ms_fixed + ms_per_sample * batch))))

    a_args = ["--model", "resnet50", "--batch", str(a_batch), "--steps", steps_for(target_a, a_batch)]
    b_args = ["--model", "resnet50", "--batch", str(b_batch), "--steps", steps_for(target_b, b_batch)]
    b_need = int(1.1 * (fixed + b_batch * per_sample))
    print(f"   calibration: {fixed / (1 << 20):.0f} MiB + {per_sample / (1 << 20):.0f} MiB per sample, "
          f"{ms_fixed:.2f} ms + {ms_per_sample:.2f} ms per sample; "
          f"A batch {a_batch}, B batch {b_batch} (needs ~{b_need / GiB:.1f} GiB) on {capacity / GiB:.0f} GiB", flush=True)
    record_row(rows, "calibration", {"fixed_bytes": int(fixed), "bytes_per_sample": int(per_sample),
                                     "fixed_ms": ms_fixed, "ms_per_sample": ms_per_sample,
                                     "a_batch": a_batch, "b_batch": b_batch, "capacity_bytes": capacity})
    res: dict[str, dict] = {}

    # B arrives `arrival` s after A's first completed step (A has then reached its peak memory),
    # not after a fixed time from A's start, which A's start-up may exceed. `A_first_step_s`: A's
    # start to that step; `B_arrival_s`: A's start to B's arrival.
    def a_log(row: str) -> list[str]:
        return ["--log", str(tmp / f"table2-{row}-A.log")]

    t0 = time.monotonic()
    a = start(prof, [*a_args, *a_log("FIFO")], cuda)
    a_first = wait_first_step(a, tmp / "table2-FIFO-A.log", t0, prof.first_step_s, "FIFO (A alone)")
    a_solo, a_state, _ = finish(a, t0, deadline)
    t0 = time.monotonic()
    b_solo, b_state, _ = finish(start(prof, b_args, cuda), t0, deadline)
    res["FIFO"] = {"A": a_solo, "A_state": a_state, "B": max(0.0, a_solo - (a_first + arrival)) + b_solo,
                   "B_state": f"{b_state} (waited for A)", "A_first_step_s": a_first,
                   "B_arrival_s": a_first + arrival}
    record_row(rows, "FIFO", res["FIFO"])

    # Pack: stock PyTorch for both (no ANTMAN_*): B gets what A's caching allocator left.
    t0 = time.monotonic()
    a = start(prof, [*a_args, *a_log("Pack")], None)
    a_first = wait_first_step(a, tmp / "table2-Pack-A.log", t0, prof.first_step_s, "Pack")
    time.sleep(arrival)
    tb = time.monotonic()
    b_jct, b_state, _ = finish(start(prof, b_args, None), tb, deadline)
    a_jct, a_state, _ = finish(a, t0, deadline)
    res["Pack"] = {"A": a_jct, "A_state": a_state, "B": b_jct, "B_state": b_state, "A_first_step_s": a_first,
                   "B_arrival_s": tb - t0}
    record_row(rows, "Pack", res["Pack"])

    # UMem: tf-antman memory for both, no coordinator: B's limit is what is free when it arrives.
    t0 = time.monotonic()
    host = "4GiB" if prof.dry_run else "64GiB"
    a = start(prof, [*a_args, *a_log("UMem")], {**cuda, "ANTMAN_HOST_MEMORY": host})
    a_first = wait_first_step(a, tmp / "table2-UMem-A.log", t0, prof.first_step_s, "UMem")
    time.sleep(arrival)
    free = gpu_free(prof)
    tb = time.monotonic()
    b_jct, b_state, b_out = finish(start(prof, b_args, {**cuda, "ANTMAN_MEMORY_LIMIT": str(max(free - GiB, 1 << 20)),
                                                        "ANTMAN_HOST_MEMORY": host}), tb, deadline)
    a_jct, a_state, _ = finish(a, t0, deadline)
    res["UMem"] = {"A": a_jct, "A_state": a_state, "B": b_jct, "B_state": b_state,
                   "B_host_fallbacks": b_out.get("host_fallbacks"), "A_first_step_s": a_first,
                   "B_arrival_s": tb - t0, "B_limit_bytes": max(free - GiB, 1 << 20)}
    record_row(rows, "UMem", res["UMem"])

    # tf-antman: the daemon places both and its coordinator shrinks A for B.
    d = make_daemon(tmp / "table2", prof)
    a_log_path = tmp / "table2-tf-antman-A.log"
    t0 = time.monotonic()
    a_id = d.submit([*JOB, *a_args, *a_log("tf-antman"), *prof.job_args], tenant="batch", kind="opportunistic",
                    name="A")
    stepped = run_until(d, lambda dd: bool(read_log(a_log_path)) or dd.job(a_id).state.done, timeout=prof.first_step_s)
    if not read_log(a_log_path):
        rec = d.job(a_id)
        stop_all_jobs(d)
        raise SystemExit("gpu_colocate: tf-antman: A made no step "
                         + (f"within {prof.first_step_s:.0f} s of its submission (stopped)" if not stepped
                            else f"before it ended ({rec.state.value})")
                         + f"; its job directory is under {tmp / 'table2'}")
    a_first = time.monotonic() - t0
    run_until(d, lambda dd: False, timeout=arrival)  # the daemon keeps ticking while B has not arrived
    b_arrival = time.monotonic() - t0
    b_id = d.submit([*JOB, *b_args, *prof.job_args], tenant="research", kind="guarantee", memory_bytes=b_need,
                    name="B")
    run_until(d, lambda dd: dd.job(a_id).state.done and dd.job(b_id).state.done, timeout=deadline)
    stop_all_jobs(d)
    ra, rb = d.job(a_id), d.job(b_id)

    def outcome(rec: object, since: float) -> tuple[float, str]:
        if rec.ended_at is None or rec.cancel_requested:  # still running at the deadline
            return deadline, f"unfinished after {deadline:.0f} s (stopped)"
        return rec.ended_at - since, rec.state.value

    a_jct, a_state = outcome(ra, ra.started_at)
    b_jct, b_state = outcome(rb, rb.submit_time)
    res["tf-antman"] = {"A": a_jct, "A_state": a_state, "B": b_jct, "B_state": b_state,
                        "A_first_step_s": a_first, "B_arrival_s": b_arrival}
    record_row(rows, "tf-antman", res["tf-antman"])
    return {"table2": {k: {kk: (round(vv, 1) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                       for k, v in res.items()},
            "a_batch": a_batch, "b_batch": b_batch, "capacity_bytes": capacity,
            "calibration": {"fixed_bytes": int(fixed), "bytes_per_sample": int(per_sample),
                            "fixed_ms": round(ms_fixed, 3), "ms_per_sample": round(ms_per_sample, 4)},
            "failed_jobs": int(res["tf-antman"]["A_state"] != "finished") + int(res["tf-antman"]["B_state"] != "finished")}


def check_native() -> None:
    for lib in ("libantman_torch.so", "libantman_core.so"):
        if not (REPO / "tf_antman" / "_native" / lib).exists():
            raise SystemExit(f"gpu_colocate: tf_antman/_native/{lib} is missing: build it with "
                             "`python setup.py build_native` (or bench/gpu/prepare.sh) and carry tf_antman/_native")


def build_op_hook(prof: Profile) -> None:
    """Builds the PyTorch front-end's extensions once, before any timing (later jobs load them
    from PyTorch's cache): the op hook, and on a GPU the CUDA allocator extension where the
    front-end has one; with the ninja of this Python's environment (an activated venv's PATH)."""
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    cuda = not prof.dry_run
    run_captured_ok([sys.executable, "-c",
                     f"from tf_antman.torch import compute; compute.build_hook({cuda}); "
                     f"{cuda} and hasattr(compute, 'build_allocator') and compute.build_allocator()"])


def run_captured_ok(cmd: list[str]) -> None:
    proc = start_child(cmd, env=env_for(None))
    try:
        rc = proc.wait()
    finally:
        forget(proc)
    if rc != 0:
        raise SystemExit(f"gpu_colocate: {' '.join(cmd[:2])} ... failed ({describe_rc(rc)})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("1", "2"), required=True, help="1: co-location, 2: Table 2")
    p.add_argument("--quick", action="store_true", help="shorter windows and jobs (each part < 8 min)")
    p.add_argument("--repeats", type=int, default=0, help="part 1 repeats (default 1 quick or cpu, 2 full)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the measurement on GPU 0; cpu: a dry run of the pipeline (no GPU figure)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for rows.jsonl, each row as soon as it is done (default: the run's "
                        "temporary directory; on a lent GPU: $OUT, which comes back after a timeout too)")
    p.add_argument("--budget", type=float, default=None,
                   help="hard wall budget in seconds: at its end every job is stopped and the line "
                        "printed with \"cut_at_budget\": true and the rows done (exit 1)")
    a = p.parse_args()
    if not 0 <= a.repeats <= 20:
        p.error(f"--repeats: {a.repeats} is outside the accepted range [0, 20] (0: the default)")
    if a.budget is not None and not 0 < a.budget <= 86400:
        p.error(f"--budget: {a.budget} is outside the accepted range (0, 86400]")
    # SIGTERM / SIGINT raise in the main thread: the finally below stops every job, then exit 128 + signal.
    install_stop_handlers(raise_in_main=True)
    if a.budget is not None:
        signal.signal(signal.SIGALRM, _budget_spent)
        signal.setitimer(signal.ITIMER_REAL, a.budget)
    head: dict = {"bench": "gpu_colocate", "version": 1, "part": int(a.part), "dry_run": a.device == "cpu",
                  "quick": a.quick}
    rows: Path | None = None
    try:
        prof = make_profile(a.device, a.quick, a.budget)
        head["windows_s"] = list(prof.windows)
        capacity, device_name = gpu_or_exit(a.device)
        head["device"] = device_name
        check_native()
        tmp = Path(tempfile.mkdtemp(prefix="tf-antman-gpu-colocate-"))
        print(f"gpu_colocate: {device_name}{' (CPU dry run: nothing here is a GPU figure)' if prof.dry_run else ''}; "
              f"logs and job directories in {tmp}", flush=True)
        out_dir = a.out or tmp
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = out_dir / "rows.jsonl"
        rows.write_text("")  # this run's rows only
        print(f"gpu_colocate: finished rows go to {rows}", file=sys.stderr, flush=True)
        autoload_like_the_wheel(tmp)
        build_op_hook(prof)
        where = "an emulated GPU (CPU dry run)" if prof.dry_run else "one GPU (scheduler_lite, nvml)"
        if a.part == "1":
            print(f"1. guarantee ResNet-50 + two opportunistic jobs on {where}", flush=True)
            out = part1(prof, capacity, a.repeats or (2 if a.device == "cuda" and not a.quick else 1), tmp, rows)
        else:
            print(f"2. Table 2 on {where}: A (opportunistic) running, B (guarantee) arrives", flush=True)
            out = part2(prof, capacity, tmp, rows)
            for k, v in out["table2"].items():
                print(f"   {k:<10} JCT A {v['A']:>8} s  {v['A_state']:<14} JCT B {v['B']:>8} s  {v['B_state']}")
    except BudgetSpent:
        stop_everything()
        done = [json.loads(x) for x in rows.read_text().splitlines()] if rows is not None and rows.exists() else []
        print(json.dumps({**head, "cut_at_budget": True, "budget_s": a.budget, "rows_done": done,
                          "failed_jobs": None}), flush=True)
        return 1
    finally:
        stop_everything()
    if prof.dry_run:
        head["note"] = "CPU dry run of the pipeline on tiny models: no figure here is a GPU measurement"
    print(json.dumps({**head, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
