"""tf-antman demo: a resource-guarantee job and two opportunistic jobs co-located on one emulated GPU.

    python examples/demo.py            # about 3 minutes on 2 cores
    python examples/demo.py --quick    # shorter jobs

What happens (paper §3.2-3.3): two opportunistic jobs of tenant "batch" (no quota) are submitted
to an idle emulated GPU. The first starts and uses it fully; the second waits, because the GPU
reads busy (at or above the utilisation threshold M once the first job steps at full share, and
marked busy before that). Then a guarantee job of tenant "research" (quota 1) arrives: the local
coordinator shrinks the running opportunistic job's memory limit and compute share, lets the
guarantee job start, then gives it memory back and raises its compute share step by step as long
as the guarantee job's mini-batch time stays within tolerance of its own stable baseline. The
second opportunistic job starts when the GPU reads below M again. (Before issue 13 the daemon
placed both opportunistic jobs at once, on a GPU whose utilisation it had not measured yet.) A
live status view shows the limits and shares in force, host fallback and step times; a summary
follows.

Every job is a real TensorFlow training process (examples/colocate_job.py) under tf-antman on the
emulated device; scheduler_lite talks to them through their job directories.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scheduler_lite.config import parse_config  # noqa: E402
from scheduler_lite.daemon import Daemon  # noqa: E402
from scheduler_lite.storage import SqliteStorage  # noqa: E402
from scheduler_lite.testing import run_until, stop_all_jobs  # noqa: E402
from tf_antman.units import format_bytes  # noqa: E402

JOB = [sys.executable, str(REPO / "examples" / "colocate_job.py")]


@dataclass
class Timeline:
    """Samples of every job's settings and step times, for the summary and the plot."""

    t0: float
    rows: list[dict] = field(default_factory=list)

    def sample(self, d: Daemon, names: dict[str, str]) -> None:
        now = time.monotonic() - self.t0
        for g in d.status().gpus:
            for j in g.jobs:
                self.rows.append({"t": now, "job": names.get(j.job_id, j.job_id), "limit": j.memory_limit_bytes,
                                  "share": j.compute_share, "in_use": j.in_use_bytes, "host": j.host_in_use_bytes,
                                  "step_ms": j.last_step_ms, "median_ms": j.step_ms_median, "step": j.step,
                                  "phase": g.coordinator_phase})


def make_daemon(state_dir: Path, memory: str, round_s: float, min_memory: str = "64MiB") -> Daemon:
    cfg = parse_config({
        "version": 1,
        "paths": {"state_dir": str(state_dir)},
        "devices": {"kind": "emulated", "emulated": [{"id": 0, "memory": memory}]},
        "tenants": [{"name": "research", "gpu_quota": 1}, {"name": "batch", "gpu_quota": 0}],
        "jobs": {"host_memory": "4GiB", "cancel_grace_s": 5},
        "daemon": {"tick_interval_s": 0.25, "schedule_interval_s": 1, "utilisation_window_s": 10},
        # On 2 shared CPU cores an opportunistic job's busy slots take both cores from the guarantee
        # job, so its share starts lower and grows in smaller steps than the GPU defaults
        # (docs/policies.md), and the tolerance is tighter.
        "coordinator": {"round_interval_s": round_s, "min_memory_bytes": min_memory, "settle_timeout_s": 30,
                        "floor_share": 0.02, "share_step": 0.02, "slowdown_tolerance": 0.05},
    }, base_dir=state_dir)
    return Daemon(cfg, SqliteStorage(cfg.db_path))


def print_status(d: Daemon, names: dict[str, str], t: float) -> None:
    g = d.status().gpu(0)
    print(f"[{t:6.1f}s] gpu0 phase={g.coordinator_phase or '-'}")
    for j in g.jobs:
        step_ms = f"{j.step_ms_median:.1f}" if j.step_ms_median else "-"
        host = format_bytes(j.host_in_use_bytes) if j.host_in_use_bytes else "0"
        used = format_bytes(j.in_use_bytes) if j.in_use_bytes is not None else "-"
        # In force as the job reports them ('-' before its first stats.json).
        limit = format_bytes(j.memory_limit_bytes) if j.memory_limit_bytes is not None else "-"
        share = f"{j.compute_share:4.2f}" if j.compute_share is not None else "   -"
        print(f"    {names.get(j.job_id, j.job_id):<14} {j.role.value if hasattr(j.role, 'value') else j.role:<13} "
              f"limit {limit:>10}  in use {used:>10}  host {host:>8}  "
              f"share {share}  step {j.step or 0:>5}  median {step_ms:>6} ms", flush=True)


def job_steps_ms(d: Daemon, job_id: str) -> list[float]:
    """Mean step time per progress chunk, from the job's own stdout (independent of tf-antman)."""
    out = (d.job_dir(job_id) / "stdout.log").read_text(errors="replace")
    return [float(line.split()[2]) for line in out.splitlines() if line.startswith("step ") and "ms/step" in line]


