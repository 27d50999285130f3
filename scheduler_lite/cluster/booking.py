"""A Ray task's or actor's booking as its node and its worker see it (docs/cluster.md, "Ray users").

The booking's marker command and files, shared by the node host (scheduler_lite.cluster.node_host,
which books, watches and releases it) and the worker that runs under it (`claim`, called by
scheduler_lite.cluster.tasks and .actors in the Ray worker). Imports nothing of Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from scheduler_lite.launcher import PID_FILE
from tf_antman.protocol import atomic_write_text

TASK_COMMAND: Final = "scheduler-lite:ray-task"  # the command of a Ray task's booking: no process to start
RELEASED_FILE: Final = "released"  # in the job dir: the booking is over, a task starting now must not run
TASK_CLAIM_TIMEOUT_S: Final = 300.0  # a booking no task claimed (wrote its pid) within this is released
_KEPT_PREFIXES: Final = ("ANTMAN_", "SCHEDULER_LITE_")


class PlacementError(RuntimeError):
    """The booking was refused, failed, released, or did not come in time; one line."""


def is_ray_task(command: tuple[str, ...] | list[str]) -> bool:
    return len(command) == 1 and command[0] == TASK_COMMAND


def task_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a job environment a Ray task gets: tf-antman's and scheduler_lite's variables
    and the GPU (Ray keeps the rest of the worker's environment)."""
    out = {k: v for k, v in env.items() if k.startswith(_KEPT_PREFIXES)}
    if "CUDA_VISIBLE_DEVICES" in env:
        out["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        out["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # our GPU, not one Ray assigns
        if "CUDA_DEVICE_ORDER" in env:  # the indices are NVML's: CUDA must count as it does
            out["CUDA_DEVICE_ORDER"] = env["CUDA_DEVICE_ORDER"]
    return out


def write_number(path: Path, value: int) -> None:
    """A pid or an exit status, as the launcher's wrapper writes them (one line, replaced whole)."""
    atomic_write_text(path, f"{value}\n", fsync=False)


def claim(job_id: str, what: str = "task", exclusive: bool = False) -> Path:
    """In the Ray worker: make this process the booking's (pid file); its job directory.

    `exclusive`: refuse if a process claimed it already (an actor class made for one booking,
    instantiated twice): the pid file is linked into place, which fails if it exists."""
    job_dir = Path(os.environ.get("ANTMAN_JOB_DIR", ""))
    if os.environ.get("SCHEDULER_LITE_JOB_ID") != job_id or not job_dir.is_dir():
        raise PlacementError(f"{job_id}: this worker does not run under its booking (ANTMAN_JOB_DIR missing)")
    pid_file = job_dir / PID_FILE
    if not exclusive:
        write_number(pid_file, os.getpid())  # first: the node host adopts the process from here on
    else:
        tmp = pid_file.with_name(f".{PID_FILE}.{os.getpid()}")
        tmp.write_text(f"{os.getpid()}\n")
        try:
            os.link(tmp, pid_file)  # atomic, and fails if another process claimed the booking
        except FileExistsError:
            raise PlacementError(f"{job_id}: the booking was claimed already (pid file "
                                 f"{pid_file.read_text().strip()}): one {what} per booking") from None
        finally:
            tmp.unlink()
    if (job_dir / RELEASED_FILE).exists():  # after the pid: a release racing with us sees the pid
        raise PlacementError(f"{job_id}: the booking was released before the {what} started")
    return job_dir
