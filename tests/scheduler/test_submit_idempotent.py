"""An interrupted submit: the daemon SIGKILLed after committing the job, before answering
(SCHEDULER_LITE_FAULT=submitted), and restarted. The CLI sends the submit again with the same
request id and gets the job recorded the first time: one job, not two. Real daemon processes,
the real CLI, the real socket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lite import cli
from scheduler_lite.client import ClientError, call_socket
from scheduler_lite.faults import FAULT_ENV
from scheduler_lite.storage import SqliteStorage
from tests.scheduler.test_cli_commands import CONFIG
from tests.scheduler.test_daemon_fakes import REPO, wait_for


def start_daemon(config: Path, log: Path, fault: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(config), "serve",
                                 "--log-level", "INFO"], env=env, stdout=out, stderr=out, start_new_session=True)
    assert wait_for(lambda: serving(config) or proc.poll() is not None, 30)
    return proc


def serving(config: Path) -> bool:
    """The daemon answers (a dead one's socket file stays behind: its existence says nothing)."""
    try:
        call_socket(config.parent / "state" / "scheduler.sock", "ping", {})
    except ClientError:
        return False
    return True


def cli_argv(config: Path, *argv: str) -> list[str]:
    return [sys.executable, "-m", "scheduler_lite", "--config", str(config), *argv]


def jobs_in(config: Path) -> list[tuple[str, str | None]]:
    store = SqliteStorage(config.parent / "state" / "scheduler.db")
    try:
        return [(j.id, j.request_id) for j in store.list_jobs()]
    finally:
        store.close()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "sl.toml"
    path.write_text(CONFIG)
    return path


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_submit_whose_answer_a_crash_lost_is_recorded_once(config: Path, tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    first = start_daemon(config, log, fault="submitted")
    client = subprocess.Popen(cli_argv(config, "submit", "--tenant", "B", "--request-id", "r-1", "--", "true"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert first.wait(30) == -signal.SIGKILL, log.read_text()[-2000:]  # died with the job committed
        assert jobs_in(config) == [("job-1", "r-1")]
        second = start_daemon(config, log)  # no fault: the client's retry is answered
        try:
            out, err = client.communicate(timeout=60)
            assert client.returncode == 0, err.decode()
            assert out.decode().strip() == "job-1"
            assert "sending the submit again with the same request id (r-1)" in err.decode()
            assert jobs_in(config) == [("job-1", "r-1")]  # not a second job
            # The same submit repeated by hand: the same answer, still one job.
            again = subprocess.run(cli_argv(config, "submit", "--tenant", "B", "--request-id", "r-1", "--", "true"),
                                   capture_output=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                                   timeout=60, check=False)
            assert (again.returncode, again.stdout.decode().strip()) == (0, "job-1"), again.stderr.decode()
            # The same id for another submission: refused, naming the field, nothing recorded.
            other = subprocess.run(cli_argv(config, "submit", "--tenant", "B", "--request-id", "r-1", "--", "false"),
                                   capture_output=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                                   timeout=60, check=False)
            assert other.returncode == 2
            assert other.stderr.decode().strip() == (
                "scheduler-lite: error: --request-id 'r-1' was used for job-1, whose command differs from this "
                "submission's: accepted the same submission again, or a new request id")
            assert jobs_in(config) == [("job-1", "r-1")]
        finally:
            stop(second)
    finally:
        if client.poll() is None:
            client.kill()
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


def test_a_lost_answer_with_no_daemon_back_says_the_job_may_be_recorded(
        config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "daemon.log"
    daemon = start_daemon(config, log, fault="submitted")
    monkeypatch.setattr(cli, "SUBMIT_RETRY_S", 1.0)
    monkeypatch.chdir(tmp_path)
    try:
        rc = cli.main(["--config", str(config), "submit", "--tenant", "B", "--request-id", "r-2", "--", "true"])
        assert daemon.wait(30) == -signal.SIGKILL
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == (
        "scheduler-lite: error: the daemon closed the connection without an answer (see its log) during submit: the "
        "job may have been recorded. Check with `scheduler-lite list`, or repeat this submit with --request-id r-2: "
        "it answers with the job recorded the first time, or records it now")
    assert jobs_in(config) == [("job-1", "r-2")]  # it was: a resubmit without the id would have made two
    # What the message says to do, against a restarted daemon: the first job, no second.
    daemon = start_daemon(config, log)
    try:
        rc = cli.main(["--config", str(config), "submit", "--tenant", "B", "--request-id", "r-2", "--", "true"])
        assert (rc, capsys.readouterr().out.strip()) == (0, "job-1")
        assert jobs_in(config) == [("job-1", "r-2")]
    finally:
        stop(daemon)


def test_request_ids_are_per_submitter_and_checked(config: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    daemon = start_daemon(config, tmp_path / "daemon.log")
    try:
        rc = cli.main(["--config", str(config), "submit", "--tenant", "B", "--request-id", "bad id", "--", "true"])
        assert rc == 2 and capsys.readouterr().err.strip() == (
            "scheduler-lite: error: --request-id 'bad id' is invalid: accepted 1-64 characters among "
            "A-Z a-z 0-9 _ . : -")
        # Without --request-id each submit is a new job (a fresh random id each time).
        for _ in range(2):
            assert cli.main(["--config", str(config), "submit", "--tenant", "B", "--", "true"]) == 0
        ids = jobs_in(config)
        assert [j for j, _ in ids] == ["job-1", "job-2"] and ids[0][1] != ids[1][1] and None not in dict(ids).values()
    finally:
        stop(daemon)
