"""The environment a job starts with (docs/scheduler.md, "Job environment")."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

from scheduler_lite.config import Config
from scheduler_lite.model import Gpu, JobKind
from scheduler_lite.storage import JobRecord
from scheduler_lite.submission import RESERVED_ENV
from tf_antman.protocol import Control, MemoryLimit

MIN_ENV_LIMIT: Final = 1 << 20  # ANTMAN_MEMORY_LIMIT's lower bound (1 MiB)
CUDA_DEVICE_ORDER: Final = "PCI_BUS_ID"  # NVML's order: what CUDA_VISIBLE_DEVICES' indices mean


def job_environment(
    config: Config,
    record: JobRecord,
    gpus: Sequence[Gpu],
    memory_limit_bytes: int,
    compute_share: float,
    job_dir: Path,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of a job placed on `gpus` with the driver's launch settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("ANTMAN_") and k not in RESERVED_ENV and not k.startswith("SCHEDULER_LITE_")}
    env.update(dict(record.env))
    first = gpus[0]
    env.update({
        "ANTMAN_JOB_DIR": str(job_dir),
        "ANTMAN_COMPUTE_SHARE": repr(float(compute_share)),
        "ANTMAN_DEVICE_MEMORY": str(first.memory_bytes),
        "ANTMAN_MEMORY_LIMIT": str(max(MIN_ENV_LIMIT, min(memory_limit_bytes, first.memory_bytes))),
        "SCHEDULER_LITE_JOB_ID": record.id,
        "SCHEDULER_LITE_GPUS": ",".join(str(g.id) for g in gpus),
    })
    env.setdefault("ANTMAN_HOST_MEMORY", str(config.jobs.host_memory_bytes))
    # The job's devices are numbered within the job, from 0, as the protocol numbers them in
    # control.json and stats.json: tf-antman reports and accepts limits for ANTMAN_DEVICE_ID, so
    # a job on emulated GPU 1 told it was device 1 refused every control the daemon sent it.
    env["ANTMAN_DEVICE_ID"] = "0"
    if config.devices.kind == "nvml":
        # The job sees only its GPUs, renumbered from 0. (Not tested here: no GPU on this machine.)
        env["ANTMAN_DEVICE"] = "cuda"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.id) for g in gpus)
        # Those are NVML indices, which follow the PCI bus; CUDA numbers devices fastest first
        # unless told otherwise, so on a host with mixed GPU models index 0 could be another GPU
        # than the one the scheduler placed and accounts the job on. Ours wins over a value from
        # the submission's --env or the daemon's environment: the indices are ours.
        env["CUDA_DEVICE_ORDER"] = CUDA_DEVICE_ORDER
    else:
        env["ANTMAN_DEVICE"] = "emulated"
        # The paper's opportunistic jobs run at a low priority; on an emulated device that is the
        # CPU's idle class (tf_antman/priority.py). Only for jobs that are never upgraded: an
        # unprivileged process cannot leave that class, and an upgraded `auto` job must not stay
        # in it.
        if record.kind is JobKind.OPPORTUNISTIC and config.jobs.opportunistic_priority == "low":
            env["ANTMAN_DEVICE_PRIORITY"] = "low"
    return env


def process_control(control: Control) -> Control:
    """The control as one process of the job takes it: one memory limit, for device 0.

    tf-antman manages one device per process, ANTMAN_DEVICE_ID (0 above), which stands for every
    GPU the process was placed on, and refuses a whole control that names another device. So the
    limits of a process's GPUs become one, the tightest, as ANTMAN_MEMORY_LIMIT is at launch (each
    replica of a data-parallel job holds about as much on every GPU); the share is already one.
    Before this, a job on two GPUs refused every control the coordinator sent it: its guarantee
    co-runner was never protected.
    """
    if not control.memory_limits or [m.device for m in control.memory_limits] == [0]:
        return control
    return replace(control, memory_limits=(MemoryLimit(0, min(m.limit_bytes for m in control.memory_limits)),))