def run_scenario(quick: bool, out_dir: Path, live: bool = True, rg_width: int = 512, op_width: int = 768,
                 memory: str = "2GiB", with_solo: bool = True) -> dict:
    """Solo run of the guarantee job, then the co-located run. Returns the figures."""
    rg_steps = 3000 if quick else 8000
    op_steps = 3000 if quick else 8000
    rg_cmd = [*JOB, "--width", str(rg_width), "--steps", str(rg_steps), "--batch", "128", "--print-every", "50"]
    op_cmd = [*JOB, "--width", str(op_width), "--steps", str(op_steps), "--batch", "128", "--print-every", "50"]
    result: dict = {}

    if with_solo:
        print("== measuring the guarantee job alone (baseline)", flush=True)
        d = make_daemon(out_dir / "solo", memory, round_s=2)
        solo = d.submit(rg_cmd, tenant="research", kind="guarantee", name="rg-solo")
        run_until(d, lambda d: d.job(solo).state.done, timeout=1200)
        result["rg_solo_ms"] = statistics.median(job_steps_ms(d, solo)[2:])
        result["rg_solo_jct_s"] = d.job(solo).ended_at - d.job(solo).started_at
        print(f"   guarantee job alone: {result['rg_solo_ms']:.2f} ms/step (median of its progress lines)\n")

    print("== co-located run: two opportunistic jobs, then the guarantee job arrives", flush=True)
    d = make_daemon(out_dir / "colocated", memory, round_s=2)
    tl = Timeline(time.monotonic())
    names: dict[str, str] = {}
    ops = [d.submit(op_cmd + ["--seed", str(i + 2)], tenant="batch", kind="opportunistic", name=f"op{i + 1}")
           for i in range(2)]
    names.update({ops[0]: "opportunistic-1", ops[1]: "opportunistic-2"})
    last_print = 0.0

    def watch(d: Daemon) -> None:
        nonlocal last_print
        tl.sample(d, names)
        t = time.monotonic() - tl.t0
        if live and t - last_print >= 3:
            last_print = t
            print_status(d, names, t)

    def first_op_running(d: Daemon) -> bool:
        watch(d)
        job = d.status().gpu(0).job(ops[0])
        return job is not None and (job.step or 0) >= 100

    run_until(d, first_op_running, timeout=300)
    rg = d.submit(rg_cmd, tenant="research", kind="guarantee", name="rg")
    names[rg] = "guarantee"
    print(f"[{time.monotonic() - tl.t0:6.1f}s] guarantee job {rg} submitted", flush=True)

    def all_done(d: Daemon) -> bool:
        watch(d)
        return all(d.job(j).state.done for j in [rg, *ops])

    run_until(d, all_done, timeout=3600)
    records = {j: d.job(j) for j in [rg, *ops]}
    rg_ms = job_steps_ms(d, rg)
    result.update({
        "rg_colocated_ms": statistics.median(rg_ms[2:]),
        "rg_jct_s": records[rg].ended_at - records[rg].started_at,
        "op_jobs_finished": sum(1 for j in ops if records[j].state.value == "finished"),
        "failed_jobs": sum(1 for r in records.values() if r.state.value != "finished"),
        "jobs": {names[j]: {"state": r.state.value, "exit_code": r.exit_code,
                            "jct_s": (r.ended_at or 0) - (r.started_at or 0)} for j, r in records.items()},
    })
    if "rg_solo_ms" in result:
        result["rg_slowdown"] = result["rg_colocated_ms"] / result["rg_solo_ms"] - 1
    (out_dir / "timeline.json").write_text(json.dumps(tl.rows))
    stop_all_jobs(d)
    return result


def print_summary(r: dict) -> None:
    print("\n== summary")
    for name, j in r["jobs"].items():
        print(f"   {name:<16} {j['state']:<9} exit {j['exit_code']}  JCT {j['jct_s']:.0f} s")
    if "rg_slowdown" in r:
        print(f"   guarantee job step time: alone {r['rg_solo_ms']:.2f} ms, co-located {r['rg_colocated_ms']:.2f} ms "
              f"-> slowdown {100 * r['rg_slowdown']:.1f}% (2 shared CPU cores)")
    print(f"   opportunistic jobs finished: {r['op_jobs_finished']}/2, failed jobs: {r['failed_jobs']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter jobs (about 2 minutes)")
    p.add_argument("--out", type=Path, default=None, help="state and job directories (default: a temp dir)")
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="tf-antman-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"state, job directories and logs: {out}\n")
    r = run_scenario(a.quick, out)
    print_summary(r)
    print(json.dumps({k: v for k, v in r.items() if k != "jobs"}))


if __name__ == "__main__":
    main()
