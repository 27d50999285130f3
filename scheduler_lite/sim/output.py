"""Per-job CSV (format version 2: v1 plus `migrations`), summary JSON and plots of simulation results."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from scheduler_lite.sim.result import SimResult

CSV_VERSION = 2
FIELDS = ("id", "tenant", "kind", "model", "num_gpus", "submit_s", "runtime_s", "start_s", "end_s",
          "jct_s", "queue_delay_s", "state", "preemptions", "failures", "migrations", "work_done_s", "busy_gpu_s")


def write_jobs_csv(result: SimResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        f.write(f"# scheduler_lite.sim jobs v{CSV_VERSION} policy={result.policy} seed={result.seed}\n")
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in result.records:
            writer.writerow({k: r[k] for k in FIELDS})


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

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        jcts = sorted(float(x["jct_s"]) / 3600 for x in r.records if x["jct_s"] is not None)  # type: ignore[arg-type]
        if jcts:
            ax.plot(jcts, [(i + 1) / len(jcts) for i in range(len(jcts))], label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("JCT (hours)")
    ax.set_ylabel("CDF")
    ax.legend()
    cdf = out_dir / "jct_cdf.png"
    fig.savefig(cdf, dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot([t / 3600 for t, *_ in r.timeseries], [u for _, u, _, _ in r.timeseries], label=r.policy)
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("GPU compute utilisation")
    ax.legend()
    util = out_dir / "utilisation.png"
    fig.savefig(util, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [cdf, util]
