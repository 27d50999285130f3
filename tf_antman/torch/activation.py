"""Turning tf-antman on in a PyTorch process: validate the ANTMAN_* settings, create the memory
core and put it under PyTorch's CUDA tensors (CUDAPluggableAllocator) before the first CUDA
allocation, build and install the op hook, then the optimizer step hook and the job agent."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from tf_antman import activation as tf_activation
from tf_antman import core as antman_core
from tf_antman import priority
from tf_antman._log import log
from tf_antman.config import Settings
from tf_antman.steps import StepTracker
from tf_antman.torch import _shim, steps_hook
from tf_antman.torch import settings as torch_settings
from tf_antman.torch.compute import Compute
from tf_antman.torch.runtime import TorchRuntime


@dataclasses.dataclass
class Active:
    """Same shape as tf_antman.activation.Active (settings, native, steps): the public
    tf_antman API serves either framework."""

    settings: Settings
    native: TorchRuntime
    steps: StepTracker
    torch_settings: torch_settings.TorchSettings
    step_hook: Any = None


_active: Active | None = None


def active() -> Active | None:
    return _active


def _cuda_initialized(torch: ModuleType) -> bool:
    return bool(torch.cuda.is_initialized())


def activate(environ: Mapping[str, str] | None = None, torch: ModuleType | None = None,
             compute_factory: Any = None) -> Active | None:
    """Starts the runtime for PyTorch. Returns None if not enabled. Raises config.ConfigError for
    a bad value and RuntimeError when it is too late (CUDA already initialised) or when a share
    below 1 is asked for and compute scaling cannot be set up."""
    global _active
    env = os.environ if environ is None else environ
    ts = torch_settings.load(env)
    if _active is not None:
        if ts != _active.torch_settings:
            raise RuntimeError("tf-antman is already active with other settings: "
                               + _active.torch_settings.describe())
        return _active
    if not ts.base.enabled:
        return None
    if tf_activation.active() is not None:
        raise RuntimeError("tf-antman already serves TensorFlow in this process: one framework "
                           "per process")
    if torch is None:
        import torch as torch_module

        torch = torch_module
    on_cuda = ts.base.device == "cuda"
    if on_cuda and _cuda_initialized(torch):
        raise RuntimeError("tf-antman must be enabled before PyTorch initialises CUDA: call "
                           "tf_antman.torch.enable() before the first CUDA tensor, or set ANTMAN_* "
                           "variables before starting Python")
    b = ts.base
    priority.apply(b)  # every thread that exists now, and the ones they start (priority.py)
    path = _shim.shim_path()
    lib = _shim.load(path)
    memory = _shim.create(lib, path, b.device, b.device_id, ts.device_capacity, ts.memory_limit,
                          b.host_memory)
    if on_cuda:
        install_allocator(torch, lib, path, memory)
    compute, why = _make_compute(ts, on_cuda, compute_factory)
    if compute is None and b.compute_share < 1.0:
        raise RuntimeError(f"ANTMAN_COMPUTE_SHARE={b.compute_share:g} needs compute scaling, "
                           f"which is unavailable: {why}")
    runtime = TorchRuntime(memory, compute, why)
    steps = StepTracker(runtime, b)  # type: ignore[arg-type]  # duck-typed Native
    state = Active(settings=b, native=runtime, steps=steps, torch_settings=ts)
    _active = state
    log.info("active for PyTorch (pid %d): %s%s", os.getpid(), ts.describe(),
             "" if compute is not None else f" (no compute scaling: {why})")
    state.step_hook = steps_hook.install(steps)  # imports torch.optim.optimizer (not an attribute until imported)
    from tf_antman import exit_report, jobside

    steps.start_agent(jobside.start_agent)

    exit_report.register(runtime)  # the job's log says what tf-antman did (runtime.holds: every hold)
    return state


def install_allocator(torch: ModuleType, lib: Any, path: Any, memory: _shim.TorchMemory,
                      build: Any = None) -> bool:
    """Puts tf-antman's memory under PyTorch's CUDA tensors: the allocator extension
    (cuda_allocator.cpp: record_stream, statistics, empty_cache, CUDA graphs refused), else,
    when it cannot be built, PyTorch's plain CUDAPluggableAllocator over the same library, with a
    warning that says what is lost. Returns whether the extension serves."""
    from tf_antman.torch import compute

    try:
        ext = (build or compute.build_allocator)()
        ext.install(*[_shim.function_address(lib, n) for n in _shim.ALLOCATOR_FNS])
    except Exception as err:  # noqa: BLE001 - the job still runs, with the loss reported
        log.warning("tf-antman's CUDA allocator extension is unavailable (%s: %s): PyTorch's "
                    "CUDAPluggableAllocator serves the same memory cores instead. Blocks are still "
                    "reused in stream order, but Tensor.record_stream is ignored (a tensor used on "
                    "another stream must stay alive until that stream is done), "
                    "torch.cuda.memory_stats() and the calls built on it raise, and CUDA graph "
                    "capture is not refused", type(err).__name__, err)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(str(path), _shim.MALLOC_FN, _shim.FREE_FN)
        torch.cuda.memory.change_current_allocator(allocator)
        return False
    patch_mem_get_info(torch, memory)
    return True


def patch_mem_get_info(torch: ModuleType, memory: _shim.TorchMemory) -> None:
    """torch.cuda.mem_get_info() of the managed device reports the job's limit and use
    (_shim.mem_get_info); other devices keep the driver's answer."""
    original = torch.cuda.memory.mem_get_info

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        from torch.cuda._utils import _get_device_index

        if _get_device_index(device, optional=True) != memory.device:
            return original(device)
        return _shim.mem_get_info(memory.mem_stats())

    mem_get_info.__doc__ = original.__doc__
    torch.cuda.memory.mem_get_info = mem_get_info
    torch.cuda.mem_get_info = mem_get_info


def _make_compute(ts: torch_settings.TorchSettings, on_cuda: bool,
                  factory: Any) -> tuple[Compute | None, str]:
    try:
        if factory is not None:
            return factory(ts), ""
        core = antman_core.load()
        return Compute(core, ts.base.compute_share, ts.base.device_id, on_cuda), ""
    except Exception as err:  # noqa: BLE001 - reported; the job runs at share 1 if it asked for 1
        return None, f"{type(err).__name__}: {err}"


def after_torch(torch: ModuleType) -> None:
    """Called by the import hook once `import torch` finished (ANTMAN_* set, unchanged script)."""
    if tf_activation.active() is not None:
        log.warning("PyTorch imported in a process where tf-antman serves TensorFlow: "
                    "PyTorch is not managed")
        return
    activate(torch=torch)
