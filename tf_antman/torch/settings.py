"""ANTMAN_* variables read by the PyTorch front-end: the same variables, names and validation as
for TensorFlow (tf_antman.config), with defaults that fit a real GPU.

Differences from a TensorFlow job (docs/pytorch.md):
- ANTMAN_DEVICE defaults to `cuda`. `emulated` runs the memory core, op manager, step hooks and
  job agent on host RAM without serving PyTorch's tensors (PyTorch has no device to put on it):
  for tests of the wiring only.
- On `cuda`, ANTMAN_DEVICE_MEMORY unset means the device's free memory at start, and
  ANTMAN_MEMORY_LIMIT unset means no limit below that capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from tf_antman import config
from tf_antman.device_select import CudaProbe, probe_cuda, resolve_device
from tf_antman.units import format_bytes


@dataclasses.dataclass(frozen=True)
class TorchSettings:
    base: config.Settings  # what StepTracker and the job agent read (job_dir, device_id, ...)
    device_capacity: int  # bytes for the memory core; 0 = free memory of the CUDA device
    memory_limit: int  # bytes; 0 = the capacity

    def describe(self) -> str:
        b = self.base
        cap = format_bytes(self.device_capacity) if self.device_capacity else "free memory"
        lim = format_bytes(self.memory_limit) if self.memory_limit else "none"
        return (f"framework=torch device={b.device}:{b.device_id} device_memory={cap} "
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
    device = resolve_device(requested, environ, probe)
    return checked if device == checked.base.device else _settings(env, device)


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
