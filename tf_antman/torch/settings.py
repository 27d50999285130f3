"""ANTMAN_* variables read by the PyTorch front-end: the same variables, names and validation as
for TensorFlow (tf_antman.config), with defaults that fit a real GPU.

Differences from a TensorFlow job (docs/pytorch.md):
- ANTMAN_DEVICE defaults to `cuda`. `emulated` runs the memory core, op manager, step hooks and
  job agent on host RAM without serving PyTorch's tensors (PyTorch has no device to put on it):
  for tests of the wiring only.
- On `cuda`, ANTMAN_DEVICE_MEMORY unset means the device's free memory at start, and
  ANTMAN_MEMORY_LIMIT unset means no limit below that capacity.
- A rank of a multi-process job (LOCAL_RANK set by torchrun, accelerate or deepspeed) uses its
  own GPU and its own agent directory (rank_placement).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from tf_antman import config
from tf_antman.device_select import CudaProbe, probe_cuda, resolve_device
from tf_antman.units import format_bytes


@dataclasses.dataclass(frozen=True)
class TorchSettings:
    base: config.Settings  # what StepTracker and the job agent read (job_dir, device_id, ...)
    device_capacity: int  # bytes for the memory core; 0 = free memory of the CUDA device
    memory_limit: int  # bytes; 0 = the capacity
    local_rank: int | None = None  # LOCAL_RANK of a multi-process job, else None

    def describe(self) -> str:
        b = self.base
        cap = format_bytes(self.device_capacity) if self.device_capacity else "free memory"
        lim = format_bytes(self.memory_limit) if self.memory_limit else "none"
        rank = "" if self.local_rank is None else f"local_rank={self.local_rank} "
        return (f"framework=torch {rank}device={b.device}:{b.device_id} device_memory={cap} "
                f"memory_limit={lim} host_memory={format_bytes(b.host_memory)} "
                f"compute_share={b.compute_share:g} job_dir={b.job_dir or '-'}")


def load(environ: Mapping[str, str], probe: Callable[[], CudaProbe] = probe_cuda) -> TorchSettings:
    """Validates like config.load (ConfigError names the variable and the accepted range), then
    resolves ANTMAN_DEVICE as for TensorFlow (device_select.resolve_device): auto becomes cuda
    when the CUDA driver reports a GPU, else emulated; cuda that cannot be served raises
    DeviceUnavailable naming ANTMAN_DEVICE. The memory defaults follow the resolved device."""
    env = {k: v for k, v in environ.items() if k.startswith(config.PREFIX)}
    requested = config.load({"ANTMAN_DEVICE": env.get("ANTMAN_DEVICE", "cuda")}).device
    # Every value first, as the device asked for would take it (auto: as cuda, the loosest), so
    # that a bad value is a ConfigError on any machine, before the driver is asked anything.
    checked = _settings(env, "cuda" if requested == "auto" else requested)
    if not checked.base.enabled:
        return _settings(env, requested)  # nothing runs: nothing to probe or refuse
    rank, device_id, job_dir = rank_placement(environ, checked.base.device_id, checked.base.job_dir)
    device = resolve_device(requested, environ, probe)
    out = checked if device == checked.base.device else _settings(env, device)
    if rank is None:
        return out
    return dataclasses.replace(out, local_rank=rank,
                               base=dataclasses.replace(out.base, device_id=device_id, job_dir=job_dir))


def rank_placement(environ: Mapping[str, str], device_id: int,
                   job_dir: str | None) -> tuple[int | None, int, str | None]:
    """(local rank, CUDA device, agent directory) of this process. Pure but for creating the
    rank's directory.

    A process with LOCAL_RANK set is one rank of a job of several training processes (torchrun,
    accelerate and deepspeed set it; scheduler_lite gives such a job all its GPUs in
    CUDA_VISIBLE_DEVICES and one ANTMAN_DEVICE_ID=0). Its device: the LOCAL_RANK-th visible one,
    or device 0 when its launcher left it exactly one visible (CUDA_VISIBLE_DEVICES per rank).
    Its agent directory: the job directory for local rank 0, `ranks/<r>/` below it for rank r
    (created if missing), so that every rank reports and takes controls for its own GPU
    (docs/protocol.md). Without LOCAL_RANK: ANTMAN_DEVICE_ID and the job directory unchanged."""
    raw = environ.get("LOCAL_RANK")
    if raw is None or raw == "":
        return None, device_id, job_dir
    accepted = f"an integer in 0..{config.MAX_DEVICE_INDEX} (a launcher's local rank)"
    try:
        rank = int(raw)
    except ValueError:
        raise config.ConfigError("LOCAL_RANK", raw, accepted) from None
    if not 0 <= rank <= config.MAX_DEVICE_INDEX:
        raise config.ConfigError("LOCAL_RANK", raw, accepted)
    visible_raw = environ.get("CUDA_VISIBLE_DEVICES")
    visible = None if visible_raw is None else [v for v in visible_raw.split(",") if v.strip()]
    if visible is not None and len(visible) == 1:
        device = 0
    elif visible is None or rank < len(visible):
        device = rank
    else:
        raise config.ConfigError("LOCAL_RANK", raw, f"a rank below the {len(visible)} devices "
                                 f"CUDA_VISIBLE_DEVICES={visible_raw!r} makes visible (one GPU a rank)")
    if job_dir is None or rank == 0:
        return rank, device, job_dir
    from tf_antman.protocol.layout import rank_dir

    path = rank_dir(Path(job_dir), rank)
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise config.ConfigError("ANTMAN_JOB_DIR", job_dir, f"a directory where rank {rank} can "
                                 f"create {path} ({err.strerror})") from None
    return rank, device, os.fspath(path)


def _settings(antman_env: Mapping[str, str], device: str) -> TorchSettings:
    env = {**antman_env, "ANTMAN_DEVICE": device}
    capacity_set = "ANTMAN_DEVICE_MEMORY" in env
    limit_set = "ANTMAN_MEMORY_LIMIT" in env
    # On cuda with ANTMAN_DEVICE_MEMORY unset, config.load does not hold the limit to the emulated
    # default: the capacity is the GPU's free memory, known once the driver reports it.
    base = config.load(env)
    if device == "cuda":
        capacity = base.device_memory if capacity_set else 0
        limit = base.memory_limit if limit_set else 0
    else:
        capacity, limit = base.device_memory, base.memory_limit
    return TorchSettings(base=base, device_capacity=capacity, memory_limit=limit)
