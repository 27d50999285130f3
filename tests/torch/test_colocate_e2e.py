"""End to end: the scheduler_lite daemon co-locates a TensorFlow guarantee job and a PyTorch
opportunistic job on one emulated GPU through the same job protocol (issue 12, "Done when").

Both are real, unchanged training scripts in their own interpreters: examples/colocate_job.py
(Keras) with this test's Python, and examples/torch_train.py with a Python that has PyTorch,
submitted as the user would (`/path/to/torch/python examples/torch_train.py`). The daemon reads
the PyTorch job's stats.json, its coordinator cuts the PyTorch job's compute share and memory limit
when the guarantee job arrives, the PyTorch job applies the control at its optimizer steps (its
own statistics say so), and both jobs finish and leave tf-antman's exit report in their logs.

The Python with PyTorch: $TF_ANTMAN_TORCH_PYTHON, else this interpreter if it imports torch
(CI installs no torch: skipped there, with the reason). On the development machine:
TF_ANTMAN_TORCH_PYTHON=/work/torchvenv/bin/python (docs/pytorch.md). Timing figures belong to
bench/ scripts; this test asserts only on what the jobs and the daemon report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from scheduler_lite.testing import run_until, stop_all_jobs
from tests.conftest import REPO
from tests.torch.python_with_torch import torch_python

EXIT_REPORT = "tf-antman: at exit:"


def make_daemon(state_dir: Path):  # noqa: ANN201 - scheduler_lite.daemon.Daemon
    from scheduler_lite.config import parse_config
    from scheduler_lite.daemon import Daemon
    from scheduler_lite.storage import SqliteStorage

    cfg = parse_config({
        "version": 1,
        "paths": {"state_dir": str(state_dir)},
        "devices": {"kind": "emulated", "emulated": [{"id": 0, "memory": "2GiB"}]},
        "tenants": [{"name": "research", "gpu_quota": 1}, {"name": "batch", "gpu_quota": 0}],
        "jobs": {"host_memory": "1GiB", "cancel_grace_s": 5},
        "daemon": {"tick_interval_s": 0.25, "schedule_interval_s": 1, "utilisation_window_s": 10},
        "coordinator": {"round_interval_s": 2, "min_memory_bytes": "64MiB", "settle_timeout_s": 30},
    }, base_dir=state_dir)
    return Daemon(cfg, SqliteStorage(cfg.db_path))


def job_site(tmp: Path) -> Path:
    """A sitecustomize for both jobs' PYTHONPATH: the tf-antman wheel's .pth line (the package
    runs from this checkout, and the PyTorch venv does not have the wheel installed), and absl's
    INFO verbosity, which a user asks for to see tf-antman's INFO lines (the exit report of a job
    nothing slowed is one: tf_antman/exit_report.py)."""
    from tf_antman.importhook import PTH_LINE

    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        PTH_LINE + "from absl import logging as _absl_logging\n_absl_logging.set_verbosity(_absl_logging.INFO)\n")
    return site


def test_tf_guarantee_and_torch_opportunistic_jobs_share_one_gpu(tmp_path: Path) -> None:
    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    site = job_site(tmp_path)
    d = make_daemon(tmp_path / "state")
    # The PyTorch job's environment as a user's activated venv gives it: its bin on PATH (ninja,
    # for the op hook's first build).
    torch_env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
                 "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])}
    # Long enough to outlast the guarantee job whatever the machine: throttled to the floor share
    # while the guarantee job runs, then back to the whole GPU to finish.
    torch_job = d.submit([python, str(REPO / "examples" / "torch_train.py"), "--steps", "12000",
                          "--print-every", "500"],
                         tenant="batch", kind="opportunistic", env=torch_env, name="torch-op")
    rows: list[dict] = []

    def sample(dd) -> None:  # noqa: ANN001
        for g in dd.status().gpus:
            for j in g.jobs:
                rows.append({"job": j.job_id, "share": j.compute_share, "limit": j.memory_limit_bytes,
                             "step": j.step, "rg_running": any(x.job_id == tf_job[0] and (x.step or 0) > 0
                                                               for x in g.jobs)})

    tf_job = [""]

    def torch_stepping(dd) -> bool:  # noqa: ANN001
        sample(dd)
        j = dd.status().gpu(0).job(torch_job)
        return dd.job(torch_job).state.done or (j is not None and (j.step or 0) >= 200)

    try:
        assert run_until(d, torch_stepping, timeout=300), "the PyTorch job never reported 200 steps"
        assert not d.job(torch_job).state.done, (d.job_dir(torch_job) / "stderr.log").read_text()[-3000:]
        before = [r for r in rows if r["job"] == torch_job and r["share"] is not None]
        tf_job[0] = d.submit([sys.executable, str(REPO / "examples" / "colocate_job.py"), "--width", "256",
                              "--steps", "1500", "--batch", "64", "--print-every", "50"],
                             tenant="research", kind="guarantee", env={"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])},
                             name="tf-rg")

        def both_done(dd) -> bool:  # noqa: ANN001
            sample(dd)
            return dd.job(tf_job[0]).state.done and dd.job(torch_job).state.done

        assert run_until(d, both_done, timeout=900), "the jobs did not finish in 15 minutes"
    finally:
        stop_all_jobs(d)

    logs = {name: (d.job_dir(j) / "stderr.log").read_text(errors="replace")
            for name, j in (("tf", tf_job[0]), ("torch", torch_job))}
    for name, j in (("tf", tf_job[0]), ("torch", torch_job)):
        rec = d.job(j)
        assert rec.state.value == "finished" and rec.exit_code == 0, f"{name}: {rec.state}\n{logs[name][-3000:]}"
        assert EXIT_REPORT in logs[name], f"{name} job left no exit report:\n{logs[name][-3000:]}"
    assert "active for PyTorch" in logs["torch"]

    # The daemon read the PyTorch job's own statistics: settings in force and steps, before and
    # while the guarantee job trained.
    assert before and all(r["share"] == 1.0 for r in before)
    during = [r for r in rows if r["job"] == torch_job and r["rg_running"] and r["share"] is not None]
    assert during, "no sample of the PyTorch job while the TensorFlow job was training"
    # The coordinator cut its share and limit for the guarantee job, and the job applied them
    # (status shows what the job reports in force, not what the daemon decided).
    assert min(r["share"] for r in during) < 1.0
    assert min(r["limit"] for r in during) < min(r["limit"] for r in before)
    stats = json.loads((d.job_dir(torch_job) / "stats.json").read_text())
    assert stats["state"] == "finished" and stats["step"] == 12000
    assert stats["controls_applied"] >= 1 and stats["controls_rejected"] == 0, stats
    # Throttled for real: the op hook held its ops back (the exit report's throttled time).
    assert "throttled 0.0 s" not in logs["torch"].split(EXIT_REPORT, 1)[1]
    # ...and back to the whole GPU once the guarantee job had gone: it finished at share 1.
    assert stats["compute_share"] == 1.0
