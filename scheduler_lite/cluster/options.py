"""Ray options for a Ray task or actor that runs under tf-antman with its GPU fraction enforced.

Ray's fractional GPUs (`num_gpus=0.5`) are bookkeeping only: two tasks on one GPU share its memory
and its compute with no limit (ray-project/ray#13680, #41432). `ray_options` turns the fraction
into what tf-antman enforces inside the worker process:

    opts = ray_options(0.5, memory="6GiB", kind="opportunistic", job_dir="/tmp/jobs/trainer-3")
    Trainer.options(**opts).remote()

The variables (memory limit, compute share: the fraction for an opportunistic task, 1.0 for a
guarantee one, job directory, device) are listed in docs/cluster.md, "Ray users".

Ray starts a dedicated worker process for a runtime environment, with these variables set before
Python starts, so tf-antman's import hook activates when the task imports TensorFlow. The result
is a plain dict: nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from scheduler_lite.policy.validation import check_choice
from tf_antman.units import parse_bytes

KINDS: Final = ("opportunistic", "guarantee")
DEVICES: Final = ("cuda", "emulated")
MIN_LIMIT: Final = 1 << 20  # ANTMAN_MEMORY_LIMIT's lower bound


def parse_size(name: str, value: int | str | None) -> int | None:
    """`value` in bytes (an integer, or a size such as "4GiB"); None stays None; ValueError names `name`."""
    if value is None:
        return None
    accepted = "bytes (an integer) or a size such as \"4GiB\""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: accepted {accepted}")
    try:
        return parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is invalid: accepted {accepted}") from None


def ray_options(
    num_gpus: float,
    *,
    memory: int | str | None = None,
    kind: str = "opportunistic",
    device: str = "cuda",
    device_memory: int | str | None = None,
    job_dir: str | Path | None = None,
    host_memory: int | str | None = None,
    runtime_env: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Options for `.options(**...)` of a Ray task or actor; ValueError names a bad argument."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int | float) or not 0.0 < num_gpus <= 1.0:
        raise ValueError(f"num_gpus={num_gpus!r} is invalid: accepted a fraction of one GPU in (0, 1]")
    check_choice("kind", kind, KINDS)  # a ConfigError is a ValueError
    check_choice("device", device, DEVICES)
    limit = parse_size("memory", memory)
    size = parse_size("device_memory", device_memory)
    host = parse_size("host_memory", host_memory)
    if device == "emulated" and size is None:
        raise ValueError("device_memory=None is invalid: accepted a size (the emulated GPU's memory) "
                         "when device=\"emulated\"")
    if limit is None:
        if size is None:
            raise ValueError("memory=None is invalid: accepted a size, or give device_memory so that "
                             "the limit is num_gpus x device_memory")
        limit = int(size * num_gpus)
    high = size if size is not None else 1 << 50
    if not MIN_LIMIT <= limit <= high:
        raise ValueError(f"memory={limit!r} is invalid: accepted [{MIN_LIMIT}, {high}] bytes")
    env = {
        "ANTMAN_ENABLE": "1",
        "ANTMAN_DEVICE": device,
        "ANTMAN_MEMORY_LIMIT": str(limit),
        "ANTMAN_COMPUTE_SHARE": repr(float(num_gpus) if kind == "opportunistic" else 1.0),
    }
    if size is not None:
        env["ANTMAN_DEVICE_MEMORY"] = str(size)
    if host is not None:
        env["ANTMAN_HOST_MEMORY"] = str(host)
    if job_dir is not None:
        env["ANTMAN_JOB_DIR"] = str(job_dir)
    if kind == "opportunistic" and device == "emulated":  # as the daemon's opportunistic jobs (tf_antman/priority.py)
        env["ANTMAN_DEVICE_PRIORITY"] = "low"
    merged = dict(runtime_env or {})
    merged["env_vars"] = {**dict(merged.get("env_vars") or {}), **env}
    options: dict[str, Any] = {"runtime_env": merged}
    if device == "cuda":
        options["num_gpus"] = num_gpus
    return options


__all__ = ["ray_options"]
