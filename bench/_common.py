"""Helpers shared by the bench scripts: run training jobs in fresh processes, summarise."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_job.py"


def job_env(antman: dict[str, str] | None, threads: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if threads:
        env.update(TF_NUM_INTRAOP_THREADS=str(threads), TF_NUM_INTEROP_THREADS=str(threads))
    env.update(antman or {})
    return env


def start_job(args: list[str], antman: dict[str, str] | None, threads: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(JOB), *args], env=job_env(antman, threads),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_job(p: subprocess.Popen[str], timeout: float = 600) -> dict:
    out, err = p.communicate(timeout=timeout)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"job failed (rc={p.returncode}):\n{err[-3000:]}")


def run_job(args: list[str], antman: dict[str, str] | None, threads: int | None = None) -> dict:
    return finish_job(start_job(args, antman, threads))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(rows: list[list[object]], header: list[str]) -> str:
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def step_time_ratio_vs_stock(pairs: int, steps: int, width: int = 512) -> tuple[float, list[float], list[float]]:
    """Keras fit step time under tf-antman (share 100%, no limit) over stock TF: medians of
    alternating runs, so drifts in machine load hit both alike."""
    args = ["--mode", "keras", "--steps", str(steps), "--width", str(width)]
    stock, ours = [], []
    for _ in range(pairs):
        stock.append(median(run_job(args, None)["step_times"]))
        ours.append(median(run_job(args, {"ANTMAN_ENABLE": "1"})["step_times"]))
    return statistics.median(ours) / statistics.median(stock), stock, ours
