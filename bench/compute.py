"""Compute dynamic scaling (GpuOpManager) on the emulated device, with real TF training.

    python bench/compute.py [--quick]

1. Share accuracy: one job held to 25/50/75% of its device; achieved busy share measured from
   the manager's op timings and cross-checked with the process's CPU time (relative to a 100%
   run). Figure: share_error_points_max.
2. Interference on this 2-core machine: a resource-guarantee (RG) job using both cores, (a) alone,
   (b) next to an unthrottled opportunistic job, (c) next to the opportunistic job held to a
   small share. Figures: rg_slowdown_unthrottled, rg_slowdown_throttled, op_progress_ratio
   (opportunistic steps/s in (c) over (b)).
3. Cost at 100%: step time under tf-antman (share 1.0) over stock TF, medians of alternating runs.
   Figure: step_time_ratio_at_100.
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json

from _common import finish_job, median, run_job, start_job, step_time_ratio_vs_stock, table


def share_accuracy(duration: float) -> tuple[list[list[object]], float, float]:
    """Achieved busy share at each target. A job cannot be busier than it is unthrottled (Python
    and input time between ops count as idle), so the error is taken against min(target, natural
    share), the natural share being what the job achieves at 0.99 (throttled path, ~no idle)."""
    args = ["--mode", "loop", "--duration", str(duration), "--width", "2048", "--batch", "512"]
    full = run_job(args, {"ANTMAN_COMPUTE_SHARE": "1.0"}, threads=2)
    cpu_full = sum(full["cpu_times"]) / full["wall"]

    def achieved(r: dict) -> float:
        return (r["compute"]["busy_ns"] - r["compute_start"]["busy_ns"]) / 1e9 / r["wall"]

    natural = achieved(run_job(args, {"ANTMAN_COMPUTE_SHARE": "0.99"}, threads=2))
    rows, errs = [], []
    for target in (0.25, 0.5, 0.75):
        r = run_job(args, {"ANTMAN_COMPUTE_SHARE": str(target)}, threads=2)
        got = achieved(r)
        cpu_rel = (sum(r["cpu_times"]) / r["wall"]) / cpu_full
        errs.append(abs(got - min(target, natural)) * 100)
        rows.append([target, min(target, natural), got, cpu_rel, median(r["step_times"]) * 1e3,
                     r["compute"]["ops_delayed"]])
    return rows, max(errs), natural


def interference(duration: float, op_share: float) -> dict[str, float]:
    rg_args = ["--mode", "loop", "--duration", str(duration), "--width", "1024"]
    op_args = ["--mode", "loop", "--duration", str(duration + 6), "--width", "1024", "--seed", "1"]
    rg_env = {"ANTMAN_ENABLE": "1"}
    alone = run_job(rg_args, rg_env, threads=2)
    res = {"alone": median(alone["step_times"])}
    op_steps = {}
    for label, share in (("unthrottled", 1.0), ("throttled", op_share)):
        op = start_job(op_args, {"ANTMAN_COMPUTE_SHARE": str(share)}, threads=2)
        rg = run_job(rg_args, rg_env, threads=2)
        o = finish_job(op)
        res[label] = median(rg["step_times"])
        op_steps[label] = len(o["step_times"]) / o["wall"]
    return {
        "rg_step_ms_alone": res["alone"] * 1e3,
        "rg_step_ms_unthrottled": res["unthrottled"] * 1e3,
        "rg_step_ms_throttled": res["throttled"] * 1e3,
        "rg_slowdown_unthrottled": res["unthrottled"] / res["alone"] - 1,
        "rg_slowdown_throttled": res["throttled"] / res["alone"] - 1,
        "op_steps_per_s_unthrottled": op_steps["unthrottled"],
        "op_steps_per_s_throttled": op_steps["throttled"],
        "op_progress_ratio": op_steps["throttled"] / op_steps["unthrottled"],
        "op_share": op_share,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter runs (about 2 minutes)")
    p.add_argument("--op-share", type=float, default=0.05, help="share of the throttled opportunistic job")
    a = p.parse_args()
    dur = 4.0 if a.quick else 15.0

    print("1. share accuracy (one job, 2 intra-op threads)")
    rows, err, natural = share_accuracy(dur)
    print(f"natural busy share of the job (at 0.99): {natural:.3f}")
    print(table(rows, ["target", "expected", "achieved (op timings)", "cpu vs 100%", "step ms", "ops delayed"]))
    print(f"max error: {err:.2f} points\n")

    print(f"2. RG job next to an opportunistic job (throttled share {a.op_share})")
    it = interference(dur, a.op_share)
    print(table([
        ["(a) RG alone", it["rg_step_ms_alone"], 0.0, "-"],
        ["(b) + OP unthrottled", it["rg_step_ms_unthrottled"], it["rg_slowdown_unthrottled"], it["op_steps_per_s_unthrottled"]],
        ["(c) + OP throttled", it["rg_step_ms_throttled"], it["rg_slowdown_throttled"], it["op_steps_per_s_throttled"]],
    ], ["case", "RG step ms (median)", "RG slowdown", "OP steps/s"]))
    print()

    print("3. step time at share 100% vs stock TF (Keras fit, medians of alternating runs)")
    ratio, stock, ours = step_time_ratio_vs_stock(3 if a.quick else 7, 40 if a.quick else 150)
    print(table([["stock TF", median(stock) * 1e3], ["tf-antman 100%", median(ours) * 1e3]], ["run", "step ms"]))
    print(f"ratio: {ratio:.4f}\n")

    print(json.dumps({
        "share_error_points_max": round(err, 3),
        "natural_share": round(natural, 3),
        "rg_slowdown_unthrottled": round(it["rg_slowdown_unthrottled"], 4),
        "rg_slowdown_throttled": round(it["rg_slowdown_throttled"], 4),
        "op_progress_ratio": round(it["op_progress_ratio"], 4),
        "op_share": a.op_share,
        "step_time_ratio_at_100": round(ratio, 4),
        "quick": a.quick,
    }))


if __name__ == "__main__":
    main()
