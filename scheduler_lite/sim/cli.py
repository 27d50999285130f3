"""`python -m scheduler_lite.sim` (and `scheduler-lite sim`): run policies over a workload."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from scheduler_lite.policy.registry import POLICIES, get_policy
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.alibaba import NODES, PODS, load_alibaba
from scheduler_lite.sim.engine import ROUND_MODES, simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.result import plot, write_jobs_csv, write_summary
from scheduler_lite.sim.workload import default_trace_dir, paper_recipe


class _Parser(argparse.ArgumentParser):
    """Option mistakes as one line, like every other error of the command (not the usage block)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="scheduler-lite sim", description=__doc__)
    p.add_argument("--workload", choices=("paper", "alibaba"), default="paper",
                   help="paper: AntMan §5.2 recipe; alibaba: cluster-trace-gpu-v2023")
    p.add_argument("--policy", action="append", choices=sorted(POLICIES),
                   help="repeat for several; default: all")
    p.add_argument("--seed", type=int, default=0)
    # The paper workload's options default to None, so that one given with --workload alibaba is
    # an error rather than silently ignored (PAPER_DEFAULTS fills them in).
    p.add_argument("--jobs", type=int, help="paper workload: number of jobs (default 400)")
    p.add_argument("--nodes", type=int, help="paper workload: nodes (default 8)")
    p.add_argument("--gpus-per-node", type=int, help="paper workload: GPUs per node (default 8)")
    p.add_argument("--gpu-memory-gib", type=float, help="paper workload: GiB per GPU (default 32)")
    p.add_argument("--quota-a", type=int, help="paper workload: tenant A's quota (default 64)")
    p.add_argument("--load", type=float,
                   help="paper workload: offered load (default 1.5: the bench's calibrated load)")
    p.add_argument("--auto-fraction", type=float,
                   help="paper workload: share of tenant A's jobs submitted as auto (upgradable; default 0)")
    p.add_argument("--trace-dir", type=Path, default=None, help="default: <repo>/../shared/traces")
    p.add_argument("--pods", type=Path, default=None,
                   help="alibaba workload: a pod list in the cluster-trace-gpu-v2023 format "
                        "(default: <trace-dir>/alibaba-gpu-v2023/openb_pod_list_default.csv)")
    p.add_argument("--node-list", type=Path, default=None,
                   help="alibaba workload: its node list (default: openb_node_list_gpu_node.csv)")
    size = p.add_mutually_exclusive_group()  # two ways to size one cluster: at most one
    size.add_argument("--cluster-gpus", type=int, default=None,
                      help="alibaba workload: keep the fewest nodes, spread over the node list, with at "
                           "least this many GPUs (and at least the largest pod's)")
    size.add_argument("--peak-ratio", type=float, default=None,
                      help="alibaba workload: size the cluster so the trace's peak demand is this "
                           "many times its GPUs (e.g. 1.25)")
    p.add_argument("--time-compression", type=float, default=None,
                   help="alibaba workload: divide arrival times by this (run times kept; default 1)")
    p.add_argument("--perf-model", type=Path, default=None,
                   help="a scheduler_lite.perf_model JSON file, version 3 or 4 (v3: no CPU phases; "
                        "docs/simulator.md); default: the shipped one")
    p.add_argument("--rounds", choices=ROUND_MODES, default="event",
                   help="event: coordinator rounds when asked or inputs changed; periodic: every "
                        "GPU with jobs every round_interval_s (slow; same results without noise)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for jobs-<policy>.csv, summary.json and plots (created if absent)")
    p.add_argument("--plots", action="store_true", help="also jct_cdf.png and utilisation.png in --out "
                   "(needs matplotlib)")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr")
    return p


PAPER_DEFAULTS = {"jobs": 400, "nodes": 8, "gpus_per_node": 8, "gpu_memory_gib": 32.0, "quota_a": 64,
                  "load": 1.5, "auto_fraction": 0.0}
ALIBABA_OPTIONS = ("pods", "node_list", "cluster_gpus", "peak_ratio", "time_compression", "trace_dir")


