"""Which backend a job runs on (ANTMAN_DEVICE=auto|emulated|cuda), and why cuda is refused.

`auto` becomes `cuda` when the CUDA driver loads and reports at least one GPU, else `emulated`.
`cuda` is refused, with one line saying why, when it cannot be served. The probe asks the driver
itself (libcuda.so.1: cuInit, cuDeviceGetCount), so CUDA_VISIBLE_DEVICES is respected; it runs only
for `auto` and `cuda`, never for `emulated`.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Mapping

from tf_antman import config
from tf_antman.config import Settings

# TF_GPU_ALLOCATOR values whose allocator reserves GPU memory when TF creates a device, outside
# the job's limit (TF's default BFC allocator reserves nothing until it is used; ours is used).
RESERVING_TF_ALLOCATORS = ("cuda_malloc_async",)
CUDA_ERROR_NO_DEVICE = 100  # cuInit's answer when no GPU is visible (e.g. CUDA_VISIBLE_DEVICES="")


class DeviceUnavailable(RuntimeError):
    """ANTMAN_DEVICE=cuda cannot be served here; the message is one line."""


@dataclasses.dataclass(frozen=True)
class CudaProbe:
    gpus: int  # GPUs the driver reports (0 when it is missing or fails)
    problem: str  # "" when the driver works; else why not, one line


def probe_cuda(load: Callable[[str], ctypes.CDLL] = ctypes.CDLL) -> CudaProbe:
    """Asks the CUDA driver how many GPUs this process may use."""
    try:
        lib = load("libcuda.so.1")
    except OSError as e:
        return CudaProbe(0, f"no CUDA driver (libcuda.so.1 cannot be loaded: {e})")
    rc = lib.cuInit(0)
    if rc == CUDA_ERROR_NO_DEVICE:  # a driver, but no GPU visible to this process
        return CudaProbe(0, "")
    if rc != 0:
        return CudaProbe(0, f"the CUDA driver failed to initialise (cuInit returned {rc})")
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return CudaProbe(0, f"the CUDA driver cannot count GPUs (cuDeviceGetCount returned {rc})")
    return CudaProbe(count.value, "")


def resolve_device(requested: str, environ: Mapping[str, str],
                   probe: Callable[[], CudaProbe] = probe_cuda) -> str:
    """"emulated" or "cuda" for ANTMAN_DEVICE=`requested` (auto, emulated or cuda), for either
    framework. Raises DeviceUnavailable, naming ANTMAN_DEVICE, when cuda cannot be served."""
    if requested == "emulated":
        return requested
    found = probe()
    if requested == "auto":
        return "cuda" if found.gpus > 0 and not found.problem else "emulated"
    if found.problem:
        raise DeviceUnavailable(f"ANTMAN_DEVICE=cuda refused: {found.problem}; "
                                "use ANTMAN_DEVICE=emulated or auto")
    if found.gpus == 0:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        where = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        raise DeviceUnavailable(f"ANTMAN_DEVICE=cuda refused: the CUDA driver reports no GPU"
                                f"{where}; use ANTMAN_DEVICE=emulated or auto")
    return "cuda"


def resolve(settings: Settings, environ: Mapping[str, str],
            probe: Callable[[], CudaProbe] = probe_cuda) -> Settings:
    """TensorFlow's settings with `device` resolved to "emulated" or "cuda". Raises DeviceUnavailable."""
    device = resolve_device(settings.device, environ, probe)
    if device == "emulated":  # config.load left this to us for auto (it might have been cuda)
        config.check_limit(settings.memory_limit, settings.device_memory, environ)
    if device == "cuda":
        tf_alloc = environ.get("TF_GPU_ALLOCATOR", "")
        if tf_alloc in RESERVING_TF_ALLOCATORS:
            raise DeviceUnavailable(f"ANTMAN_DEVICE=cuda refused: TF_GPU_ALLOCATOR={tf_alloc} would "
                                    "reserve GPU memory outside tf-antman's limit; unset it")
    return dataclasses.replace(settings, device=device)


def native_memory(settings: Settings, environ: Mapping[str, str]) -> tuple[int, int]:
    """(device capacity, initial limit) in bytes for the native runtime.

    Emulated: the configured budget and limit. CUDA: per GPU, ANTMAN_DEVICE_MEMORY caps what the
    job may use of each GPU and ANTMAN_MEMORY_LIMIT is its initial limit; unset, 0 tells the core
    to use the GPU's free memory when TF creates the device (the 4GiB default is the emulated
    device's budget, not a GPU size)."""
    if settings.device != "cuda":
        return settings.device_memory, settings.memory_limit
    capacity = settings.device_memory if "ANTMAN_DEVICE_MEMORY" in environ else 0
    limit = settings.memory_limit if "ANTMAN_MEMORY_LIMIT" in environ else 0
    return capacity, limit
