"""scheduler-lite commands through cli.main(argv), and `serve` as a real process."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from scheduler_lite import cli as cli_module
from scheduler_lite.cli import EXAMPLES, build_parser, main
from scheduler_lite.client import call as client_call
from scheduler_lite.config import CONFIG_ENV, load_config
from scheduler_lite.isolation import SESSION_VARIABLES
from scheduler_lite.model import JobKind, Role
from scheduler_lite.storage import JobSpec, SqliteStorage
from scheduler_lite.wire import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT
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
    rc, out, _ = run(capsys, "--config", cfg, "cancel", "job-2")  # the grace is not started again
    assert rc == 0 and out.strip() == "job-2: cancel already requested"
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


def test_show_says_a_job_cancelled_while_queued_never_ran(cfg_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    with serving(cfg_file, ticks=True):
        # Tenant A's quota is one GPU: its second guarantee job stays queued until cancelled.
        run(capsys, "--config", cfg_file, "submit", "--tenant", "A", "--type", "guarantee", "--", "sleep", "60")
        rc, out, _ = run(capsys, "--config", cfg_file, "submit", "--tenant", "A", "--type", "guarantee", "--", "true")
        job = out.strip()
        run(capsys, "--config", cfg_file, "cancel", job)

        def shown() -> str:
            main(["--config", cfg_file, "show", job])
            return capsys.readouterr().out

        assert wait_for(lambda: "cancelled" in shown().split("events:")[0], timeout=30, interval=0.1)
        exit_line = [line for line in shown().splitlines() if line.startswith("exit")]
        assert exit_line == ["exit       never ran"], exit_line
        rc, out, err = run(capsys, "--config", cfg_file, "logs", "--follow", job)  # it ended silently before
        assert rc == 0 and out == "" and err == f"{job} ended without starting (cancelled): no logs\n"


README = str(Path(__file__).resolve().parents[2] / "README.md")  # mode 0644: not executable


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "--tenant", "Z", "--", "true"], "unknown tenant 'Z'; tenants: A, B"),
        (["submit", "--tenant", "A", "--", "no-such-program-xyz"], "command 'no-such-program-xyz' not found"),
        (["submit", "--tenant", "A", "--"], "no command"),
        (["submit", "--tenant", "A", "--gpus", "3", "--", "true"], "--gpus 3 is invalid: accepted an integer in [1, 1]"),
        (["submit", "--tenant", "B", "--type", "guarantee", "--", "true"], "can never run"),
        (["submit", "--tenant", "A", "--env", "ANTMAN_JOB_DIR=/x", "--", "true"], "set by the scheduler"),
        # Values tf-antman would refuse at the job's start (a traceback in its log, exit status 1):
        (["submit", "--tenant", "A", "--env", "ANTMAN_HOST_MEMORY=lots", "--", "true"],
         "--env ANTMAN_HOST_MEMORY='lots' is invalid: accepted 0..1PiB"),
        (["submit", "--tenant", "A", "--env", "ANTMAN_STATS_INTERVAL_MS=-5", "--", "true"],
         "--env ANTMAN_STATS_INTERVAL_MS='-5' is invalid: accepted"),
        (["submit", "--tenant", "A", "--", "/no/such/cmd"], "command '/no/such/cmd' not found\n"),
        (["submit", "--tenant", "A", "--", README], f"{README!r} is not an executable file"),
        (["submit", "--tenant", "A", "--", "/tmp"], "'/tmp' is not an executable file"),
        (["submit", "--tenant", "A", "--env", "NOEQUALS", "--", "true"], "expected KEY=VALUE"),
        (["submit", "--tenant", "A", "--memory", "lots", "--", "true"], "--memory"),
        (["submit", "--tenant", "A", "--memory", "10GiB", "--", "true"], "(asked: 10.0 GiB)"),
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
    assert rc == 1 and err == f"scheduler-lite: error: config file {tmp_path / 'missing.toml'}: No such file or directory\n"


@pytest.mark.parametrize(
    ("argv", "message", "command"),
    [
        (["submit", "--type", "foo", "--", "true"], "argument --type: invalid choice: 'foo' (choose from", "submit"),
        (["submit", "--gpus", "abc", "--", "true"], "argument --gpus: invalid int value: 'abc'", "submit"),
        (["submit", "--steps", "1.5", "--", "true"], "argument --steps: invalid int value: '1.5'", "submit"),
        (["list", "--state", "bogus"], "argument --state: invalid choice: 'bogus'", "list"),
        (["list", "--bogus", "a\nb"], "unrecognized arguments: --bogus a\\nb", "list"),  # the newline escaped
        (["list", "--limit", "0"], "argument --limit: '0' is invalid: accepted an integer >= 1 (--all: every job)",
         "list"),
        (["list", "--limit", "-3"], "argument --limit: '-3' is invalid: accepted an integer >= 1", "list"),
        (["list", "--limit", "ten"], "argument --limit: 'ten' is invalid: accepted an integer >= 1", "list"),
        (["list", "--limit", "2.5"], "argument --limit: '2.5' is invalid: accepted an integer >= 1", "list"),
        (["list", "--limit", "1_0"], "argument --limit: '1_0' is invalid: accepted an integer >= 1", "list"),
        (["list", "--limit", "\u0661\u0660"], "argument --limit: '\u0661\u0660' is invalid", "list"),  # Arabic-Indic 10
        (["list", "--limit"], "argument --limit: expected one argument", "list"),
        (["list", "--limit", "5", "--all"], "argument --all: not allowed with argument --limit", "list"),
        (["status", "extra"], "unrecognized arguments: extra", "status"),
        (["bogus"], "argument COMMAND: invalid choice: 'bogus'", None),
        (["--config"], "argument --config: expected one argument", None),
    ],
)
def test_option_mistakes_are_one_line_naming_the_help_to_read(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                              message: str, command: str | None) -> None:
    """argparse's own errors read like every other mistake: no usage block, the docs' prefix."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr()
    help_of = f"scheduler-lite {command}" if command else "scheduler-lite"
    assert done.value.code == 2 and out.out == ""
    assert out.err.count("\n") == 1 and out.err.startswith(f"scheduler-lite: error: {message}"), out.err
    assert out.err.endswith(f" (see '{help_of} --help')\n"), out.err


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