def _check_options(args: argparse.Namespace) -> None:
    """Options of the other workload are an error, not silently ignored."""
    other, options = ("paper", PAPER_DEFAULTS) if args.workload == "alibaba" else ("alibaba", ALIBABA_OPTIONS)
    for name in options:
        value = getattr(args, name)
        if value is not None:
            raise ConfigError(f"--{name.replace('_', '-')}", str(value) if isinstance(value, Path) else value,
                              f"an option of the {other} workload (this run is --workload {args.workload})")
    if args.workload == "paper":
        for name, default in PAPER_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
    if args.plots:
        if args.out is None:
            raise ConfigError("--plots", True, "together with --out DIR (where the plots go)")
        try:
            import matplotlib  # noqa: F401 - only whether it is there
        except ImportError:
            raise ConfigError("--plots", True, "matplotlib installed (pip install matplotlib)") from None
    if (out := args.out) is not None:  # (made) a directory we can write in, before hours of simulation
        if out.exists() and not out.is_dir():
            raise ConfigError("--out", str(out), "a directory (this is a file)")
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError("--out", str(out), f"a writable directory ({e.strerror})") from None


def _as_option(e: ConfigError | OSError, args: argparse.Namespace) -> ConfigError | OSError:
    """The error naming the option the user typed: the workload builders name their parameters
    (the options' names, but num_jobs), and an input file that could not be read its path (a
    default one comes from --trace-dir, given or not)."""
    if isinstance(e, ConfigError):
        dest = "jobs" if e.field == "num_jobs" else e.field
        return ConfigError(f"--{dest.replace('_', '-')}", e.value, e.accepted) if dest in vars(args) else e
    name = str(e.filename)
    if args.perf_model is not None and name == str(args.perf_model):
        return ConfigError("--perf-model", name, f"a readable file ({e.strerror})")
    if args.workload == "alibaba":
        trace_dir = args.trace_dir or default_trace_dir()
        for flag, given, default in (("--pods", args.pods, PODS), ("--node-list", args.node_list, NODES)):
            if given is not None and name == str(given):
                return ConfigError(flag, name, f"a readable file ({e.strerror})")
            if given is None and name == str(trace_dir / default):
                where = str(trace_dir) if args.trace_dir is not None else f"{trace_dir} (the default)"
                return ConfigError("--trace-dir", where, f"a directory holding {default} (or give {flag}) "
                                   f"({e.strerror})")
    return e


def _say(text: str) -> None:
    """Print a line of the table; a reader that went away (`| head`) stops the printing, not the
    run: the files in --out are still written."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # The rest of the table, and the flush at exit, go nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_options(args)
        perf = load_perf_model(args.perf_model)
        if args.workload == "paper":
            wl = paper_recipe(perf, num_jobs=args.jobs, seed=args.seed, nodes=args.nodes,
                              gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib,
                              quota_a=args.quota_a, load=args.load, auto_fraction=args.auto_fraction)
        else:
            compression = 1.0 if args.time_compression is None else args.time_compression
            trace_dir = args.trace_dir or default_trace_dir()
            wl = load_alibaba(perf, args.pods or trace_dir / PODS, args.node_list or trace_dir / NODES,
                              gpus=args.cluster_gpus, peak_ratio=args.peak_ratio,
                              time_compression=compression, seed=args.seed)
        policies = [get_policy(n) for n in (args.policy or list(POLICIES))]
    except (ConfigError, OSError) as e:
        print(f"scheduler-lite sim: error: {_as_option(e, args)}", file=sys.stderr)
        return 2
    results = []
    _say(f"{wl.name}: {len(wl.jobs)} jobs ({wl.skipped} skipped), {len(wl.gpus)} GPUs")
    _say(f"{'policy':16s} {'avg JCT h':>9s} {'median h':>8s} {'p95 h':>7s} {'makespan h':>10s} "
         f"{'guar JCT h':>10s} {'failed':>6s} {'preempt':>7s} {'util':>5s} {'wall s':>6s}")
    for spec in policies:
        r = simulate(wl, spec, perf, seed=args.seed, progress=args.progress, rounds=args.rounds)
        s = r.summary
        _say(f"{spec.name:16s} {s['avg_jct_s'] / 3600:9.2f} {s['median_jct_s'] / 3600:8.2f} "
             f"{s['p95_jct_s'] / 3600:7.2f} "
             f"{s['makespan_s'] / 3600:10.2f} {s['guarantee_avg_jct_s'] / 3600:10.2f} "
             f"{s['failed']:6.0f} {s['preemptions']:7.0f} {s['gpu_compute_util']:5.2f} {s['wall_s']:6.1f}")
        if s.get("unfinished"):
            _say(f"{'':16s} {s['unfinished']:.0f} job(s) never finished (nan: no finished job to average)")
        results.append(r)
        if args.out:
            write_jobs_csv(r, args.out / f"jobs-{spec.name}.csv")
    if args.out:
        write_summary(results, args.out / "summary.json")
        if args.plots:
            plot(results, args.out)
    return 0
