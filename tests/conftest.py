"""Shared test helpers. TensorFlow tests run each job in a fresh subprocess: tf-antman must be
activated before TensorFlow creates its devices, and TF can be imported once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
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


@pytest.fixture
def traces_dir() -> Path:
    if not TRACES.exists():
        pytest.skip(f"{TRACES} is not present (only in the development checkout)")
    return TRACES
