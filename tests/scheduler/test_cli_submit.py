"""`scheduler-lite submit`: the job's own options, refused sizes, quota report, concurrent submissions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scheduler_lite.cli import main
from scheduler_lite.storage import SqliteStorage
from tests.scheduler.serving import serving
from tests.scheduler.test_cli_commands import CONFIG, cli_config
from tests.scheduler.test_daemon_fakes import REPO

CONCURRENT = 200


@pytest.fixture
def cfg(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "sl.toml"
    path.write_text(CONFIG)
    with serving(path):  # answers the CLI, does not tick: jobs stay queued
        yield str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def stored_command(cfg: str, job_id: str) -> tuple[str, ...]:
    store = SqliteStorage(Path(cfg).parent / "state" / "scheduler.db")
    try:
        record = store.get_job(job_id)
        assert record is not None
        return record.command
    finally:
        store.close()


def test_options_after_the_command_belong_to_the_job(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--tenant", "B", sys.executable, "train.py", "--json",
                     "--memory", "1", "--config", "x")
    assert rc == 0 and out.strip() == "job-1"  # plain output: --json was the job's
    assert stored_command(cfg, "job-1") == (sys.executable, "train.py", "--json", "--memory", "1", "--config", "x")
    # Before the command, --json is still scheduler-lite's; with '--' as before.
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--json", "--tenant", "B", "--", sys.executable, "a.py",
                     "--json")
    assert rc == 0 and json.loads(out)["id"] == "job-2"
    assert stored_command(cfg, "job-2") == (sys.executable, "a.py", "--json")


@pytest.mark.parametrize(("memory", "message"), [
    ("0", "--memory 0 is invalid: accepted a size in [1, 1073741824] bytes (1.0 GiB, the largest GPU); "
          "leave it out for the whole GPU"),
    ("2GiB", "--memory 2147483648 is invalid: accepted a size in [1, 1073741824] bytes (1.0 GiB, the largest GPU); "
             "leave it out for the whole GPU (asked: 2.0 GiB)"),
])
def test_memory_zero_or_above_the_gpu_is_refused(cfg: str, capsys: pytest.CaptureFixture[str], memory: str,
                                                 message: str) -> None:
    rc, _, err = run(capsys, "--config", cfg, "submit", "--tenant", "B", "--memory", memory, "--", "true")
    assert rc == 2 and err.strip() == f"scheduler-lite: error: {message}"


def test_steps_and_duration_are_validated_and_stored(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "--config", cfg, "submit", "--tenant", "B", "--steps", "0", "--", "true")
    assert rc == 2 and "--steps 0 is invalid: accepted an integer in [1, " in err
    rc, _, err = run(capsys, "--config", cfg, "submit", "--tenant", "B", "--duration", "nan", "--", "true")
    assert rc == 2 and "--duration nan is invalid: accepted seconds in (0, 1e+09]" in err
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--json", "--tenant", "A", "--steps", "500", "--", "true")
    assert rc == 0 and json.loads(out)["job"]["expected_steps"] == 500


def test_share_and_restartable_are_validated_and_stored(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "1.5", "nan"):
        rc, _, err = run(capsys, "--config", cfg, "submit", "--tenant", "B", "--share", bad, "--", "true")
        assert rc == 2 and f"--share {float(bad)!r} is invalid: accepted a fraction of one GPU in (0, 1]" in err
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--json", "--tenant", "B", "--type", "opportunistic",
                     "--share", "0.4", "--restartable", "--", "true", "--share", "9")
    job = json.loads(out)["job"]
    assert rc == 0 and (job["requested_share"], job["restartable"]) == (0.4, True)
    assert stored_command(cfg, job["id"]) == ("true", "--share", "9")  # the job's own option
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--json", "--tenant", "B", "--", "true")
    job = json.loads(out)["job"]
    assert rc == 0 and (job["requested_share"], job["restartable"]) == (None, False)
    rc, out, _ = run(capsys, "--config", cfg, "show", job["id"])
    fields = dict(line.split(None, 1) for line in out.split("events:")[0].splitlines() if " " in line.strip())
    assert rc == 0 and fields["share"].strip() == "-" and fields["restart"].strip() == "no"


def test_quotas_above_the_gpu_count_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "over.toml"
    path.write_text(cli_config(quotas={"A": 1, "B": 2}))
    with serving(path):
        rc, _, err = run(capsys, "--config", str(path), "tenants")
        assert rc == 0
        assert err.strip() == ("warning: tenant quotas sum to 3 GPUs but 1 GPU(s) are configured: a tenant within "
                               "its quota may still wait for another tenant's guarantee jobs")
        rc, _, err = run(capsys, "--config", str(path), "status")
        assert rc == 0 and "tenant quotas sum to 3 GPUs" in err


def test_the_quota_warning_is_the_running_daemon_s(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The quotas and GPUs of the daemon's answer, not of the client's config file edited since
    the daemon started (it still runs with the quotas it read)."""
    path = tmp_path / "sl.toml"
    path.write_text(cli_config(quotas={"A": 1, "B": 2}))
    with serving(path):
        path.write_text(cli_config(quotas={"A": 1, "B": 0}))  # edited, the daemon not restarted
        for command in ("tenants", "status"):
            rc, _, err = run(capsys, "--config", str(path), command)
            assert rc == 0 and err.startswith("warning: tenant quotas sum to 3 GPUs but 1 GPU(s) are configured"), err
    with serving(path):  # restarted: quotas 1 + 0
        path.write_text(cli_config(quotas={"A": 1, "B": 2}))
        for command in ("tenants", "status"):
            rc, _, err = run(capsys, "--config", str(path), command)
            assert (rc, err) == (0, "")


def test_concurrent_submit_processes_each_record_one_job(tmp_path: Path, cfg: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def submit(i: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", cfg, "submit", "--tenant", "B",
                               "--name", f"n{i}", "--", "true"], env=env, capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(CONCURRENT) as pool:
        done = list(pool.map(submit, range(CONCURRENT)))
    problems = [(p.returncode, p.stderr) for p in done if p.returncode != 0 or p.stderr]
    assert not problems, problems[:3]
    ids = [p.stdout.strip() for p in done]
    assert len(set(ids)) == CONCURRENT
    store = SqliteStorage(Path(cfg).parent / "state" / "scheduler.db")
    try:
        jobs = store.list_jobs()
        submitted = [e for e in store.events() if e.kind == "submitted"]
    finally:
        store.close()
    assert sorted(j.id for j in jobs) == sorted(ids)
    assert sorted(j.name for j in jobs) == sorted(f"n{i}" for i in range(CONCURRENT))  # each exactly once
    assert sorted(e.job_id for e in submitted) == sorted(ids)  # type: ignore[type-var]
