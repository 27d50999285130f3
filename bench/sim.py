"""Simulator benchmark: 20k jobs through tf-antman, rounds modes, and the paper §5.2 comparison.

Usage: python bench/sim.py [--quick]   (without --quick: 500 jobs per run and the Alibaba replay)
Last line: JSON with seconds_20k_jobs, the load curve (curve_<load>_*), the calibrated load and
jct_speedup_vs_yarn_cs / jct_speedup_vs_gandiva there (means over 5 seeds of the per-seed ratios,
spreads the population stdev), the worst seed at any load, the sensitivity runs (each named
assumption of the model at a low and a high value, the model without CPU phases, the policy
variants, and workloads where tenant A submits half or all of its jobs as `auto`) and the
Alibaba replay's mean / median / p95 JCT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_lite.policy.global_scheduler import SchedulerConfig
from scheduler_lite.policy.registry import POLICIES, PolicySpec
from scheduler_lite.sim.alibaba import NODES, PODS, load_alibaba
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import PerfModel, load_perf_model
from scheduler_lite.sim.workload import default_trace_dir, paper_recipe

CURVE_POLICIES = ("yarn-cs", "gandiva", "tf-antman")
LOADS = (0.8, 1.0, 1.5, 2.0, 3.0)  # offered GPU-seconds per second over the cluster's GPUs
# Named assumptions of the model, each run at a low and a high value (docs/simulator.md).
SENSITIVITY = {"colocation_interference": (0.0, 0.2), "cross_group_slowdown": (0.0, 1.0),
               "checkpoint_restart_s": (0.0, 600.0), "input_phase_s": (0.0, 600.0),
               "input_phase_max_fraction": (0.1, 0.5), "evaluation_every_s": (0.0, 600.0)}
ALIBABA_PEAK_RATIO = 1.25
AUTO_FRACTIONS = (0.5, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="300 jobs per load-curve run instead of 500, and no Alibaba replay")
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

    # 3. Paper §5.2 (Fig. 13) as a curve over offered load: 64 GPUs, tenants A and B, over seeds.
    seeds = range(5)
    jobs = 300 if args.quick else 500
    keys = ("avg_jct_s", "median_jct_s", "p95_jct_s", "makespan_s", "guarantee_avg_jct_s",
            "opportunistic_avg_jct_s", "avg_queue_delay_s", "oom_failures")
    curve: dict[float, dict[str, dict[str, list[float]]]] = {}
    mean_runtime: dict[float, float] = {}
    print(f"\npaper recipe, 64 GPUs, {jobs} jobs, seeds {list(seeds)} (mean ± stdev over seeds)")
    print(f"{'load':>5s} {'policy':10s} {'avg JCT h':>10s} {'median h':>9s} {'p95 h':>8s} {'makespan h':>11s} "
          f"{'queue s':>8s} {'OOM':>5s}")
    for load in LOADS:
        per = curve[load] = _run(perf, CURVE_POLICIES, load, jobs, seeds, keys)
        mean_runtime[load] = statistics.fmean(
            statistics.fmean(j.runtime_s for j in paper_recipe(perf, num_jobs=jobs, seed=s, load=load).jobs)
            for s in seeds)
        for name in CURVE_POLICIES:
            d = per[name]
            print(f"{load:5.1f} {name:10s} {_ms(d['avg_jct_s'], 3600):>10s} {_ms(d['median_jct_s'], 3600):>9s} "
                  f"{_ms(d['p95_jct_s'], 3600):>8s} {_ms(d['makespan_s'], 3600):>11s} "
                  f"{statistics.fmean(d['avg_queue_delay_s']):8.0f} {statistics.fmean(d['oom_failures']):5.1f}")
    # Calibrated load: the lowest load of the curve at which the baseline has a backlog, i.e.
    # YARN-CS's jobs queue on average at least as long as they run. Read off YARN-CS alone.
    calibrated = next((ld for ld in LOADS if statistics.fmean(curve[ld]["yarn-cs"]["avg_queue_delay_s"])
                       >= mean_runtime[ld]), LOADS[-1])
    figures["calibrated_load"] = calibrated
    print(f"\ncalibrated load (YARN-CS queues >= the mean run time): {calibrated}")
    print(f"{'load':>5s} {'JCT vs YARN-CS':>15s} {'JCT vs Gandiva':>15s} {'makespan vs YARN':>17s} "
          f"{'median vs YARN':>15s} {'p95 vs YARN':>12s}")
    worst = {"jct_yarn": math.inf, "jct_gandiva": math.inf, "makespan_yarn": math.inf}
    for load in LOADS:
        per = curve[load]
        r = {k: _ratios(per, other, key) for k, other, key in (
            ("jct_yarn", "yarn-cs", "avg_jct_s"), ("jct_gandiva", "gandiva", "avg_jct_s"),
            ("makespan_yarn", "yarn-cs", "makespan_s"), ("median_yarn", "yarn-cs", "median_jct_s"),
            ("p95_yarn", "yarn-cs", "p95_jct_s"))}
        for k in worst:
            worst[k] = min(worst[k], min(r[k]))
        print(f"{load:5.1f} {_rs(r['jct_yarn']):>15s} {_rs(r['jct_gandiva']):>15s} {_rs(r['makespan_yarn']):>17s} "
              f"{_rs(r['median_yarn']):>15s} {_rs(r['p95_yarn']):>12s}")
        figures[f"curve_{load:g}_jct_speedup_vs_yarn_cs"] = round(statistics.fmean(r["jct_yarn"]), 3)
        figures[f"curve_{load:g}_jct_speedup_vs_gandiva"] = round(statistics.fmean(r["jct_gandiva"]), 3)
        figures[f"curve_{load:g}_makespan_speedup_vs_yarn_cs"] = round(statistics.fmean(r["makespan_yarn"]), 3)
        if load == calibrated:
            for k, name in (("jct_yarn", "jct_speedup_vs_yarn_cs"), ("jct_gandiva", "jct_speedup_vs_gandiva"),
                            ("makespan_yarn", "makespan_speedup_vs_yarn_cs")):
                figures[name] = round(statistics.fmean(r[k]), 3)
                figures[f"{name}_stdev"] = round(statistics.pstdev(r[k]), 3)
    # Worst single seed at any load: the "> 1 everywhere" and "makespan within 5%" checks.
    figures["worst_seed_jct_speedup_vs_yarn_cs"] = round(worst["jct_yarn"], 3)
    figures["worst_seed_jct_speedup_vs_gandiva"] = round(worst["jct_gandiva"], 3)
    figures["worst_seed_makespan_speedup_vs_yarn_cs"] = round(worst["makespan_yarn"], 3)
    print(f"\ntf-antman at load {calibrated}: avg JCT {figures['jct_speedup_vs_yarn_cs']} ± "
          f"{figures['jct_speedup_vs_yarn_cs_stdev']} x YARN-CS (paper 2.05), {figures['jct_speedup_vs_gandiva']} ± "
          f"{figures['jct_speedup_vs_gandiva_stdev']} x Gandiva (paper 1.84)")

    # 4. Sensitivity of the headline to each named assumption, and the policy variants.
    sens_seeds = range(3)
    print(f"\nsensitivity at load {calibrated}, seeds {list(sens_seeds)}: JCT speed-up of tf-antman")
    print(f"{'variant':44s} {'vs YARN-CS':>11s} {'vs Gandiva':>11s}")
    # (label, model, policies replaced, share of tenant A's jobs submitted as `auto`)
    variants: list[tuple[str, PerfModel, dict[str, PolicySpec], float]] = [
        ("model as shipped", perf, {}, 0.0),
        ("no CPU phases (model v3)", dataclasses.replace(perf, input_phase_s=0.0, evaluation_every_s=0.0), {}, 0.0)]
    for field, values in SENSITIVITY.items():
        for v in values:
            variants.append((f"{field} = {v}", dataclasses.replace(perf, **{field: v}), {}, 0.0))
    base = POLICIES["tf-antman"]
    for label, cfg in (("placement by utilisation only (Algorithm 1)",
                        SchedulerConfig(opportunistic_placement="utilisation")),
                       ("gangs wait for one NVLink group", SchedulerConfig(gang_locality="wait"))):
        variants.append((label, perf, {"tf-antman": dataclasses.replace(base, config=cfg)}, 0.0))
    variants.append(("no migration of stranded jobs", perf,
                     {"tf-antman": dataclasses.replace(base, migration=None)}, 0.0))
    # The paper's third job type: tenant A submits some jobs as `auto` (guarantee unless the
    # wait for quota is long, then opportunistic, upgraded in place later). The baselines have
    # no such type: for them an auto job is a guarantee job.
    for fraction in AUTO_FRACTIONS:
        variants.append((f"auto jobs = {fraction:g} of tenant A", perf, {}, fraction))
    for label, pm, override, auto in variants:
        pols = {**{n: POLICIES[n] for n in CURVE_POLICIES}, **override}
        per = _run(pm, pols, calibrated, jobs, sens_seeds, ("avg_jct_s",), auto_fraction=auto)
        ry, rg = _ratios(per, "yarn-cs", "avg_jct_s"), _ratios(per, "gandiva", "avg_jct_s")
        print(f"{label:44s} {_rs(ry):>11s} {_rs(rg):>11s}")
        tag = label.replace(" ", "_").replace("=", "").replace("(", "").replace(")", "").replace("__", "_")
        figures[f"sensitivity_{tag}_vs_yarn_cs"] = round(statistics.fmean(ry), 3)
        figures[f"sensitivity_{tag}_vs_gandiva"] = round(statistics.fmean(rg), 3)

    if not args.quick:
        trace = default_trace_dir()
        if not (trace / PODS).is_file():
            print("alibaba trace absent: skipped")
        else:
            wl = load_alibaba(perf, trace / PODS, trace / NODES, peak_ratio=ALIBABA_PEAK_RATIO)
            print(f"\n{wl.name}: {len(wl.jobs)} GPU pods ({wl.skipped} CPU-only or Pending skipped), "
                  f"cluster sized so peak demand = {ALIBABA_PEAK_RATIO} x its GPUs")
            print(f"{'policy':10s} {'avg JCT h':>9s} {'median h':>9s} {'p95 h':>8s} {'queue h':>8s} {'OOM':>5s}")
            for name in CURVE_POLICIES:
                s = simulate(wl, POLICIES[name], perf, seed=0).summary
                print(f"{name:10s} {s['avg_jct_s'] / 3600:9.2f} {s['median_jct_s'] / 3600:9.3f} "
                      f"{s['p95_jct_s'] / 3600:8.2f} {s['avg_queue_delay_s'] / 3600:8.2f} {s['oom_failures']:5.0f}")
                for key in ("avg_jct_s", "median_jct_s", "p95_jct_s"):
                    figures[f"alibaba_{key[:-2]}_h_{name}"] = round(s[key] / 3600, 3)
    print(json.dumps(figures))
    return 0


def _run(perf: PerfModel, policies: dict[str, PolicySpec] | tuple[str, ...], load: float, jobs: int,
         seeds: range, keys: tuple[str, ...], auto_fraction: float = 0.0) -> dict[str, dict[str, list[float]]]:
    specs = {n: POLICIES[n] for n in policies} if isinstance(policies, tuple) else policies
    per: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in specs}
    for seed in seeds:
        wl = paper_recipe(perf, num_jobs=jobs, seed=seed, load=load, auto_fraction=auto_fraction)
        for name, spec in specs.items():
            s = simulate(wl, spec, perf, seed=seed).summary
            for k in keys:
                per[name][k].append(s[k])
    return per


def _ratios(per: dict[str, dict[str, list[float]]], other: str, key: str) -> list[float]:
    """Per seed: the other policy's figure over tf-antman's (> 1: tf-antman is better)."""
    return [b / a for a, b in zip(per["tf-antman"][key], per[other][key], strict=True)]


def _rs(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2f}±{statistics.pstdev(xs):.2f}"


def _ms(xs: list[float], scale: float = 1.0) -> str:
    return f"{statistics.fmean(xs) / scale:.2f}±{statistics.pstdev(xs) / scale:.2f}"


if __name__ == "__main__":
    sys.exit(main())
