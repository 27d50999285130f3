"""The README's main command, examples/cli_demo.sh, as its user runs it: both jobs finish, the
guarantee job's arrival really cuts the opportunistic job's share, and the daemon it started in
the background is gone when it returns (it once stayed behind, serving an empty store for ever)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from tests.scheduler.test_daemon_fakes import REPO


def _processes_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def test_cli_demo_runs_both_jobs_to_the_end_and_stops_its_daemon(tmp_path: Path) -> None:
    demo = (REPO / "examples/demo.toml").read_text()
    config = tmp_path / "demo.toml"
    config.write_text(demo.replace('state_dir = "../out/demo-state"', f'state_dir = "{tmp_path}/demo-state"'))
    assert str(tmp_path) in config.read_text()
    env = dict(os.environ, DEMO_CONFIG=str(config), DEMO_OUT=str(tmp_path),
               SCHEDULER_LITE=str(REPO / ".venv/bin/scheduler-lite"))
    run = subprocess.run(["bash", str(REPO / "examples/cli_demo.sh")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    try:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        out = run.stdout
        # `list` at the end: both jobs finished.
        assert len(re.findall(r"^job-\d+ .* finished ", out, flags=re.M)) == 2, out[-3000:]
        # While both ran, the opportunistic job's share was cut below 1 (the status tables). Its LIMIT
        # cell may show a decided change not applied yet ("128.0 MiB -> 1.9 GiB") when `status` runs.
        assert re.search(r"job-1\s+opportunistic\s+\S+ \S+(?: -> \S+ \S+)?\s+\S+ \S+\s+\S+ \S+\s+0\.\d\d ", out), \
            out[-3000:]
        # What tf-antman did, one line per job, each named (the guarantee job's says it was not slowed).
        assert re.search(r"^job-2 \(guarantee\): \S", out, flags=re.M), out[-3000:]
        assert re.search(r"^job-1 \(opportunistic\): WARNING:absl:tf-antman: at exit: ", out, flags=re.M), out[-3000:]
        assert "stopped;" in (tmp_path / "demo-daemon.log").read_text()
        for _ in range(50):  # the daemon has exited by the time the script returns; allow a reap
            if not _processes_naming(str(config)):
                break
            time.sleep(0.1)
        assert _processes_naming(str(config)) == []
    finally:
        for pid in _processes_naming(str(config)):
            os.kill(pid, 9)
