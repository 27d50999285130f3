"""Compute dynamic scaling (GpuOpManager) on the emulated device, with real TF training.

    python bench/compute.py [--quick] [--reps N] [--op-share S] [--op-priority low|normal] [--op-width W] [--pairs N]

Every comparison alternates within seconds inside the same processes (phases), so that the
drifts of a shared 2-core machine hit the measured case and its baseline alike, and every figure
is judged by something the op manager does not control:

1. Share accuracy: a device-bound job (4 training steps per tf.function call) on ONE TF thread
   cycles 1 -> 0.25 -> 1 -> 0.5 -> 1 -> 0.75 -> 1 ... (phases of 2.5 s quick / 4 s full, the first
   0.5 s of each not measured). The share is a fraction of wall time the device is busy with the
   job (docs/op-manager.md); on one TF thread the device is that thread, so the judge is the
   kernel's on-CPU time of the job's TF threads over wall time (bench/_threadcpu.py: schedstat
   of every thread Python did not start), not the manager's timers. Next to it: the same
   relative to the 100% phases around each target (reads high by 1/(rate at 100%): at 100% the
   thread idles while Python runs between steps, and those gaps earn a throttled job tokens),
   and (on-CPU + waiting for a CPU)/wall, an upper bound that counts wake-up latency. The time
   the thread waited for a CPU and the CPU other processes used (/proc/stat) are reported: an
   op slowed by another process's load is charged in full by the manager while its on-CPU time
   is less, so on a loaded machine the figure reads low.
2. Interference: a resource-guarantee (RG) job on both cores runs throughout while an
   opportunistic (OP) job beside it alternates paused / op share (default 0.05) every phase
   (1 s; 6 pairs a block quick, 30 full: a block of 10 pairs moves by +-3% on 2 shared cores,
   the size of the target), then one unthrottled phase per block. Each OP phase is
   judged by the RG job's own wall-clock mean step time against the paused phases on both sides.
   Figures: rg_slowdown_throttled (median of blocks), _worst (worst block), _worst_quiet (worst
   block over its pairs without foreign load), rg_slowdown_unthrottled, op_progress_ratio (OP
   steps/s at its share over unthrottled), rg_slowdown_floor (the OP job's own CPU share).
   The OP job runs at the device priority scheduler_lite gives opportunistic jobs
   (ANTMAN_DEVICE_PRIORITY=low: its threads under SCHED_IDLE, tf_antman/priority.py);
   --op-priority normal measures it without (op_priority in the JSON line says which).
   --op-width W gives the OP job narrower layers than the RG job (default: the same 1024): its
   working set then fits in a core's L2, which tells the caches' part of the loss apart.
3. Input pipelines: a job reading through tf.data (map + prefetch) and one with a py_function
   map survive 100 share changes (pause included) each; an input-bound job (its py_function
   sleeps 20 ms a batch) at share 0.5 keeps the step rate it has unthrottled, because waiting
   for input is not charged. Figures: tfdata_100_changes_ok, input_bound_rate_ratio.
4. Cost at 100%: step time under tf-antman (share 1.0) over stock TF, medians of alternating runs.
   Figure: step_time_ratio_at_100.
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess

from _common import finish_job, median, run_job, start_job, step_time_ratio_vs_stock, table

TARGETS = (0.25, 0.5, 0.75)
RG_WIDTH = 1024  # interference: the RG job's layer width, and the OP job's unless --op-width
QUIET_CORES = 0.1  # interference: a phase during which other processes used more than this is noisy


def _quiet(phase: dict) -> bool:
    """No foreign load next to the RG and OP jobs (which together want every core)."""
    return phase["foreign_cpu"] / phase["wall"] <= QUIET_CORES


def share_accuracy(phase_s: float, cycles: int) -> dict[str, object]:
    """One job on ONE TF thread cycles 1 -> 0.25 -> 1 -> 0.5 -> 1 -> 0.75 -> 1 ...; each target
    phase is judged against the 100% phases on both sides of it, seconds apart in the same
    process, so drifts of the machine hit both alike. The judge is the kernel's CPU time of the
    job's TF threads (bench/_threadcpu.py), not the manager's timers."""
    shares = [v for _ in range(cycles) for v in (1.0, *TARGETS[:1], 1.0, *TARGETS[1:2], 1.0, *TARGETS[2:])] + [1.0]
    args = ["--mode", "loop", "--inner", "4", "--width", "1024", "--batch", "512", "--warmup", "3",
            "--phases", ",".join(map(str, shares)), "--phase-s", str(phase_s)]
    phases = run_job(args, {"ANTMAN_ENABLE": "1"}, threads=1)["phases"]
    rel: dict[float, list[float]] = {t: [] for t in TARGETS}
    runnable: dict[float, list[float]] = {t: [] for t in TARGETS}
    absolute: dict[float, list[float]] = {t: [] for t in TARGETS}
    for i, ph in enumerate(phases):
        if ph["share"] == 1.0 or i + 1 >= len(phases):
            continue
        around = (phases[i - 1], phases[i + 1])
        full = statistics.mean(p["device_cpu"] / p["wall"] for p in around)
        value = ph["device_cpu"] / ph["wall"] / full
        rel[ph["share"]].append(value)
        runnable[ph["share"]].append(ph["device_runnable"] / ph["wall"])
        absolute[ph["share"]].append(ph["device_cpu"] / ph["wall"])

    def error(values: dict[float, list[float]]) -> tuple[float, float]:
        med = max(abs(median(v) - t) * 100 for t, v in values.items())
        worst = max(abs(x - t) * 100 for t, v in values.items() for x in v)
        return med, worst

    err, worst = error(absolute)
    # The phase furthest from its target, with what the machine did meanwhile: an outlier can be
    # told apart from a manager error (foreign load or CPU wait explain a phase that reads low).
    far = max((p for p in phases if p["share"] != 1.0), key=lambda p: abs(p["device_cpu"] / p["wall"] - p["share"]))
    worst_phase = {"share": far["share"], "measured": far["device_cpu"] / far["wall"],
                   "cpu_wait": (far["device_runnable"] - far["device_cpu"]) / far["wall"],
                   "foreign_cores": far["foreign_cpu"] / far["wall"], "index": phases.index(far)}
    err_rel, worst_rel = error(rel)
    err_run, _ = error(runnable)
    rows = [[t, median(absolute[t]), min(absolute[t]), max(absolute[t]), median(runnable[t]), median(rel[t])]
            for t in TARGETS]
    waits = [(p["device_runnable"] - p["device_cpu"]) / p["wall"] for p in phases]
    full = [p["device_cpu"] / p["wall"] for p in phases if p["share"] == 1.0]
    return {"rows": rows, "error": err, "worst": worst, "error_runnable": err_run, "error_relative": err_rel,
            "worst_relative": worst_rel, "full_median": median(full), "phases": len(phases), "worst_phase": worst_phase,
            "wait_median": median(waits), "wait_max": max(waits),
            "foreign_cores_median": median([p["foreign_cpu"] / p["wall"] for p in phases])}


def _steps_in(spans: list[list[float]], window: dict) -> list[float]:
    return [b - a for a, b in spans if a >= window["t0"] and b <= window["t1"]]


def _mean_step(spans: list[list[float]], window: dict) -> float:
    """The RG job's mean step time inside a phase: its throughput, which a sparse interruption
    lowers in full (a median would hide an OP op that delays one RG step in ten)."""
    steps = _steps_in(spans, window)
    return statistics.mean(steps) if steps else math.nan


def interference_phases(op_share: float, pairs: int, blocks: int) -> list[float]:
    """OP shares phase by phase: each block alternates paused / op_share `pairs` times, then one
    unthrottled phase; paused phases sit on both sides of every other phase."""
    block = [v for _ in range(pairs) for v in (0.0, op_share)] + [0.0, 1.0]
    return [v for _ in range(blocks) for v in block] + [0.0]


def interference(op_share: float, phase_s: float, settle_s: float, pairs: int, blocks: int,
                 op_priority: str = "low", op_width: int = RG_WIDTH) -> dict[str, object]:
    """A resource-guarantee (RG) job on both cores runs throughout while an opportunistic (OP) job
    beside it alternates paused / op_share every phase_s seconds (`pairs` times per block), then
    runs one unthrottled phase. Each OP phase is judged by the RG job's own mean step time (wall
    clock, not the manager's figures) over the mean of the paused phases on both sides of it, a
    second away: the machine's drifts (the RG step time alone moves by +-10% within seconds
    here) hit a phase and its baseline alike, and the pairs of a block average what remains.
    A paused OP job holds its ops and uses no CPU, so the paused phases are the RG job alone;
    a separate RG-alone run checks that."""
    rg_args = ["--mode", "loop", "--width", str(RG_WIDTH)]
    shares = interference_phases(op_share, pairs, blocks)
    total = len(shares) * phase_s
    alone = run_job([*rg_args, "--duration", "6"], {"ANTMAN_ENABLE": "1"}, threads=2)["step_times"]
    rg = start_job([*rg_args, "--duration", str(total + 15)], {"ANTMAN_ENABLE": "1"}, threads=2)
    op = start_job(["--mode", "loop", "--width", str(op_width), "--seed", "1", "--phases", ",".join(map(str, shares)),
                    "--phase-s", str(phase_s), "--settle-s", str(settle_s), "--watch-pids", str(rg.pid)],
                   {"ANTMAN_ENABLE": "1", "ANTMAN_DEVICE_PRIORITY": op_priority}, threads=2)
    o = finish_job(op)
    r = finish_job(rg)
    ph = o["phases"]
    step = [_mean_step(r["step_spans"], w) for w in ph]
    # OP steps that ENDED in a phase: at 5% one OP step outlasts a 1 s phase.
    op_rate = [sum(w["t0"] <= b <= w["t1"] for _, b in o["step_spans"]) / w["wall"] for w in ph]

    def slowdown(i: int) -> float:
        return step[i] / statistics.mean([step[i - 1], step[i + 1]]) - 1

    per_block = 2 * pairs + 2
    throttled: list[float] = []
    quiet: list[float] = []
    unthrottled: list[float] = []
    progress: list[float] = []
    single: list[float] = []
    for b in range(blocks):
        first = b * per_block
        ops = [first + 2 * k + 1 for k in range(pairs)]
        values = [slowdown(i) for i in ops]
        single += values
        throttled.append(statistics.mean(values))
        calm = [v for i, v in zip(ops, values, strict=True) if all(_quiet(ph[j]) for j in (i - 1, i, i + 1))]
        if 2 * len(calm) >= pairs:  # a block counts as quiet on at least half its pairs
            quiet.append(statistics.mean(calm))
        full = first + per_block - 1
        unthrottled.append(slowdown(full))
        if op_rate[full]:
            progress.append(statistics.mean(op_rate[i] for i in ops) / op_rate[full])
    paused = [m for m, w in zip(step, ph, strict=True) if w["share"] == 0.0]
    # What the OP job took of the machine while held to its share (kernel CPU time of its process):
    # a guarantee job that keeps every core busy cannot lose less than this fraction of them.
    op_cpu = median([w["process_cpu"] / w["wall"] for w in ph if w["share"] == op_share])
    return {
        "rg_step_ms_alone": statistics.mean(alone) * 1e3,
        "rg_step_ms_op_paused": median(paused) * 1e3,
        "rg_slowdown_unthrottled": median(unthrottled),
        "rg_slowdown_throttled": median(throttled),
        "rg_slowdown_throttled_worst": max(throttled),
        "rg_slowdown_throttled_all": throttled,
        "rg_slowdown_unthrottled_all": unthrottled,
        "rg_slowdown_throttled_quiet": quiet,
        "rg_slowdown_single_phase_range": (min(single), max(single)),
        # Every pair of every block pooled, with its standard error: the figure with an error bar.
        "rg_slowdown_pooled": statistics.mean(single),
        "rg_slowdown_pooled_stderr": statistics.stdev(single) / math.sqrt(len(single)) if len(single) > 1 else math.nan,
        "op_progress_ratio": median(progress) if progress else 0.0,
        "op_share": op_share,
        "op_cpu_cores_throttled": op_cpu,
        "rg_slowdown_floor": op_cpu / (os.cpu_count() or 1),
        "noisy_phases": sum(not _quiet(w) for w in ph),
        "phases": len(ph),
        "detail": [[w["share"], round(m * 1e3, 2), round(w["process_cpu"] / w["wall"], 3),
                    round(w["foreign_cpu"] / w["wall"], 2)] for m, w in zip(step, ph, strict=True)],
    }


def input_pipelines(reps: int) -> dict[str, object]:
    """100 share changes during each input pipeline; step rate of an input-bound job."""
    ok = True
    for kind in ("tfdata", "pyfunc"):
        args = ["--mode", "loop", "--input", kind, "--input-sleep-ms", "2", "--steps", "80",
                "--width", "512", "--batch", "128", "--flip-shares", "100"]
        try:
            r = finish_job(start_job(args, {"ANTMAN_ENABLE": "1"}, threads=2), timeout=300)
            ok = ok and len(r["step_times"]) == 80 and r["compute"]["ops_waiting_now"] == 0
        except (RuntimeError, subprocess.TimeoutExpired):
            ok = False
    bound = ["--mode", "loop", "--input", "pyfunc", "--input-sleep-ms", "20", "--steps", "60",
             "--width", "256", "--batch", "64"]
    ratios = []
    for _ in range(reps):
        full = run_job(bound, {"ANTMAN_COMPUTE_SHARE": "1.0"}, threads=2)
        half = run_job(bound, {"ANTMAN_COMPUTE_SHARE": "0.5"}, threads=2)
        ratios.append((len(half["step_times"]) / half["wall"]) / (len(full["step_times"]) / full["wall"]))
    return {"tfdata_100_changes_ok": ok, "input_bound_rate_ratio": median(ratios),
            "input_bound_rate_ratio_min": min(ratios)}


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


SECTIONS = ("share", "interference", "input", "cost")


def report_share(phase_s: float, reps: int) -> dict[str, object]:
    print(f"1. share accuracy ({reps} cycles of {phase_s} s phases 1 -> target -> 1, one process, one TF thread)")
    sa = share_accuracy(phase_s, reps)
    print(table(sa["rows"], ["target", "TF thread CPU / wall (median)", "min", "max", "runnable / wall",
                             "CPU vs 100% phases around"]))
    print(f"error: {sa['error']:.2f} points (median per target, worst target); worst single phase "
          f"{sa['worst']:.2f}; relative to the 100% phases (which use {sa['full_median']:.3f}) "
          f"{sa['error_relative']:.2f}; the TF thread waited for a CPU {sa['wait_median']:.1%} of the time "
          f"(median phase; most {sa['wait_max']:.1%}); other processes used {sa['foreign_cores_median']:.2f} cores")
    w = sa["worst_phase"]
    print(f"furthest phase: #{w['index']} at {w['share']} read {w['measured']:.3f}; meanwhile the TF thread waited "
          f"for a CPU {w['cpu_wait']:.1%} of the time and other processes used {w['foreign_cores']:.2f} cores\n")
    return {
        "share_error_points_cpu_time": _r(sa["error"]),
        "share_error_points_cpu_time_worst_phase": _r(sa["worst"]),
        "share_error_points_runnable": _r(sa["error_runnable"]),
        "share_error_points_vs_100": _r(sa["error_relative"]),
        "share_full_rate": _r(sa["full_median"]),
        "share_cpu_wait_median": _r(sa["wait_median"], 4),
        "share_foreign_cores_median": _r(sa["foreign_cores_median"]),
        "share_phases": sa["phases"],
        "share_worst_phase": {k: _r(v) if isinstance(v, float) else v for k, v in sa["worst_phase"].items()},
    }


def report_interference(op_share: float, phase_s: float, settle_s: float, pairs: int,
                        blocks: int, op_priority: str, op_width: int) -> dict[str, object]:
    print(f"2. RG job next to an opportunistic job (device priority {op_priority}, width {op_width}) alternating "
          f"paused / {op_share} every {phase_s} s ({pairs} pairs, then 1.0), {blocks} blocks")
    it = interference(op_share, phase_s, settle_s, pairs, blocks, op_priority, op_width)
    print(table(it["detail"], ["OP phase share", "RG step ms (mean)", "OP cores", "foreign cores"]))
    lo, hi = it["rg_slowdown_single_phase_range"]
    print(table([
        ["RG alone (separate run)", it["rg_step_ms_alone"], "-"],
        ["RG, OP paused (median of phases)", it["rg_step_ms_op_paused"], "-"],
        ["RG, OP unthrottled", "-", str([round(v, 4) for v in it["rg_slowdown_unthrottled_all"]])],
        [f"RG, OP at {op_share}", "-", str([round(v, 4) for v in it["rg_slowdown_throttled_all"]])],
    ], ["case", "RG step ms", "RG slowdown per block"]))
    print(f"single {op_share} phases against their neighbours: {lo:+.1%} .. {hi:+.1%}; all {pairs * blocks} pooled: "
          f"{it['rg_slowdown_pooled']:+.2%} +- {it['rg_slowdown_pooled_stderr']:.2%} (standard error)")
    print(f"OP steps/s at {op_share} over unthrottled: {it['op_progress_ratio']:.3f}; the OP job used "
          f"{it['op_cpu_cores_throttled']:.3f} cores at its share, {it['rg_slowdown_floor']:.1%} of the machine "
          f"(the least an RG job using every core can lose); {it['noisy_phases']} of {it['phases']} phases noisy\n")
    quiet = it["rg_slowdown_throttled_quiet"]
    return {
        "rg_slowdown_unthrottled": round(it["rg_slowdown_unthrottled"], 4),
        "rg_slowdown_throttled": round(it["rg_slowdown_throttled"], 4),
        "rg_slowdown_throttled_worst": round(it["rg_slowdown_throttled_worst"], 4),
        "rg_slowdown_throttled_worst_quiet": _r(max(quiet) if quiet else None, 4),
        "rg_slowdown_throttled_all": [round(v, 4) for v in it["rg_slowdown_throttled_all"]],
        "rg_slowdown_single_phase_range": [round(lo, 4), round(hi, 4)],
        "rg_slowdown_pooled": round(it["rg_slowdown_pooled"], 4),
        "rg_slowdown_pooled_stderr": round(it["rg_slowdown_pooled_stderr"], 4),
        "rg_noisy_phases": it["noisy_phases"],
        "rg_step_ms_alone": round(it["rg_step_ms_alone"], 2),
        "rg_step_ms_op_paused": round(it["rg_step_ms_op_paused"], 2),
        "op_progress_ratio": round(it["op_progress_ratio"], 4),
        "op_share": op_share,
        "op_priority": op_priority,
        "op_width": op_width,
        "op_cpu_cores_throttled": round(it["op_cpu_cores_throttled"], 4),
        "rg_slowdown_floor": round(it["rg_slowdown_floor"], 4),
        "rg_pairs_per_block": pairs,
        "rg_phase_s": phase_s,
    }


def report_input(reps: int) -> dict[str, object]:
    print("3. input pipelines under throttling")
    ip = input_pipelines(reps)
    print(f"100 share changes during tf.data and py_function pipelines: {'ok' if ip['tfdata_100_changes_ok'] else 'FAILED'}")
    print(f"input-bound job, steps/s at share 0.5 over share 1: {ip['input_bound_rate_ratio']:.3f} "
          f"(min {ip['input_bound_rate_ratio_min']:.3f})\n")
    return {"tfdata_100_changes_ok": ip["tfdata_100_changes_ok"],
            "input_bound_rate_ratio": round(ip["input_bound_rate_ratio"], 4)}


def report_cost(quick: bool) -> dict[str, object]:
    print("4. step time at share 100% vs stock TF (Keras fit, medians of alternating runs)")
    ratio, stock, ours = step_time_ratio_vs_stock(3 if quick else 7, 40 if quick else 150)
    print(table([["stock TF", median(stock) * 1e3], ["tf-antman 100%", median(ours) * 1e3]], ["run", "step ms"]))
    print(f"ratio: {ratio:.4f}\n")
    return {"step_time_ratio_at_100": round(ratio, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter phases, fewer cycles (about 4 minutes)")
    p.add_argument("--reps", type=int, default=0,
                   help="cycles of the alternating phases, and repeats of the input checks (default 3 quick, 6 full)")
    p.add_argument("--op-share", type=float, default=0.05, help="share of the throttled opportunistic job")
    p.add_argument("--op-priority", choices=("low", "normal"), default="low",
                   help="ANTMAN_DEVICE_PRIORITY of the opportunistic job (default low, as scheduler_lite "
                        "runs opportunistic jobs on emulated devices)")
    p.add_argument("--op-width", type=int, default=RG_WIDTH,
                   help=f"interference: the opportunistic job's layer width (default {RG_WIDTH}, the RG job's): "
                        "its widest layer and two optimizer slots take 3 x width^2 x 4 bytes, 12 MiB at 1024, "
                        "192 KiB at 128 (L2 here: 1.25 MiB a core), so a "
                        "small width shows how much of the RG job's loss is the caches")
    p.add_argument("--pairs", type=int, default=0,
                   help="interference: paused/OP pairs per block (default 6 quick, 30 full); a block's "
                        "noise falls as 1/sqrt(pairs)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    a = p.parse_args()
    sections = [v for v in a.sections.split(",") if v]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {', '.join(unknown)}; accepted: {', '.join(SECTIONS)}")
    if not 0 <= a.reps <= 1000:
        p.error(f"--reps: {a.reps} is outside the accepted range [0, 1000] (0: the default)")
    if not 0 <= a.pairs <= 1000:
        p.error(f"--pairs: {a.pairs} is outside the accepted range [0, 1000] (0: the default)")
    if not 16 <= a.op_width <= 4096:
        p.error(f"--op-width: {a.op_width} is outside the accepted range [16, 4096]")
    if not 0.0 < a.op_share < 1.0:
        p.error(f"--op-share: {a.op_share} is outside the accepted range (0, 1)")
    phase_s = 2.5 if a.quick else 4.0
    reps = a.reps or (3 if a.quick else 6)

    out: dict[str, object] = {}
    if "share" in sections:
        out.update(report_share(phase_s, reps))
    if "interference" in sections:
        out.update(report_interference(a.op_share, 1.0, 0.25, a.pairs or (6 if a.quick else 30), reps,
                                       a.op_priority, a.op_width))
    if "input" in sections:
        out.update(report_input(min(reps, 3)))
    if "cost" in sections:
        out.update(report_cost(a.quick))
    out.update(cycles=reps, phase_s=phase_s, quick=a.quick, sections=sections)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
