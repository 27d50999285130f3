"""What `--config` and `serve` read: only regular files of bounded size (a FIFO hung serve and
every client; /dev/zero ended in a MemoryError traceback), a `daemon.lock` link refused in one
line, and a tenant naming an account that does not exist refused with the field named. Each
through the real CLI in a process of its own, each refusal one line on stderr."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lite.config import MAX_CONFIG_BYTES
from tests.scheduler.test_cli_commands import CONFIG, cli_config
from tests.scheduler.test_daemon_fakes import REPO

NO_SUCH_USER = "sl-no-such-user-3041"


def limited_memory() -> None:
    # Whatever the code does with /dev/zero, it meets a 2 GiB wall, not the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scheduler_lite", *argv], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=False,
                          preexec_fn=limited_memory)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "status"])
def test_a_fifo_config_is_refused_at_once(tmp_path: Path, command: str) -> None:
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    line = one_line(cli("--config", str(fifo), command, cwd=tmp_path))  # no writer: reading it would block
    assert line == (f"scheduler-lite: error: {fifo}='<file>' is invalid: accepted a regular file of at most "
                    f"{MAX_CONFIG_BYTES} bytes (this is a FIFO)")


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"), (".", "a directory")])
def test_a_device_or_directory_config_is_one_line(tmp_path: Path, path: str, kind: str) -> None:
    line = one_line(cli("--config", path, "list", cwd=tmp_path))
    assert line.endswith(f"accepted a regular file of at most {MAX_CONFIG_BYTES} bytes (this is {kind})")


def test_a_config_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "config.toml"
    big.write_text(CONFIG + "#" * MAX_CONFIG_BYTES)
    line = one_line(cli("--config", str(big), "serve", cwd=tmp_path))
    assert line.endswith(f"accepted a regular file of at most {MAX_CONFIG_BYTES} bytes (this one is "
                         f"{big.stat().st_size} bytes or more)")
    # A link to a regular file of a good size is read as that file.
    good = tmp_path / "good.toml"
    good.write_text(CONFIG)
    link = tmp_path / "link.toml"
    link.symlink_to(good)
    result = cli("--config", str(link), "list", cwd=tmp_path)
    assert result.returncode == 2 and "no scheduler-lite daemon is serving" in result.stderr


def test_a_daemon_lock_link_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "sl.toml"
    config.write_text(CONFIG)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("keep me")
    (state / "daemon.lock").symlink_to(target)
    line = one_line(cli("--config", str(config), "serve", cwd=tmp_path))
    assert line == (f"scheduler-lite: error: paths.state_dir='{state}' is invalid: accepted a directory of the "
                    f"scheduler's own: {state / 'daemon.lock'} is not a regular file (a symbolic link?), and serve "
                    "truncates and writes it; remove it")
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(("table", "field", "what"), [
    ({"users": {"B": [NO_SUCH_USER]}}, "tenants[1].users", "user"),
    ({"access": {"admins": [NO_SUCH_USER]}}, "access.admins", "user"),
])
def test_serve_refuses_an_account_that_does_not_exist(tmp_path: Path, table: dict, field: str, what: str) -> None:
    config = tmp_path / "sl.toml"
    text = cli_config(users=table.get("users"))
    if "access" in table:
        text += f'\n[access]\nadmins = ["{NO_SUCH_USER}"]\n'
    config.write_text(text)
    line = one_line(cli("--config", str(config), "serve", cwd=tmp_path))
    assert line == (f"scheduler-lite: error: {field}='{NO_SUCH_USER}' is invalid: accepted names of {what}s that "
                    f"exist on this machine (no {what} '{NO_SUCH_USER}': `getent passwd {NO_SUCH_USER}` finds none)")
    assert not (tmp_path / "state" / "scheduler.db").exists()  # refused before the store is opened


def test_a_group_that_does_not_exist_is_named(tmp_path: Path) -> None:
    config = tmp_path / "sl.toml"
    config.write_text(CONFIG.replace('gpu_quota = 0', f'gpu_quota = 0\ngroups = ["{NO_SUCH_USER}"]', 1))
    line = one_line(cli("--config", str(config), "serve", cwd=tmp_path))
    assert line.startswith(f"scheduler-lite: error: tenants[1].groups='{NO_SUCH_USER}' is invalid: accepted names "
                           "of groups that exist on this machine")
