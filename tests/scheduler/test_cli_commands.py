"""scheduler-lite commands through cli.main(argv), and `serve` as a real process."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from scheduler_lite.cli import main
from scheduler_lite.isolation import SESSION_VARIABLES
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.serving import serving
from tests.scheduler.test_daemon_fakes import REPO, fake_command, wait_for


def cli_config(gpu_memory: str = "1GiB", quotas: Mapping[str, int] | None = None,
               users: Mapping[str, Sequence[str]] | None = None) -> str:
    """One emulated GPU, tenant A (quota 1) and B (opportunistic only), a fast tick."""
    return to_toml(scheduler_config([gpu_memory], quotas or {"A": 1, "B": 0}, users=users,
                                    daemon={"tick_interval_s": 0.05}, coordinator={"min_memory_bytes": "64MiB"}))


CONFIG = cli_config()


@pytest.fixture
def cfg_file(tmp_path: Path) -> str:
    path = tmp_path / "sl.toml"
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture
def cfg(cfg_file: str) -> Iterator[str]:
    """The config, with a daemon answering the CLI (it does not tick: jobs stay queued)."""
    with serving(cfg_file):
        yield cfg_file


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_submit_list_show_cancel_tenants(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--tenant", "A", "--type", "guarantee", "--memory", "256MiB",
                     "--env", "K=V", "--name", "first", "--", sys.executable, "-c", "pass")
    assert rc == 0 and out.strip() == "job-1"
    rc, out, _ = run(capsys, "submit", "--config", cfg, "--tenant", "B", "--type", "opportunistic", "--json",
                     "--", "true")
    assert rc == 0 and json.loads(out)["id"] == "job-2"

    rc, out, _ = run(capsys, "--config", cfg, "list")
    lines = out.splitlines()
    assert lines[0].split()[:7] == ["ID", "NAME", "TENANT", "USER", "TYPE", "ROLE", "STATE"]
    assert lines[1].split()[:7] == ["job-1", "first", "A", pwd.getpwuid(os.getuid()).pw_name, "guarantee", "-",
                                    "queued"]
    rc, out, _ = run(capsys, "--config", cfg, "list", "--json")
    jobs = json.loads(out)
    assert [(j["id"], j["tenant"], j["kind"], j["state"], j["memory_bytes"]) for j in jobs] == [
        ("job-1", "A", "guarantee", "queued", 256 << 20), ("job-2", "B", "opportunistic", "queued", None)]
    # Its --env, and the variables of the submitting session that the job's command resolves against.
    assert {k: v for k, v in jobs[0]["env"].items() if k not in SESSION_VARIABLES} == {"K": "V"}
    assert jobs[0]["env"].get("PATH") == os.environ.get("PATH")

    rc, out, _ = run(capsys, "--config", cfg, "show", "job-1")
    assert rc == 0 and "tenant     A" in out and "256.0 MiB" in out and "submitted" in out.split("events:")[1]

    rc, out, _ = run(capsys, "--config", cfg, "cancel", "job-2")
    assert rc == 0 and out.strip() == "job-2: cancel requested"
    rc, out, _ = run(capsys, "--config", cfg, "list", "--state", "queued", "--json")
    assert [j["cancel_requested"] for j in json.loads(out)] == [False, True]

    rc, out, _ = run(capsys, "--config", cfg, "tenants", "--json")
    assert json.loads(out) == [
        {"name": "A", "gpu_quota": 1, "quota_used": 0, "running": 0, "queued": 1},
        {"name": "B", "gpu_quota": 0, "quota_used": 0, "running": 0, "queued": 1},
    ]
    rc, out, _ = run(capsys, "--config", cfg, "status", "--json")
    status = json.loads(out)
    assert [(g["id"], g["memory_bytes"], g["jobs"]) for g in status["gpus"]] == [(0, 1 << 30, [])]
    assert status["queued"] == ["job-1", "job-2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "--tenant", "Z", "--", "true"], "unknown tenant 'Z'; tenants: A, B"),
        (["submit", "--tenant", "A", "--", "no-such-program-xyz"], "command 'no-such-program-xyz' not found"),
        (["submit", "--tenant", "A", "--"], "no command"),
        (["submit", "--tenant", "A", "--gpus", "3", "--", "true"], "--gpus 3 is invalid: accepted an integer in [1, 1]"),
        (["submit", "--tenant", "B", "--type", "guarantee", "--", "true"], "can never run"),
        (["submit", "--tenant", "A", "--env", "ANTMAN_JOB_DIR=/x", "--", "true"], "set by the scheduler"),
        (["submit", "--tenant", "A", "--env", "NOEQUALS", "--", "true"], "expected KEY=VALUE"),
        (["submit", "--tenant", "A", "--memory", "lots", "--", "true"], "--memory"),
        (["show", "job-9"], "no job 'job-9'"),
        (["cancel", "job-9"], "no job 'job-9'"),
        (["logs", "job-9"], "no job 'job-9'"),
    ],
)
def test_user_mistakes_are_one_line_and_status_2(cfg: str, capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 message: str) -> None:
    rc, out, err = run(capsys, "--config", cfg, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("scheduler-lite: error: ") and message in err
    assert "Traceback" not in err


def test_a_bad_config_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(cli_config(gpu_memory="1KiB"))
    rc, _, err = run(capsys, "--config", str(path), "list")
    assert rc == 2 and "devices.emulated[0].memory='1KiB' is invalid: accepted" in err
    path.write_text(cli_config(users={"B": ["Not A Name"]}))
    rc, _, err = run(capsys, "--config", str(path), "list")
    assert rc == 2 and "tenants[1].users=['Not A Name'] is invalid: accepted a list of user or group names" in err
    rc, _, err = run(capsys, "--config", str(tmp_path / "missing.toml"), "list")
    assert rc == 1 and "missing.toml" in err and "Traceback" not in err


def test_sim_is_forwarded_to_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["sim", "--help"])
    assert done.value.code == 0
    assert "--workload" in capsys.readouterr().out  # the simulator's own help


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "submit --tenant" in out


def test_without_a_daemon_commands_say_so(cfg_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["list"], ["submit", "--tenant", "A", "--", "true"], ["status"], ["cancel", "job-1"]):
        rc, out, err = run(capsys, "--config", cfg_file, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("scheduler-lite: error: no scheduler-lite daemon is serving") and "serve" in err
    assert not (Path(cfg_file).parent / "state" / "scheduler.db").exists()  # the client never opens the store


def test_serve_runs_jobs_until_sigterm(cfg_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = cfg_file
    serve = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", cfg, "serve"], cwd=REPO,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (Path(cfg).parent / "state" / "scheduler.sock").exists(), timeout=60)
        rc, out, _ = run(capsys, "--config", cfg, "submit", "--tenant", "A", "--env", f"PYTHONPATH={REPO}", "--",
                         *fake_command(steps=3))
        job = out.strip()

        def finished() -> bool:
            main(["--config", cfg, "show", job, "--json"])
            return json.loads(capsys.readouterr().out)["job"]["state"] == "finished"

        assert wait_for(finished, timeout=30, interval=0.1)
        rc, out, _ = run(capsys, "--config", cfg, "logs", job)
        assert rc == 0 and out.splitlines()[0] == "env emulated 0 0" and out.splitlines()[-1] == "done 3"
        rc, out, _ = run(capsys, "--config", cfg, "logs", job, "--stderr", "--follow")
        assert rc == 0 and out == "to stderr\n"
        # `logs job | head`: a reader that went away is not an error (no message, the SIGPIPE status).
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            piped = subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", cfg, "logs", job], cwd=REPO,
                                   stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(write_end)
        assert (piped.returncode, piped.stderr) == (141, "")
        rc, _, err = run(capsys, "--config", cfg, "serve")  # one daemon per state directory
        assert rc == 2 and "another scheduler-lite daemon" in err
    finally:
        serve.send_signal(signal.SIGTERM)
        _, log = serve.communicate(timeout=30)
    assert serve.returncode == 0, log
    assert "stopped" in log and "Traceback" not in log


def test_serve_refuses_a_shared_state_dir_and_leaves_it_alone(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`state_dir = "/tmp"` must not make /tmp 0755 (serve sets its state directory's mode)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    cfg = tmp_path / "sl.toml"
    cfg.write_text(to_toml(scheduler_config(["1GiB"], {"A": 1}, state_dir=str(shared))))
    rc, _, err = run(capsys, "--config", str(cfg), "serve")
    assert rc == 2 and "paths.state_dir=" in err and "not a shared one (mode 1777)" in err, err
    assert os.stat(shared).st_mode & 0o7777 == 0o1777 and list(shared.iterdir()) == []
    os.chmod(shared, 0o755)
    if os.geteuid() == 0:  # another user's directory
        os.chown(shared, 65534, 65534)
        rc, _, err = run(capsys, "--config", str(cfg), "serve")
        assert rc == 2 and "owned by the daemon's user (uid 0), not by uid 65534" in err, err
        assert list(shared.iterdir()) == []


def test_status_warns_about_a_job_that_never_reports(capsys: pytest.CaptureFixture[str]) -> None:
    """A job started with a Python that lacks tf-antman runs unmanaged and writes no stats.json:
    status says so instead of showing a control pending for ever."""
    from scheduler_lite.cli import SILENT_JOB_S, _print_status
    from scheduler_lite.model import Role
    from scheduler_lite.status import ClusterStatus, GpuStatus, JobOnGpu

    silent = JobOnGpu("job-1", "A", Role.OPPORTUNISTIC, None, None, controls_pending=1, running_s=SILENT_JOB_S + 5)
    young = JobOnGpu("job-2", "A", Role.OPPORTUNISTIC, None, None, running_s=2.0)
    reporting = JobOnGpu("job-3", "A", Role.GUARANTEE, 1 << 30, 1.0, step=5, running_s=SILENT_JOB_S + 5)
    gpus = (GpuStatus(0, 1 << 30, "g", None, (silent, reporting)), GpuStatus(1, 1 << 30, "g", None, (young,)))
    _print_status(ClusterStatus(0.0, gpus, (), (), ("job-1", "job-2", "job-3")))
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: job-1 has run 35 s without writing stats.json")
