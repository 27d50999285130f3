"""Shared test helpers. TensorFlow tests run each job in a fresh subprocess: tf-antman must be
activated before TensorFlow creates its devices, and TF can be imported once per process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO.parent / "shared" / "traces"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Job:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    @property
    def result(self) -> dict:
        """The last stdout line that is JSON (the snippet prints it with `emit(...)`)."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no JSON result; rc={self.rc}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr[-4000:]}")


PRELUDE = """
import json, sys
def emit(obj):
    print(json.dumps(obj), flush=True)
"""


def run_py(code: str, timeout: float = 300, **env: str) -> Job:
    """Runs a Python snippet in a fresh interpreter (the venv's, with the tf-antman .pth hook)."""
    src = PRELUDE + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", src], env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO))
    return Job(proc)


@pytest.fixture(autouse=True)
def _no_job_cgroups_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that stops its daemon while jobs run (and then kills the jobs' process groups
    itself) leaves their cgroups behind, empty or holding a process that left the group
    (scheduler_lite.containment: a daemon's next start would remove them; none comes). At its
    teardown, the job cgroups of every state directory under its tmp_path are ended and removed,
    through Containment's own functions: only those state directories' subtrees, never another's.
    A state directory the test deleted is found by its path (every directory under tmp_path, and
    its `state`, is matched against the subtrees present). Runs after the test's own fixtures
    have stopped their daemons (autouse: set up first)."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    yield
    if not Path("/sys/fs/cgroup").is_dir():
        return
    from scheduler_lite.containment import subtree_name, subtrees, sweep  # only where it may be needed

    present = subtrees()
    if not present:
        return
    # os.walk: symlinks the security tests plant are not followed.
    for where, _, _ in os.walk(tmp_path):
        for state_dir in (Path(where), Path(where) / "state"):
            if subtree_name(state_dir) in present:
                with contextlib.suppress(OSError):
                    sweep(state_dir)


@pytest.fixture
def traces_dir() -> Path:
    if not TRACES.exists():
        pytest.skip(f"{TRACES} is not present (only in the development checkout)")
    return TRACES
