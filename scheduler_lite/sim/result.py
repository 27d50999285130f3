"""What a simulation run returns (one record per job and the summary figures over them) and the
files it is written to: the per-job CSV (format version 2: v1 plus `migrations`), one row per
record; the summary JSON; the plots. The summary is what bench/sim.py and `scheduler-lite sim`
report. Quantiles are nearest-rank on the sorted JCTs (the p95 of 20 jobs is the 20th), so a
summary never interpolates between two jobs.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scheduler_lite.sim.simjob import SimJob

# Summary fields that say how long the engine took or how much work it did, not what happened:
# speed work changes them, so result hashes (tests/scheduler/test_sim_golden.py) leave them out.
ENGINE_WORK = frozenset({"wall_s", "events", "rounds", "schedule_calls"})
# Jobs averaged by `guarantee_avg_jct_s`: those submitted as guarantee or auto. An auto job is
# "guarantee unless its estimated queueing delay is long" (model.JobKind): the guarantee tenant's
# job, run as a guarantee job by the baselines (which have no other way), perhaps started
# opportunistically and upgraded by tf-antman. Filing it by how it ran would compare different
# jobs across policies; `opportunistic_avg_jct_s` averages the jobs submitted as opportunistic.
GUARANTEE_KINDS = frozenset({"guarantee", "auto"})


@dataclass
class SimResult:
    policy: str
    workload: str
    seed: int
    records: list[dict[str, object]]
    summary: dict[str, float]
    timeseries: list[tuple[float, float, float, int]] = field(default_factory=list)


def job_record(sj: SimJob) -> dict[str, object]:
    """A job's row: when it was submitted, started and ended, and what happened to it."""
    tj = sj.trace
    jct = (sj.end - tj.submit_time) if sj.end is not None and sj.state == "finished" else None
    return {
        "id": tj.id, "tenant": tj.tenant, "kind": str(tj.kind), "model": tj.model,
        "num_gpus": tj.num_gpus, "submit_s": tj.submit_time, "runtime_s": tj.runtime_s,
        "start_s": sj.first_start, "end_s": sj.end, "jct_s": jct,
        "queue_delay_s": None if sj.first_start is None else sj.first_start - tj.submit_time,
        "state": sj.state, "preemptions": sj.preemptions, "failures": sj.failures,
        "migrations": sj.migrations,
        "work_done_s": sj.work_done, "busy_gpu_s": sj.busy_gpu_s,
    }


def summarise(records: Sequence[dict[str, object]], first_submit: float, gpu_memory: Mapping[int, int],
              integrals: tuple[float, float, float], counters: Mapping[str, int],
              wall_s: float) -> tuple[dict[str, float], float]:
    """The run's summary and the time its last job ended.

    `integrals`: the cluster's utilisation, memory in use and busy GPUs integrated over time.
    """
    fin = [r for r in records if r["state"] == "finished"]
    jcts = sorted(float(r["jct_s"]) for r in fin)  # type: ignore[arg-type]
    guar = [float(r["jct_s"]) for r in fin if r["kind"] in GUARANTEE_KINDS]  # type: ignore[arg-type]
    opp = [float(r["jct_s"]) for r in fin if r["kind"] not in GUARANTEE_KINDS]  # type: ignore[arg-type]
    delays = [float(r["queue_delay_s"]) for r in records if r["queue_delay_s"] is not None]  # type: ignore[arg-type]
    last = max((float(r["end_s"]) for r in records if r["end_s"] is not None), default=first_submit)  # type: ignore[arg-type]
    span = max(last - first_submit, 1e-9)
    n_gpus = len(gpu_memory)
    util, mem, busy = integrals
    summary = {
        "jobs": len(records),
        "finished": len(fin),
        "failed": sum(1 for r in records if r["state"] == "failed"),
        "unfinished": sum(1 for r in records if r["state"] in ("pending", "running")),
        "oom_failures": sum(int(r["failures"]) for r in records),  # type: ignore[call-overload]
        "preemptions": sum(int(r["preemptions"]) for r in records),  # type: ignore[call-overload]
        "avg_jct_s": _mean(jcts),
        "median_jct_s": _quantile(jcts, 0.5),
        "p95_jct_s": _quantile(jcts, 0.95),
        "guarantee_avg_jct_s": _mean(guar),
        "opportunistic_avg_jct_s": _mean(opp),
        "avg_queue_delay_s": _mean(delays),
        "makespan_s": span,
        "gpu_compute_util": util / (n_gpus * span),
        "gpu_memory_util": mem / (sum(gpu_memory.values()) * span),
        "gpu_busy_fraction": busy / (n_gpus * span),
        "busy_gpu_seconds": busy,
        "wall_s": wall_s,
        **{k: float(v) for k, v in counters.items()},
    }
    return summary, last


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _quantile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return math.nan
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


CSV_VERSION = 2
FIELDS = ("id", "tenant", "kind", "model", "num_gpus", "submit_s", "runtime_s", "start_s", "end_s",
          "jct_s", "queue_delay_s", "state", "preemptions", "failures", "migrations", "work_done_s", "busy_gpu_s")


def write_jobs_csv(result: SimResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        f.write(f"# scheduler_lite.sim jobs v{CSV_VERSION} policy={result.policy} seed={result.seed}\n")
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(result.records)


def write_summary(results: list[SimResult], path: Path) -> None:
    """Strict JSON: a figure without a value (NaN: no finished guarantee job to average) is null."""
    rows = [{"policy": r.policy, "workload": r.workload, "seed": r.seed,
             **{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.summary.items()}}
            for r in results]
    path.write_text(json.dumps(rows, indent=1, allow_nan=False))


def plot(results: list[SimResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def figure(name: str, xlabel: str, ylabel: str, lines: list[tuple[str, list[float], list[float]]],
               log_x: bool = False) -> Path:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, xs, ys in lines:
            ax.plot(xs, ys, label=policy)
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend()
        path = out_dir / name
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return path

    cdfs = []
    for r in results:
        jcts = sorted(float(x["jct_s"]) / 3600 for x in r.records if x["jct_s"] is not None)  # type: ignore[arg-type]
        if jcts:  # a policy with no finished job has no curve
            cdfs.append((r.policy, jcts, [(i + 1) / len(jcts) for i in range(len(jcts))]))
    util = [(r.policy, [t / 3600 for t, *_ in r.timeseries], [u for _, u, _, _ in r.timeseries]) for r in results]
    return [figure("jct_cdf.png", "JCT (hours)", "CDF", cdfs, log_x=True),
            figure("utilisation.png", "time (hours)", "GPU compute utilisation", util)]
