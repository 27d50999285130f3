"""Where the protocol's files live: one job directory per job, named by an environment variable."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from tf_antman.protocol.errors import ProtocolError

JOB_DIR_ENV: Final = "ANTMAN_JOB_DIR"
CONTROL_FILE: Final = "control.json"  # written by the coordinator, read by the job
STATS_FILE: Final = "stats.json"  # written by the job, read by the coordinator
# Writers put their temporary files here, not next to the targets: a rename from a sibling file
# makes inotify report IN_MOVED_FROM, which watchdog holds back for up to 0.5 s to pair it with its
# IN_MOVED_TO, stalling every event behind it. A rename from an unwatched subdirectory is a lone
# IN_MOVED_TO, delivered at once.
TMP_DIR: Final = ".tmp"
# Locked (flock, exclusive) by the process whose job agent serves the directory, for its life: a
# child process that inherits ANTMAN_JOB_DIR finds it taken and runs without an agent (lock.py).
AGENT_LOCK_FILE: Final = "agent.lock"


# A job of several training processes (torchrun, accelerate, deepspeed: one per GPU) has one
# agent per rank: local rank 0 in the job directory itself, rank r > 0 in RANKS_DIR/<r>/ below it,
# each with the same files (docs/protocol.md, "Several training processes").
RANKS_DIR: Final = "ranks"


def rank_dir(job_dir: Path, local_rank: int) -> Path:
    """The directory of the agent of local rank `local_rank` (0: the job directory)."""
    return job_dir if local_rank == 0 else job_dir / RANKS_DIR / str(local_rank)


def control_path(job_dir: Path) -> Path:
    return job_dir / CONTROL_FILE


def stats_path(job_dir: Path) -> Path:
    return job_dir / STATS_FILE


def agent_lock_path(job_dir: Path) -> Path:
    return job_dir / AGENT_LOCK_FILE


def temp_dir(job_dir: Path) -> Path:
    """The directory for temporary files of atomic writes into `job_dir` (created if missing)."""
    path = job_dir / TMP_DIR
    path.mkdir(mode=0o755, exist_ok=True)
    return path


def job_dir_from_env(environ: Mapping[str, str] = os.environ) -> Path:
    """The job directory named by ANTMAN_JOB_DIR; it must be an existing directory."""
    value = environ.get(JOB_DIR_ENV)
    if not value:
        raise ProtocolError(JOB_DIR_ENV, "is not set; it must name the job directory")
    return checked_job_dir(Path(value), JOB_DIR_ENV)


def checked_job_dir(job_dir: Path, field: str = "job_dir") -> Path:
    if not job_dir.is_dir():
        raise ProtocolError(field, f"{str(job_dir)!r} must be an existing directory")
    return job_dir
