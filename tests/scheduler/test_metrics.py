"""`serve --metrics-port`: a scrape during a co-located run shows what `status --json` shows."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from scheduler_lite.cli import main
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import MIB, REPO, fake_command, wait_for

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

CONFIG = to_toml(scheduler_config(
    ["1GiB"], {"A": 1, "B": 0}, jobs={"cancel_grace_s": 1},
    daemon={"tick_interval_s": 0.5, "utilisation_window_s": 2},
    coordinator={"min_memory_bytes": "64MiB", "round_interval_s": 0.5}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("scheduler_lite_")}


def expected_samples(status: dict) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the metrics must hold for this `status --json` document (docs/scheduler.md, "Metrics")."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {("scheduler_lite_status_time_seconds", ()): status["time"]}
    for g in status["gpus"]:
        out[("scheduler_lite_gpu_memory_bytes", (("gpu", str(g["id"])),))] = g["memory_bytes"]
        if g["utilisation"] is not None:
            out[("scheduler_lite_gpu_utilisation_ratio", (("gpu", str(g["id"])),))] = g["utilisation"]
        for j in g["jobs"]:
            labels = tuple(sorted({"job": j["job_id"], "gpu": str(g["id"]), "tenant": j["tenant"],
                                   "role": j["role"]}.items()))
            step = None if j["step_ms_median"] is None else j["step_ms_median"] / 1000
            for name, value in (("memory_limit_bytes", j["memory_limit_bytes"]), ("memory_in_use_bytes", j["in_use_bytes"]),
                                ("host_memory_bytes", j["host_in_use_bytes"]), ("host_fallbacks", j["host_fallbacks"]),
                                ("compute_share", j["compute_share"]), ("achieved_share", j["achieved_share"]),
                                ("step_seconds", step)):
                if value is not None:
                    out[(f"scheduler_lite_job_{name}", labels)] = value
            out[("scheduler_lite_job_state", (("job", j["job_id"]), ("state", "running"), ("tenant", j["tenant"])))] = 1
    for t in status["tenants"]:
        for name, key in (("queued_jobs", "queued"), ("quota_used_gpus", "quota_used"), ("quota_gpus", "gpu_quota"),
                          ("running_jobs", "running")):
            out[(f"scheduler_lite_tenant_{name}", (("tenant", t["name"]),))] = t[key]
    for job in status["queued"]:
        out[("scheduler_lite_job_state", (("job", job), ("state", "queued"), ("tenant", "")))] = 1
    # Jobs that do not cooperate ("WARNING:" lines: "<job or GPU N>: <check>: ...") and containment.
    for line in status.get("warnings") or ():
        who, check, _ = line.split(": ", 2)
        job = "" if who.startswith("GPU ") else who
        out[("scheduler_lite_job_misbehaving", (("check", check), ("job", job)))] = 1
    if status.get("containment") is not None:
        out[("scheduler_lite_containment_active", ())] = 1 if status["containment"]["active"] else 0
    return out


def test_a_scrape_shows_what_status_shows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "sl.toml"
    cfg.write_text(CONFIG)
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(cfg), "serve", "--metrics-port",
                              str(port)], cwd=REPO, stderr=subprocess.PIPE, text=True)

    def cli(*argv: str) -> str:
        rc = main(["--config", str(cfg), *argv])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out

    try:
        assert wait_for(lambda: (tmp_path / "state" / "scheduler.sock").exists(), timeout=60)
        env = ["--env", f"PYTHONPATH={REPO}"]
        cli("submit", "--tenant", "A", "--type", "guarantee", "--memory", "512MiB", *env, "--",
            *fake_command(step_s=0.05, demand=400 * MIB, achieved=0.6))
        cli("submit", "--tenant", "B", "--type", "opportunistic", *env, "--",
            *fake_command(step_s=0.05, demand=700 * MIB, achieved=0.3))  # more than is left: spills to host
        cli("submit", "--tenant", "B", "--type", "opportunistic", *env, "--", "sleep", "60")  # queued or not

        def colocated() -> bool:
            status = json.loads(cli("status", "--json"))
            jobs = status["gpus"][0]["jobs"]
            return len(jobs) == 2 and all(j["in_use_bytes"] is not None and j["step_ms_median"] for j in jobs)

        assert wait_for(colocated, timeout=60, interval=0.5)
        matched = 0
        for _ in range(20):  # a tick between the two reads changes the figures: then read both again
            status = json.loads(cli("status", "--json"))
            samples = scrape(port)
            if samples.get(("scheduler_lite_status_time_seconds", ())) != status["time"]:
                continue
            expected = expected_samples(status)
            assert samples == expected
            matched += 1
            if matched == 3:
                break
        assert matched == 3
        jobs = {j["job_id"]: j for j in status["gpus"][0]["jobs"]}
        assert any(j["host_in_use_bytes"] for j in jobs.values())  # the spill shows in both
    finally:
        serve.send_signal(signal.SIGTERM)
        _, log = serve.communicate(timeout=30)
        # A stopped daemon leaves its jobs running for its next start (by design); these endless
        # fake jobs would outlive the test.
        for pid_file in (tmp_path / "state" / "jobs").glob("*/pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    assert serve.returncode == 0, log


def test_a_bad_metrics_port_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "sl.toml"
    cfg.write_text(CONFIG)
    rc = main(["--config", str(cfg), "serve", "--metrics-port", "70000"])
    err = capsys.readouterr().err
    assert rc == 2 and "--metrics-port 70000 is invalid: accepted an integer in [1, 65535]" in err