def test_usage_examples_reach_the_daemon_they_start() -> None:
    """The docs' usage block and --help's examples, run as written, line after line: every client
    line reads the config its `serve` line started the daemon with (else it would look for the
    packaged default's daemon), and the tenants it submits to are that config's."""
    doc = (REPO / "docs" / "scheduler.md").read_text()
    usage = next(b for b in re.findall(r"```\n(.*?)```", doc, re.S) if "scheduler-lite serve" in b
                 or "scheduler-lite --config" in b)
    examples = EXAMPLES.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    for block in (usage, examples):
        env: dict[str, str] = {}
        configs: list[tuple[str, str | None]] = []
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["export"]:
                key, _, value = words[1].partition("=")
                env[key] = value
            elif words[:1] == ["scheduler-lite"]:
                args, _ = build_parser().parse_known_args(words[1:])
                if args.command == "sim":
                    continue  # the simulator reads no config
                configs.append((args.command, args.config or env.get(CONFIG_ENV)))
                if args.command == "submit":
                    tenant = args.tenant
                    assert tenant in {t.name for t in load_config(REPO / str(configs[0][1])).tenants}, line
        assert configs[0][0] == "serve" and configs[0][1] is not None, block
        assert all(config == configs[0][1] for _, config in configs), (block, configs)
        assert len(configs) >= 4


