"""`python -m scheduler_lite.sim` (and `scheduler-lite sim`): run policies over a workload."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scheduler_lite.policy.registry import POLICIES, get_policy
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.alibaba import load_alibaba
from scheduler_lite.sim.engine import ROUND_MODES, simulate
from scheduler_lite.sim.output import plot, write_jobs_csv, write_summary
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import alibaba_v2023, default_trace_dir, paper_recipe


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scheduler-lite sim", description=__doc__)
    p.add_argument("--workload", choices=("paper", "alibaba"), default="paper",
                   help="paper: AntMan §5.2 recipe; alibaba: cluster-trace-gpu-v2023")
    p.add_argument("--policy", action="append", choices=sorted(POLICIES),
                   help="repeat for several; default: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=400, help="paper workload: number of jobs")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, default=32.0)
    p.add_argument("--quota-a", type=int, default=64, help="paper workload: tenant A's quota")
    p.add_argument("--load", type=float, default=1.5,
                   help="paper workload: offered load (1.5: the bench's calibrated load)")
    p.add_argument("--auto-fraction", type=float, default=0.0,
                   help="paper workload: share of tenant A's jobs submitted as auto (upgradable)")
    p.add_argument("--trace-dir", type=Path, default=None, help="default: <repo>/../shared/traces")
    p.add_argument("--pods", type=Path, default=None,
                   help="alibaba workload: a pod list in the cluster-trace-gpu-v2023 format "
                        "(default: <trace-dir>/alibaba-gpu-v2023/openb_pod_list_default.csv)")
    p.add_argument("--node-list", type=Path, default=None,
                   help="alibaba workload: its node list (default: openb_node_list_gpu_node.csv)")
    p.add_argument("--cluster-gpus", type=int, default=None,
                   help="alibaba workload: keep nodes spread over the node list up to this many GPUs")
    p.add_argument("--peak-ratio", type=float, default=None,
                   help="alibaba workload: size the cluster so the trace's peak demand is this "
                        "many times its GPUs (e.g. 1.25)")
    p.add_argument("--time-compression", type=float, default=1.0,
                   help="alibaba workload: divide arrival times by this (run times kept)")
    p.add_argument("--perf-model", type=Path, default=None,
                   help="a scheduler_lite.perf_model JSON file, version 3 or 4 (v3: no CPU phases; "
                        "docs/simulator.md); default: the shipped one")
    p.add_argument("--rounds", choices=ROUND_MODES, default="event",
                   help="event: coordinator rounds when asked or inputs changed; periodic: every "
                        "GPU with jobs every round_interval_s (slow; same results without noise)")
    p.add_argument("--out", type=Path, default=None, help="directory for CSV, summary, plots")
    p.add_argument("--plots", action="store_true")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        perf = load_perf_model(args.perf_model)
        if args.workload == "paper":
            wl = paper_recipe(perf, num_jobs=args.jobs, seed=args.seed, nodes=args.nodes,
                              gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib,
                              quota_a=args.quota_a, load=args.load, auto_fraction=args.auto_fraction)
        elif args.pods or args.node_list:
            base = (args.trace_dir or default_trace_dir()) / "alibaba-gpu-v2023"
            wl = load_alibaba(perf, args.pods or base / "openb_pod_list_default.csv",
                              args.node_list or base / "openb_node_list_gpu_node.csv",
                              gpus=args.cluster_gpus, peak_ratio=args.peak_ratio,
                              time_compression=args.time_compression, seed=args.seed)
        else:
            wl = alibaba_v2023(perf, args.trace_dir, seed=args.seed, gpus=args.cluster_gpus,
                               peak_ratio=args.peak_ratio, time_compression=args.time_compression)
        policies = [get_policy(n) for n in (args.policy or list(POLICIES))]
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = []
    print(f"{wl.name}: {len(wl.jobs)} jobs ({wl.skipped} skipped), {len(wl.gpus)} GPUs")
    print(f"{'policy':16s} {'avg JCT h':>9s} {'median h':>8s} {'p95 h':>7s} {'makespan h':>10s} {'guar JCT h':>10s} "
          f"{'failed':>6s} {'preempt':>7s} {'util':>5s} {'wall s':>6s}")
    for spec in policies:
        r = simulate(wl, spec, perf, seed=args.seed, progress=args.progress, rounds=args.rounds)
        s = r.summary
        print(f"{spec.name:16s} {s['avg_jct_s'] / 3600:9.2f} {s['median_jct_s'] / 3600:8.2f} "
              f"{s['p95_jct_s'] / 3600:7.2f} "
              f"{s['makespan_s'] / 3600:10.2f} {s['guarantee_avg_jct_s'] / 3600:10.2f} "
              f"{s['failed']:6.0f} {s['preemptions']:7.0f} {s['gpu_compute_util']:5.2f} {s['wall_s']:6.1f}")
        results.append(r)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            write_jobs_csv(r, args.out / f"jobs-{spec.name}.csv")
    if args.out:
        write_summary(results, args.out / "summary.json")
        if args.plots:
            plot(results, args.out)
    return 0
