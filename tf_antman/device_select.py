"""Which backend a job runs on (ANTMAN_DEVICE=auto|emulated|cuda), and why cuda is refused.

`auto` becomes `cuda` when the CUDA driver loads and reports at least one GPU, else `emulated`.
`cuda` is refused, with one line saying why, when it cannot be served. The probe asks the driver
itself (libcuda.so.1: cuInit, cuDeviceGetCount), so CUDA_VISIBLE_DEVICES is respected; it runs only
for `auto` and `cuda`, never for `emulated`, and in a child process: a cuInit in the job's own
process before TensorFlow (or PyTorch) initialises CUDA would leave a CUDA-initialised parent, and
the children of a later fork (multiprocessing pools, tf.data service workers) could not use CUDA.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

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


PROBE_TIMEOUT_S = 120.0  # cuInit on a machine with many GPUs takes seconds, not minutes


def driver_answers(load: Callable[[str], Any]) -> dict[str, Any]:
    """What the driver says, raw. Runs in the probe's child process (its source is sent there:
    only `ctypes` and the argument may be used here)."""
    import ctypes

    try:
        lib = load("libcuda.so.1")
    except OSError as e:
        return {"load_error": str(e)}
    rc = lib.cuInit(0)
    if rc != 0:
        return {"init_rc": rc}
    count = ctypes.c_int(0)
    return {"init_rc": 0, "count_rc": lib.cuDeviceGetCount(ctypes.byref(count)), "count": count.value}


def judge(answers: Mapping[str, Any]) -> CudaProbe:
    """The probe's verdict on the driver's raw answers."""
    if "load_error" in answers:
        return CudaProbe(0, f"no CUDA driver (libcuda.so.1 cannot be loaded: {answers['load_error']})")
    rc = answers["init_rc"]
    if rc == CUDA_ERROR_NO_DEVICE:  # a driver, but no GPU visible to this process
        return CudaProbe(0, "")
    if rc != 0:
        return CudaProbe(0, f"the CUDA driver failed to initialise (cuInit returned {rc})")
    if answers["count_rc"] != 0:
        return CudaProbe(0, f"the CUDA driver cannot count GPUs (cuDeviceGetCount returned {answers['count_rc']})")
    return CudaProbe(int(answers["count"]), "")


def probe_in_process(load: Callable[[str], Any] = ctypes.CDLL) -> CudaProbe:
    """Asks the CUDA driver in this process (tests with fake drivers; the child runs the same)."""
    return judge(driver_answers(load))


def _child_source() -> str:
    return ("from __future__ import annotations\nimport ctypes, json, sys\n" + inspect.getsource(driver_answers)
            + "sys.stdout.write(json.dumps(driver_answers(ctypes.CDLL)))\n")


def probe_cuda(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> CudaProbe:
    """Asks the CUDA driver how many GPUs this process may use, from a child process with this
    process's environment (CUDA_VISIBLE_DEVICES included), so that this one never calls cuInit.
    The child is `python -S`: no site-packages .pth, so tf-antman's own import hook cannot
    activate there."""
    try:
        done = run([sys.executable, "-S", "-c", _child_source()], capture_output=True, text=True,
                   timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return CudaProbe(0, f"the CUDA probe process could not run ({type(e).__name__}: {e})")
    try:
        answers = json.loads(done.stdout)
    except ValueError:
        tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return CudaProbe(0, f"the CUDA probe process failed ({tail[0]})")
    return judge(answers)


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
