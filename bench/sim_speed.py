"""Simulator speed: the 20k-job run of bench/sim.py, this tree against a baseline tree, alternated.

Usage: python bench/sim_speed.py --baseline DIR [--repeats N] [--quick] [--instructions] [--instructions-20k]
DIR is a checkout of the code to compare with (e.g. `git archive e474886 | tar -x -C DIR`).
Each run is a fresh process (PYTHONPATH = the tree) that times only `simulate` with
`time.process_time` (CPU: on a shared machine wall time measures the neighbours) and prints a
hash of its records, summary (less the engine's work counters: events, rounds, schedule calls)
and time series: the two trees must produce the same hash, or the comparison is void (a
deliberate change of results is reported as such, the times still stand).
--quick: 2,000 jobs on 648 GPUs instead of 20,000 on 6,504.
--instructions: also count the instructions each tree executes for the 2,000-job run under
valgrind's callgrind (PYTHONHASHSEED=0, so the count repeats exactly), less those of a 5-job run
(interpreter start, imports, workload generation): a figure the neighbours on a shared machine
cannot move, where CPU times spread by +-30%. About 2 minutes per tree.
--instructions-20k: the same count for the 20,000-job run itself (5-11 minutes per tree): costs
that grow with the cluster (a scan over thousands of GPUs) barely show at 2,000 jobs.
Last line: JSON with both trees' CPU seconds (min, median, max), the ratio of the medians,
whether the results were identical and, with --instructions, both trees' instruction counts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import hashlib, sys, time
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import paper_recipe
jobs, nodes, quota = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
perf = load_perf_model()
wl = paper_recipe(perf, num_jobs=jobs, seed=0, nodes=nodes, gpus_per_node=8, quota_a=quota, load=1.0)
t = time.process_time()
r = simulate(wl, POLICIES["tf-antman"], perf, seed=0)
cpu = time.process_time() - t
# engine.ENGINE_WORK, spelled out: a baseline tree may predate the name (its hash must match).
s = sorted((k, v) for k, v in r.summary.items() if k not in ("wall_s", "events", "rounds", "schedule_calls"))
print(cpu, hashlib.sha256(repr((r.records, s, r.timeseries)).encode()).hexdigest()[:16])
"""


class ChildFailed(RuntimeError):
    """A tree's run failed: the end of its stderr says why (a baseline too old to import, ...)."""


def run_once(tree: Path, jobs: int, nodes: int, quota: int) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", CHILD, str(jobs), str(nodes), str(quota)], env=env, cwd=tree,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ChildFailed(f"the run of {tree} failed (exit status {done.returncode}):\n{done.stderr[-2000:]}")
    out = done.stdout.split()
    return float(out[0]), out[1]


def instructions(tree: Path, jobs: int, nodes: int, quota: int) -> int:
    """Instructions executed (callgrind Ir) by the CHILD run of `tree`, all of the process."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c",
                          CHILD, str(jobs), str(nodes), str(quota)], env=env, cwd=tree, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise ChildFailed(f"the callgrind run of {tree} failed (exit status {out.returncode}):\n{out.stderr[-2000:]}")
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no instruction count for {tree}: {out.stderr[-500:]}")
    return int(found.group(1))


def main() -> int:
    try:
        return _main()
    except ChildFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the old code")
    ap.add_argument("--repeats", type=int, default=4, help="alternated runs of each tree, 1-50 (default 4)")
    ap.add_argument("--quick", action="store_true", help="2,000 jobs on 648 GPUs instead of 20,000 on 6,504")
    ap.add_argument("--instructions", action="store_true", help="also count instructions under callgrind")
    ap.add_argument("--instructions-20k", action="store_true", help="count them for the 20k-job run too")
    args = ap.parse_args()
    if (args.instructions or args.instructions_20k) and shutil.which("valgrind") is None:
        print("error: --instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    if not (args.baseline / "scheduler_lite" / "sim" / "engine.py").is_file():
        print(f"error: --baseline {args.baseline}: no scheduler_lite/sim/engine.py there", file=sys.stderr)
        return 2
    if not 1 <= args.repeats <= 50:
        print(f"error: --repeats {args.repeats}: accepted 1..50", file=sys.stderr)
        return 2
    # bench/sim.py's 20k run: 813 x 8 = 6,504 GPUs, tenant A's quota 3,250 (half).
    jobs, nodes, quota = (2_000, 81, 324) if args.quick else (20_000, 813, 3_250)
    cpu: dict[str, list[float]] = {"baseline": [], "this": []}
    hashes: dict[str, set[str]] = {"baseline": set(), "this": set()}
    for i in range(args.repeats):
        for name, tree in (("baseline", args.baseline), ("this", REPO)):  # alternated
            seconds, digest = run_once(tree, jobs, nodes, quota)
            cpu[name].append(seconds)
            hashes[name].add(digest)
            print(f"repeat {i + 1} {name:8s} {seconds:6.2f} s CPU  results {digest}")
    figures: dict[str, object] = {"jobs": jobs, "gpus": nodes * 8, "repeats": args.repeats}
    for name, xs in cpu.items():
        figures[f"{name}_cpu_s_min"] = round(min(xs), 2)
        figures[f"{name}_cpu_s_median"] = round(statistics.median(xs), 2)
        figures[f"{name}_cpu_s_max"] = round(max(xs), 2)
    figures["baseline_over_this_median"] = round(
        statistics.median(cpu["baseline"]) / statistics.median(cpu["this"]), 3)
    figures["identical_results"] = len(hashes["baseline"] | hashes["this"]) == 1
    # (wanted, key suffix, jobs, nodes, quota, ratio key): the ratio keys predate the 20k count.
    counts = ((args.instructions, "2k", 2_000, 81, 324, "instructions_this_over_baseline"),
              (args.instructions_20k, "20k", 20_000, 813, 3_250, "instructions_20k_this_over_baseline"))
    for wanted, size, n_jobs, n_nodes, quota, ratio_key in counts:
        if not wanted:
            continue
        ir: dict[str, int] = {}
        for name, tree in (("baseline", args.baseline), ("this", REPO)):
            ir[name] = instructions(tree, n_jobs, n_nodes, quota) - instructions(tree, 5, n_nodes, quota)
            figures[f"{name}_instructions_{size}"] = ir[name]
            print(f"{name:8s} {ir[name] / 1e6:8.1f} M instructions, {n_jobs:,}-job simulate()")
        figures[ratio_key] = round(ir["this"] / ir["baseline"], 4)
    print(json.dumps(figures))
    return 0 if figures["identical_results"] else 1


if __name__ == "__main__":
    sys.exit(main())