def test_without_a_daemon_commands_say_so(cfg_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["list"], ["submit", "--tenant", "A", "--", "true"], ["status"], ["cancel", "job-1"]):
        rc, out, err = run(capsys, "--config", cfg_file, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("scheduler-lite: error: no scheduler-lite daemon is serving")
        assert f"start it with 'scheduler-lite --config {cfg_file} serve'" in err  # this config's daemon
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


def test_logs_print_the_job_s_bytes_unchanged(cfg_file: str, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    """Past the daemon's 1 MiB answers, a character cut by a chunk's end comes out whole, and
    output that is not UTF-8 at all as the job wrote it (docs: `logs` prints the log itself)."""
    wrote = "\u20ac".encode() * 400_000 + b"\xff\xfe not UTF-8\n"  # 1.2 MB: 1 MiB ends inside a '\u20ac'
    assert (1 << 20) % 3 != 0
    code = "import sys; sys.stdout.buffer.write('\\u20ac'.encode() * 400_000 + b'\\xff\\xfe not UTF-8\\n')"
    with serving(cfg_file, ticks=True):
        assert main(["--config", cfg_file, "submit", "--tenant", "A", "--", sys.executable, "-c", code]) == 0
        job = capsysbinary.readouterr().out.decode().strip()

        def finished() -> bool:
            main(["--config", cfg_file, "show", job, "--json"])
            return json.loads(capsysbinary.readouterr().out)["job"]["state"] == "finished"

        assert wait_for(finished, timeout=60, interval=0.1)
        for follow in ([], ["--follow"]):
            rc = main(["--config", cfg_file, "logs", job, *follow])
            out = capsysbinary.readouterr()
            assert (rc, out.err) == (0, b"")
            assert out.out == wrote, (len(out.out), out.out.count("\ufffd".encode()))


def test_control_characters_are_escaped_in_tables(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A command may hold a newline or an escape sequence: `list` keeps one line per job and `show`
    one per field, and the terminal gets no ESC; a name may not hold them at all."""
    rc, out, _ = run(capsys, "--config", cfg, "submit", "--tenant", "A", "--name", "ok", "--", "/bin/echo", "a\nb",
                     "\x1b[31mred\tx")
    assert rc == 0
    rc, out, _ = run(capsys, "--config", cfg, "list")
    assert rc == 0 and len(out.splitlines()) == 2 and "\x1b" not in out and "\t" not in out
    assert out.splitlines()[1].endswith(" echo a\\nb \\x1b[31mred\\tx")  # the program by its name
    rc, out, _ = run(capsys, "--config", cfg, "show", "job-1")
    assert rc == 0 and "command    /bin/echo a\\nb \\x1b[31mred\\tx\n" in out and "\x1b" not in out
    rc, out, err = run(capsys, "--config", cfg, "submit", "--tenant", "A", "--name", "evil\nname\tX", "--", "true")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("scheduler-lite: error: name 'evil\\nname\\tX' is invalid"), err


def test_a_bad_metrics_option_stops_serve_before_it_takes_over_a_job(cfg_file: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Starting takes over the store's jobs (re-adopts, requeues, stops them): a --metrics-port or
    --metrics-address that is refused must be refused before, not after."""
    cfg = cfg_file
    serve = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", cfg, "serve"], cwd=REPO,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (Path(cfg).parent / "state" / "scheduler.sock").exists(), timeout=60)
        rc, out, _ = run(capsys, "--config", cfg, "submit", "--tenant", "A", "--", "sleep", "600")
        job = out.strip()

        def running() -> bool:
            main(["--config", cfg, "show", job, "--json"])
            return json.loads(capsys.readouterr().out)["job"]["pid"] is not None

        assert rc == 0 and wait_for(running, timeout=30, interval=0.1)
    finally:
        serve.send_signal(signal.SIGTERM)  # the job keeps running, for the next start to re-adopt
        _, log = serve.communicate(timeout=30)
    assert serve.returncode == 0, log

    def events() -> list[str]:
        store = SqliteStorage(Path(cfg).parent / "state" / "scheduler.db")
        try:
            return [e.kind for e in store.events(job)]
        finally:
            store.close()

    before = events()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for options in (["--metrics-port", "-1"], ["--metrics-port", "0"], ["--metrics-port", "70000"],
                        ["--metrics-port", str(taken.getsockname()[1])],  # in use
                        ["--metrics-port", "9", "--metrics-address", "192.0.2.1"]):  # not this machine's
            rc, out, err = run(capsys, "--config", cfg, "serve", *options)
            assert rc == 2 and out == "" and err.count("\n") == 1, (options, err)
            assert err.startswith("scheduler-lite: error: --metrics-port "), (options, err)
            assert events() == before, options  # no "adopted" (nor requeued, stopping) event
    finally:
        taken.close()
        with serving(cfg):  # a start that is not refused re-adopts the job (and, ending, stops it)
            adopted = events()[len(before):]
    assert adopted == ["adopted"]


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


def test_event_values_read_as_a_person_writes_them() -> None:
    from scheduler_lite.cli import _value

    assert [_value(0.15000000000000002), _value(0.05), _value(1 << 30), _value("x")] == ["0.15", "0.05", 1 << 30, "x"]


def test_list_shows_the_script_not_the_interpreters_path() -> None:
    from scheduler_lite.cli import _command

    cmd = ["/work/main/.venv/bin/python", "/work/main/examples/colocate_job.py", "--steps", "300"]
    assert _command(cmd, "/work/main") == "python examples/colocate_job.py --steps 300"
    assert _command(["./run.sh", "/data/x"], "/work") == "run.sh /data/x"
    assert _command(["python", "-c", "x" * 80], "/") == "python -c " + "x" * 37 + "..."


def test_status_step_time_says_when_a_job_stopped_stepping() -> None:
    """A job held at share 0 writes no stats: its last step time looked like a healthy job's."""
    from scheduler_lite.cli import _step_time
    from scheduler_lite.status import JobOnGpu

    def on_gpu(**kw: object) -> JobOnGpu:
        base = {"job_id": "job-1", "tenant": "A", "role": Role.OPPORTUNISTIC, "memory_limit_bytes": 1,
                "compute_share": 0.0, "step": 2435, "step_ms_median": 3.3, "last_step_ms": 3.4, "stats_age_s": 0.4}
        return JobOnGpu(**{**base, **kw})  # type: ignore[arg-type]

    assert _step_time(on_gpu()) == "3.3 ms (step 2435)"
    assert _step_time(on_gpu(stats_age_s=20.0)) == "3.3 ms (step 2435), no step for 20 s"
    assert _step_time(on_gpu(last_step_ms=3012.0)) == "3.3 ms (step 2435), last 3012 ms"
    assert _step_time(on_gpu(paused=True, stats_age_s=0.2)) == "paused at step 2435"
    assert _step_time(on_gpu(step_ms_median=None)) == "-"


# -- list: the newest jobs, page by page --------------------------------------------------------------


def add_jobs(cfg: str, n: int, state: str | None = None) -> list[str]:
    """Jobs written into the daemon's store directly (through its own SQLite file): fast, and the
    daemon (which does not tick here) keeps them as they are."""
    store = SqliteStorage(load_config(Path(cfg)).db_path)
    try:
        with store.transaction():
            ids = [store.add_job(JobSpec("A", JobKind.AUTO, 1, ("/bin/true",), "/tmp", 0.0, uid=os.getuid(),
                                         user="me")).id for _ in range(n)]
            for job in ids if state else ():
                store.update_job(job, state=state)
        return ids
    finally:
        store.close()


def rows(out: str) -> list[str]:
    lines = out.splitlines()
    assert lines[0].startswith("ID ")
    return [line.split()[0] for line in lines[1:]]


def test_list_shows_the_newest_jobs_and_says_how_many_are_not_shown(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = add_jobs(cfg, DEFAULT_LIST_LIMIT + 10)
    rc, out, err = run(capsys, "--config", cfg, "list")
    assert rc == 0 and rows(out) == jobs[10:]  # the newest 50, oldest first: the newest last
    assert err == "(10 older jobs not shown: --limit N shows the newest N, --all every one)\n"
    rc, out, err = run(capsys, "--config", cfg, "list", "--limit", "3")
    assert rc == 0 and rows(out) == jobs[-3:] and err.startswith("(57 older jobs not shown: ")
    rc, out, err = run(capsys, "--config", cfg, "list", "--limit", "59")
    assert rc == 0 and rows(out) == jobs[1:] and err.startswith("(1 older job not shown: ")
    for argv in (["--limit", "60"], ["--limit", "0061"], ["--all"]):
        rc, out, err = run(capsys, "--config", cfg, "list", *argv)
        assert (rc, rows(out), err) == (0, jobs, ""), argv
    # --json: the same jobs as one JSON list (stdout stays one document), the note on stderr.
    rc, out, err = run(capsys, "--config", cfg, "list", "--json", "--limit", "4")
    assert rc == 0 and [j["id"] for j in json.loads(out)] == jobs[-4:] and err.startswith("(56 older jobs")
    rc, out, err = run(capsys, "--config", cfg, "list", "--all", "--json")
    assert rc == 0 and [j["id"] for j in json.loads(out)] == jobs and err == ""


def test_list_pages_through_the_daemon_with_its_cursor(cfg: str, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """More than one answer's worth (MAX_LIST_LIMIT): one request per page, each from the previous
    page's cursor; jobs submitted while it pages are not shown and shift nothing."""
    jobs = add_jobs(cfg, 2 * MAX_LIST_LIMIT + 30)
    asked: list[dict[str, Any]] = []
    later: list[str] = []

    def call(config: Any, op: str, **args: Any) -> Any:
        asked.append(args)
        answer = client_call(config, op, **args)
        if len(asked) == 1 and not later:  # between the first page and the second, once
            later.extend(add_jobs(cfg, 5))
        return answer

    monkeypatch.setattr(cli_module, "call", call)
    rc, out, err = run(capsys, "--config", cfg, "list", "--all")
    assert rc == 0 and rows(out) == jobs and err == ""
    assert [(a["limit"], a["cursor"]) for a in asked] == [
        (MAX_LIST_LIMIT, None), (MAX_LIST_LIMIT, jobs[-MAX_LIST_LIMIT]), (MAX_LIST_LIMIT, jobs[-2 * MAX_LIST_LIMIT])]
    asked.clear()
    rc, out, err = run(capsys, "--config", cfg, "list", "--json", "--limit", str(MAX_LIST_LIMIT + 7))
    everything = jobs + later
    assert rc == 0 and [j["id"] for j in json.loads(out)] == everything[-(MAX_LIST_LIMIT + 7):]
    assert [a["limit"] for a in asked] == [MAX_LIST_LIMIT, 7]
    assert err == (f"({len(everything) - MAX_LIST_LIMIT - 7} older jobs not shown: --limit N shows the newest N, "
                   "--all every one)\n")


def test_list_pages_only_the_states_asked_for(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    done = add_jobs(cfg, 5, state="finished")
    add_jobs(cfg, 3)  # queued, newer
    failed = add_jobs(cfg, 1, state="failed")
    rc, out, err = run(capsys, "--config", cfg, "list", "--state", "finished", "--limit", "2")
    assert rc == 0 and rows(out) == done[-2:]
    assert err == "(3 older matching jobs not shown: --limit N shows the newest N, --all every one)\n"
    rc, out, err = run(capsys, "--config", cfg, "list", "--state", "finished", "--state", "failed", "--all")
    assert rc == 0 and rows(out) == done + failed and err == ""


def test_list_from_a_daemon_older_than_pages_says_to_restart_it(cfg_file: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A daemon from before paging refuses `limit` as an unknown argument: the error says why."""
    state = Path(cfg_file).parent / "state"
    state.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(state / "scheduler.sock"))
    listener.listen(1)

    def old_daemon() -> None:
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.recv(1 << 16))
            assert request["args"]["limit"] == DEFAULT_LIST_LIMIT
            conn.sendall(b'{"ok": false, "error": "argument \'limit\' is unknown: accepted states"}\n')

    thread = threading.Thread(target=old_daemon, daemon=True)
    thread.start()
    try:
        rc, out, err = run(capsys, "--config", cfg_file, "list")
    finally:
        thread.join(10)
        listener.close()
    assert rc == 2 and out == ""
    assert err == ("scheduler-lite: error: argument 'limit' is unknown: accepted states (the daemon is older than "
                   "this client and does not page `list`: restart it with this scheduler-lite)\n")


def test_list_help_says_what_it_shows_and_how_to_see_more(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["list", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"list the newest jobs ({DEFAULT_LIST_LIMIT} unless --limit or --all), oldest first" in out
    assert f"--limit N show the newest N jobs (default {DEFAULT_LIST_LIMIT})" in out
    assert "--all show every job" in out and "--json prints the same jobs as one JSON list" in out


def test_show_says_how_many_older_events_it_left_out(cfg: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The daemon answers the newest SHOW_EVENTS events and counts the rest; the CLI printed the
    # count untested (a job writing bad stats.json for days has thousands of events).
    from scheduler_lite.server import SHOW_EVENTS

    _, out, _ = run(capsys, "--config", cfg, "submit", "--tenant", "B", "--", "true")
    job = out.strip()
    store = SqliteStorage(load_config(Path(cfg)).db_path)  # a second connection, as another process would
    try:
        for i in range(SHOW_EVENTS + 7):
            store.add_event(float(i), "stats_error", job, error=f"bad stats {i}")
    finally:
        store.close()
    rc, out, _ = run(capsys, "--config", cfg, "show", job)
    assert rc == 0
    # 8 older ones: "submitted" and the first 7 errors.
    assert f"\nevents (the newest {SHOW_EVENTS}; 8 not shown):\n" in out
    lines = out.split("\nevents")[1].splitlines()
    assert lines[2].endswith("error=bad stats 7") and lines[-1].endswith(f"error=bad stats {SHOW_EVENTS + 6}")
    assert len(lines) == 2 + SHOW_EVENTS  # the heading, the table's header, the events
    other = run(capsys, "--config", cfg, "submit", "--tenant", "B", "--", "true")[1].strip()
    rc, out, _ = run(capsys, "--config", cfg, "show", other)
    assert rc == 0 and "\nevents:\n" in out and "not shown" not in out
