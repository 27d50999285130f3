"""Simulator benchmark: 20k jobs through tf-antman, rounds modes, and the paper §5.2 comparison.

Usage: python bench/sim.py [--quick] [--alibaba]
Last line: JSON with seconds_20k_jobs, jct_speedup_vs_yarn_cs, jct_speedup_vs_gandiva (means over
seeds of the per-seed ratios) and their spreads (population stdev over seeds), among others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import alibaba_v2023, default_trace_dir, paper_recipe

COMPARED = ("yarn-cs", "yarn-cs-preempt", "gandiva", "tf-antman", "tf-antman-sjf")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--alibaba", action="store_true", help="also the full 8,152-task trace")
    args = ap.parse_args()
    perf = load_perf_model()
    figures: dict[str, float | bool] = {}

    # 1. Speed: 20,000 jobs on 6,504 GPUs (same recipe, scaled cluster, offered load 1.0).
    big = paper_recipe(perf, num_jobs=20_000, seed=0, nodes=813, gpus_per_node=8, quota_a=3250, load=1.0)
    wall, cpu = time.perf_counter(), time.process_time()
    r = simulate(big, POLICIES["tf-antman"], perf, seed=0)
    figures["seconds_20k_jobs"] = round(time.perf_counter() - wall, 2)
    figures["cpu_seconds_20k_jobs"] = round(time.process_time() - cpu, 2)
    figures["coordinator_rounds_20k"] = r.summary["rounds"]
    print(f"20,000 jobs on {len(big.gpus)} GPUs through tf-antman: {figures['seconds_20k_jobs']} s wall, "
          f"{figures['cpu_seconds_20k_jobs']} s CPU ({r.summary['rounds']:.0f} coordinator rounds, "
          f"{r.summary['events']:.0f} events, {r.summary['schedule_calls']:.0f} global passes)")

    # 2. Baseline in the same run: periodic rounds (every GPU with jobs, every 10 s).
    small = paper_recipe(perf, num_jobs=150, seed=0, nodes=2, gpus_per_node=8, quota_a=16)
    quiet = dataclasses.replace(perf, step_noise_cv=0.0)
    small_quiet = paper_recipe(quiet, num_jobs=150, seed=0, nodes=2, gpus_per_node=8, quota_a=16)
    print(f"\nrounds modes, paper recipe on 16 GPUs, {len(small.jobs)} jobs")
    print(f"{'mode':10s} {'noise':>6s} {'wall s':>7s} {'rounds':>8s} {'avg JCT h':>9s}")
    runs = {}
    for noise, wl, pm in (("3%", small, perf), ("none", small_quiet, quiet)):
        for mode in ("event", "periodic"):
            t0 = time.perf_counter()
            res = simulate(wl, POLICIES["tf-antman"], pm, seed=0, rounds=mode)
            runs[(noise, mode)] = res
            print(f"{mode:10s} {noise:>6s} {time.perf_counter() - t0:7.2f} {res.summary['rounds']:8.0f} "
                  f"{res.summary['avg_jct_s'] / 3600:9.3f}")
    figures["periodic_over_event_rounds"] = round(
        runs[("3%", "periodic")].summary["rounds"] / runs[("3%", "event")].summary["rounds"], 2)
    figures["event_equals_periodic_without_noise"] = (
        runs[("none", "event")].records == runs[("none", "periodic")].records)
    figures["periodic_over_event_avg_jct_with_noise"] = round(
        runs[("3%", "periodic")].summary["avg_jct_s"] / runs[("3%", "event")].summary["avg_jct_s"], 3)

    # 3. Paper §5.2 (Fig. 13): 64 GPUs, tenants A (quota 64) and B (none), over seeds.
    seeds = range(5) if args.quick else range(10)
    jobs = 300 if args.quick else 500
    keys = ("avg_jct_s", "makespan_s", "guarantee_avg_jct_s", "opportunistic_avg_jct_s",
            "avg_queue_delay_s", "preemptions", "oom_failures")
    per: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in COMPARED}
    for seed in seeds:
        wl = paper_recipe(perf, num_jobs=jobs, seed=seed)
        for name in COMPARED:
            s = simulate(wl, POLICIES[name], perf, seed=seed).summary
            for k in keys:
                per[name][k].append(s[k])
    print(f"\npaper recipe, 64 GPUs, {jobs} jobs, seeds {list(seeds)} (mean ± stdev over seeds)")
    print(f"{'policy':16s} {'avg JCT h':>11s} {'makespan h':>12s} {'guar JCT h':>11s} {'opp JCT h':>11s} "
          f"{'queue s':>9s} {'preempt':>8s} {'OOM':>5s}")
    for name in COMPARED:
        d = per[name]
        print(f"{name:16s} {_ms(d['avg_jct_s'], 3600):>11s} {_ms(d['makespan_s'], 3600):>12s} "
              f"{_ms(d['guarantee_avg_jct_s'], 3600):>11s} {_ms(d['opportunistic_avg_jct_s'], 3600):>11s} "
              f"{statistics.fmean(d['avg_queue_delay_s']):9.0f} {statistics.fmean(d['preemptions']):8.1f} "
              f"{statistics.fmean(d['oom_failures']):5.1f}")
    for other, tag in (("yarn-cs", "yarn_cs"), ("gandiva", "gandiva")):
        for key, name in (("avg_jct_s", "jct"), ("makespan_s", "makespan")):
            ratios = [b / a for a, b in zip(per["tf-antman"][key], per[other][key], strict=True)]
            figures[f"{name}_speedup_vs_{tag}"] = round(statistics.fmean(ratios), 3)
            figures[f"{name}_speedup_vs_{tag}_stdev"] = round(statistics.pstdev(ratios), 3)
    sjf = [a / b for a, b in zip(per["tf-antman"]["avg_jct_s"], per["tf-antman-sjf"]["avg_jct_s"], strict=True)]
    figures["sjf_jct_speedup_vs_antman"] = round(statistics.fmean(sjf), 3)
    figures["antman_avg_queue_delay_s"] = round(statistics.fmean(per["tf-antman"]["avg_queue_delay_s"]), 1)
    figures["yarn_cs_avg_queue_delay_s"] = round(statistics.fmean(per["yarn-cs"]["avg_queue_delay_s"]), 1)
    print(f"\ntf-antman avg JCT speedup: {figures['jct_speedup_vs_yarn_cs']} ± "
          f"{figures['jct_speedup_vs_yarn_cs_stdev']} vs YARN-CS (paper 2.05), "
          f"{figures['jct_speedup_vs_gandiva']} ± {figures['jct_speedup_vs_gandiva_stdev']} vs Gandiva (paper 1.84)")

    if args.alibaba and not args.quick:
        if not (default_trace_dir() / "alibaba-gpu-v2023").is_dir():
            print("alibaba trace absent: skipped")
        else:
            wl = alibaba_v2023(perf)
            print(f"\nalibaba-gpu-v2023: {len(wl.jobs)} GPU tasks ({wl.skipped} CPU-only skipped), {len(wl.gpus)} GPUs")
            print(f"{'policy':16s} {'avg JCT h':>9s} {'p95 h':>8s} {'queue h':>8s} {'makespan h':>10s} {'OOM':>5s} {'wall s':>6s}")
            for name in ("yarn-cs", "gandiva", "tf-antman"):
                s = simulate(wl, POLICIES[name], perf, seed=0).summary
                print(f"{name:16s} {s['avg_jct_s'] / 3600:9.2f} {s['p95_jct_s'] / 3600:8.2f} "
                      f"{s['avg_queue_delay_s'] / 3600:8.2f} {s['makespan_s'] / 3600:10.1f} "
                      f"{s['oom_failures']:5.0f} {s['wall_s']:6.1f}")
                figures[f"alibaba_avg_jct_h_{name}"] = round(s["avg_jct_s"] / 3600, 3)
    print(json.dumps(figures))
    return 0


def _ms(xs: list[float], scale: float = 1.0) -> str:
    return f"{statistics.fmean(xs) / scale:.2f}±{statistics.pstdev(xs) / scale:.2f}"


if __name__ == "__main__":
    sys.exit(main())
