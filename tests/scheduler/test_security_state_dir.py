"""`paths.state_dir` cannot be redirected by someone who can write a directory above it.

`serve` sets its state directory's mode and fills it, as root: a state directory planted as a
symbolic link (in a team-writable /srv/ml, say) made serve chmod the link's target 0755 and
write the store into it. serve now refuses a link, and any path with a directory above it that
another user owns or that its group or others can write (unless sticky), naming the field, the
offending path and why; and it never follows a link inside the directory either.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lite.config import load_config
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.state_dir import check_state_dir, secure_state_dir
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import REPO, make_config

GUARD_S = 60.0  # how long a serve that should have been refused may run before the test fails


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def config_file(tmp_path: Path, state_dir: Path) -> Path:
    cfg = tmp_path / "sl.toml"
    cfg.write_text(to_toml(scheduler_config(["1GiB"], {"A": 1}, state_dir=str(state_dir))))
    return cfg


def test_serve_refuses_a_state_dir_that_is_a_symbolic_link_and_leaves_its_target_alone(tmp_path: Path) -> None:
    """The reviewer's case, end to end: serve used to make the link's target 0755 and fill it."""
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    os.chmod(target, 0o700)
    (tmp_path / "team").mkdir()
    link = tmp_path / "team" / "state"
    link.symlink_to(target)
    try:  # a serve that is not refused would run until stopped: the timeout fails the test
        done = subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(config_file(tmp_path, link)),
                               "serve"], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve was not refused: it ran for {GUARD_S} s")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"scheduler-lite: error: paths.state_dir='{link}' is invalid: accepted a "
                                  f"directory, not a symbolic link ({link} is one: "), done.stderr
    assert mode(target) == 0o700 and list(target.iterdir()) == []


@pytest.mark.parametrize("team_mode", [0o775, 0o777, 0o757])
def test_a_directory_above_that_others_can_write_is_refused(tmp_path: Path, team_mode: int) -> None:
    """The reviewer's /srv/ml: its group (or anyone) could have planted the link, or replace the
    directory between the check and the use."""
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, team_mode)
    state = team / "scheduler" / "state"
    with pytest.raises(ConfigError) as refused:
        check_state_dir(load_config(config_file(tmp_path, state)))
    assert str(refused.value) == (
        f"paths.state_dir='{state}' is invalid: accepted a path whose every directory is writable only by its owner "
        f"(or sticky, as /tmp): {team} is writable by its group or others (mode {team_mode:04o}), who could replace "
        "what is below it with a symbolic link")


def test_a_sticky_directory_above_is_accepted(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # as /tmp: others cannot replace an entry they do not own
    check_state_dir(make_config(shared / "mine" / "state"))


def test_a_link_above_is_judged_by_where_it_leads(tmp_path: Path) -> None:
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o777)
    safe = tmp_path / "safe"
    safe.mkdir()
    (safe / "srv").symlink_to(team)
    with pytest.raises(ConfigError, match=f"{team} is writable by its group or others .mode 0777."):
        check_state_dir(make_config(safe / "srv" / "state"))
    os.chmod(team, 0o755)
    check_state_dir(make_config(safe / "srv" / "state"))  # a link is fine where both ends are safe
    # A link in a directory others can write: they could point it elsewhere. The config resolves
    # links when it is loaded, so this is seen only in the path as the file writes it.
    os.chmod(team, 0o777)
    (team / "srv").symlink_to(safe)
    with pytest.raises(ConfigError, match=f"{team} is writable by its group or others .mode 0777."):
        check_state_dir(load_config(config_file(tmp_path, team / "srv" / "state")))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chowns a directory to another user")
def test_a_directory_above_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError) as refused:
        check_state_dir(make_config(theirs / "state"))
    assert f"{theirs} is owned by uid 65534, who could replace what is below it" in str(refused.value)
    assert str(refused.value).startswith("paths.state_dir=")


def test_a_group_writable_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o770)
    with pytest.raises(ConfigError, match=r"not a shared one \(mode 0770\)"):
        check_state_dir(make_config(state))


@pytest.mark.parametrize("name", ["jobs", "scheduler.db"])
def test_a_link_planted_inside_the_state_dir_is_not_followed(tmp_path: Path, name: str) -> None:
    """One left there before the directory was the daemon's alone: serve stops instead of
    changing (or opening) what it points to."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.chmod(target, 0o700)
    config = make_config(tmp_path / "state")
    config.state_dir.mkdir(mode=0o700)
    (config.state_dir / name).symlink_to(target)
    with pytest.raises(ConfigError, match=r"paths.state_dir=.* is invalid: accepted .*(symbolic link)"):
        secure_state_dir(config, multi_user=os.geteuid() == 0)
    assert mode(target) == 0o700 and list(target.iterdir()) == []
