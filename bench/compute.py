"""Compute dynamic scaling (GpuOpManager) on the emulated device, with real TF training.

    python bench/compute.py [--quick] [--reps N]

1. Share accuracy, measured independently of the manager: a device-bound job (4 training steps
   per tf.function call, so few Python gaps) on ONE TF thread (inter- and intra-op), so that its
   device work is serial as on a GPU stream and its CPU time is its busy time, runs at 100% and
   at 25/50/75%, alternating; its achieved share is the process CPU time over wall time (every
   thread, from the kernel). Figure: share_error_points_cpu_time (worst target, median over
   repeats); the manager's own figure is printed next to it for comparison only. With several
   TF threads, ops overlap at 100% and much less when throttled, so CPU time (work) and device
   busy time (the union the manager holds to the share) part ways: not a test of the mechanism.
2. Interference on this 2-core machine: a resource-guarantee (RG) job using both cores, (a) alone,
   (b) next to an unthrottled opportunistic job, (c) next to the opportunistic job held to a
   small share; repeated and alternated. Figures: rg_slowdown_unthrottled, rg_slowdown_throttled
   (medians) and rg_slowdown_throttled_worst (worst repeat), op_progress_ratio.
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
import statistics
import subprocess

from _common import finish_job, median, run_job, start_job, step_time_ratio_vs_stock, table

TARGETS = (0.25, 0.5, 0.75)


def share_accuracy(duration: float, reps: int) -> tuple[list[list[object]], float, float, float]:
    args = ["--mode", "loop", "--inner", "4", "--duration", str(duration), "--width", "1024",
            "--batch", "512", "--warmup", "3"]

    def cpu_rate(r: dict) -> float:
        return r["cpu_total"] / r["wall"]

    def by_manager(r: dict) -> float:
        return (r["compute"]["busy_ns"] - r["compute_start"]["busy_ns"]) / 1e9 / r["wall"]

    rel: dict[float, list[float]] = {t: [] for t in TARGETS}
    mgr: dict[float, list[float]] = {t: [] for t in TARGETS}
    for _ in range(reps):  # alternate, so drifts in machine load hit every target alike
        full = cpu_rate(run_job(args, {"ANTMAN_COMPUTE_SHARE": "1.0"}, threads=1))
        for target in TARGETS:
            r = run_job(args, {"ANTMAN_COMPUTE_SHARE": str(target)}, threads=1)
            rel[target].append(cpu_rate(r) / full)
            mgr[target].append(by_manager(r))
    rows, errs, worst, mgr_errs = [], [], 0.0, []
    for t in TARGETS:
        errs.append(abs(median(rel[t]) - t) * 100)
        worst = max(worst, *(abs(v - t) * 100 for v in rel[t]))
        mgr_errs.append(abs(median(mgr[t]) - t) * 100)
        rows.append([t, median(rel[t]), min(rel[t]), max(rel[t]), median(mgr[t])])
    return rows, max(errs), worst, max(mgr_errs)


def interference(duration: float, op_share: float, reps: int) -> dict[str, float]:
    rg_args = ["--mode", "loop", "--duration", str(duration), "--width", "1024"]
    op_args = ["--mode", "loop", "--duration", str(duration + 6), "--width", "1024", "--seed", "1"]
    rg_env = {"ANTMAN_ENABLE": "1"}
    slow: dict[str, list[float]] = {"unthrottled": [], "throttled": []}
    op_rate: dict[str, list[float]] = {"unthrottled": [], "throttled": []}
    alone_ms = []
    for _ in range(reps):
        alone = median(run_job(rg_args, rg_env, threads=2)["step_times"])
        alone_ms.append(alone * 1e3)
        for label, share in (("unthrottled", 1.0), ("throttled", op_share)):
            op = start_job(op_args, {"ANTMAN_COMPUTE_SHARE": str(share)}, threads=2)
            rg = run_job(rg_args, rg_env, threads=2)
            o = finish_job(op)
            slow[label].append(median(rg["step_times"]) / alone - 1)
            op_rate[label].append(len(o["step_times"]) / o["wall"])
    return {
        "rg_step_ms_alone": median(alone_ms),
        "rg_slowdown_unthrottled": median(slow["unthrottled"]),
        "rg_slowdown_throttled": median(slow["throttled"]),
        "rg_slowdown_throttled_worst": max(slow["throttled"]),
        "rg_slowdown_throttled_all": slow["throttled"],
        "rg_slowdown_unthrottled_all": slow["unthrottled"],
        "op_steps_per_s_unthrottled": median(op_rate["unthrottled"]),
        "op_steps_per_s_throttled": median(op_rate["throttled"]),
        "op_progress_ratio": median(op_rate["throttled"]) / median(op_rate["unthrottled"]),
        "op_share": op_share,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter runs, fewer repeats (about 4 minutes)")
    p.add_argument("--reps", type=int, default=0, help="repeats of each measurement (default 2 quick, 3 full)")
    p.add_argument("--op-share", type=float, default=0.05, help="share of the throttled opportunistic job")
    a = p.parse_args()
    dur = 6.0 if a.quick else 12.0
    reps = a.reps or (2 if a.quick else 3)

    print(f"1. share accuracy (CPU time vs 100%, {reps} alternating repeats)")
    rows, err, worst, mgr_err = share_accuracy(dur, reps)
    print(table(rows, ["target", "cpu vs 100% (median)", "min", "max", "manager's own"]))
    print(f"error: {err:.2f} points (median of repeats, worst target); worst single run {worst:.2f}\n")

    print(f"2. RG job next to an opportunistic job (throttled share {a.op_share}), {reps} repeats")
    it = interference(dur, a.op_share, reps)
    print(table([
        ["(a) RG alone", it["rg_step_ms_alone"], "-", "-"],
        ["(b) + OP unthrottled", "-", str([round(v, 3) for v in it["rg_slowdown_unthrottled_all"]]),
         it["op_steps_per_s_unthrottled"]],
        ["(c) + OP throttled", "-", str([round(v, 3) for v in it["rg_slowdown_throttled_all"]]),
         it["op_steps_per_s_throttled"]],
    ], ["case", "RG step ms (median)", "RG slowdown per repeat", "OP steps/s"]))
    print()

    print("3. input pipelines under throttling")
    ip = input_pipelines(reps)
    print(f"100 share changes during tf.data and py_function pipelines: {'ok' if ip['tfdata_100_changes_ok'] else 'FAILED'}")
    print(f"input-bound job, steps/s at share 0.5 over share 1: {ip['input_bound_rate_ratio']:.3f} "
          f"(min {ip['input_bound_rate_ratio_min']:.3f})\n")

    print("4. step time at share 100% vs stock TF (Keras fit, medians of alternating runs)")
    ratio, stock, ours = step_time_ratio_vs_stock(3 if a.quick else 7, 40 if a.quick else 150)
    print(table([["stock TF", median(stock) * 1e3], ["tf-antman 100%", median(ours) * 1e3]], ["run", "step ms"]))
    print(f"ratio: {ratio:.4f}\n")

    print(json.dumps({
        "share_error_points_cpu_time": round(err, 3),
        "share_error_points_cpu_time_worst_run": round(worst, 3),
        "share_error_points_manager": round(mgr_err, 3),
        "rg_slowdown_unthrottled": round(it["rg_slowdown_unthrottled"], 4),
        "rg_slowdown_throttled": round(it["rg_slowdown_throttled"], 4),
        "rg_slowdown_throttled_worst": round(it["rg_slowdown_throttled_worst"], 4),
        "op_progress_ratio": round(it["op_progress_ratio"], 4),
        "op_share": a.op_share,
        "tfdata_100_changes_ok": ip["tfdata_100_changes_ok"],
        "input_bound_rate_ratio": round(ip["input_bound_rate_ratio"], 4),
        "step_time_ratio_at_100": round(ratio, 4),
        "reps": reps,
        "quick": a.quick,
        "rg_slowdown_throttled_stdev": round(statistics.pstdev(it["rg_slowdown_throttled_all"]), 4),
    }))


if __name__ == "__main__":
    main()
