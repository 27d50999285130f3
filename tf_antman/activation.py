"""Turning tf-antman on in a process: validate settings, load and configure the native runtime
before TensorFlow creates devices, then install the step hooks and the job agent."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from types import ModuleType

from tf_antman import config, device_select, importhook, native, priority
from tf_antman._log import log
from tf_antman.steps import StepTracker


@dataclasses.dataclass
class Active:
    settings: config.Settings
    native: native.Native
    steps: StepTracker


_active: Active | None = None


def active() -> Active | None:
    return _active


def active_steps() -> StepTracker | None:
    """The active step tracker, which the step hooks look up at call time (hooks.register_import_hooks)."""
    return None if _active is None else _active.steps


def _tf_devices_exist() -> bool:
    # Look without touching: creating TF's eager context here (before TF finished importing)
    # would itself be a side effect that changes how TF initialises.
    ctx_mod = sys.modules.get("tensorflow.python.eager.context")
    ctx = getattr(ctx_mod, "_context", None) if ctx_mod else None
    return ctx is not None and getattr(ctx, "_context_handle", None) is not None


def activate(environ: Mapping[str, str] | None = None) -> Active | None:
    """Validates ANTMAN_* settings and starts the runtime. Returns None if not enabled.
    Raises config.ConfigError for a bad value and RuntimeError if it is too late."""
    global _active
    env = os.environ if environ is None else environ
    settings = config.load(env)
    if settings.enabled:
        # auto -> cuda or emulated; cuda that cannot be served is refused here, in one line.
        settings = device_select.resolve(settings, {**os.environ, **env})
    if _active is not None:
        if settings != _active.settings:
            raise RuntimeError("tf-antman is already active with other settings: "
                               + _active.settings.describe())
        return _active
    if not settings.enabled:
        return None
    torch_activation = sys.modules.get("tf_antman.torch.activation")
    if torch_activation is not None and torch_activation.active() is not None:
        raise RuntimeError("tf-antman already serves PyTorch in this process: one framework per process")
    if _tf_devices_exist():
        raise RuntimeError("tf-antman must be enabled before TensorFlow creates its devices: "
                           "call tf_antman.enable() before the first TensorFlow op, or set ANTMAN_* "
                           "variables before starting Python")
    if settings.device == "cuda":
        # TF still builds its GPUBFCAllocator per GPU (unused: our device hands out ours). Should
        # any TF component allocate from it anyway, growth keeps that to what it uses instead of
        # the whole GPU (docs/gpu-path.md). A value the user set is kept.
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    # Before TF starts its thread pools, which inherit it (priority.py).
    priority.apply(settings)
    lib = native.load()
    capacity, limit = device_select.native_memory(settings, env)
    lib.configure(settings.device, settings.device_id, capacity, limit, settings.host_memory,
                  settings.compute_share)
    _active = Active(settings=settings, native=lib, steps=StepTracker(lib, settings))
    log.info("active (pid %d): %s", os.getpid(), settings.describe())
    from tf_antman import hooks

    # Hooks on the modules that define Session and the Keras Models; registered before any of
    # them can be half-imported (docs/steps.md). From the .pth hook they are registered already.
    hooks.register_import_hooks(active_steps)
    # Called from tensorflow's own import (before its code runs), tensorflow is in sys.modules
    # but half-built: its `after` hook starts the agent once it is complete.
    if importhook.imported("tensorflow") is not None:
        after_tensorflow(sys.modules["tensorflow"])
    elif "tensorflow" not in sys.modules:
        importhook.on_import("tensorflow", after=after_tensorflow)
    return _active


def before_tensorflow() -> None:
    torch_activation = sys.modules.get("tf_antman.torch.activation")
    if torch_activation is not None and torch_activation.active() is not None:
        log.warning("TensorFlow imported in a process where tf-antman serves PyTorch: "
                    "TensorFlow is not managed")
        return
    activate()


def after_tensorflow(_tf: ModuleType) -> None:
    if _active is None:
        return
    _active.native.start_hold_clock()  # ANTMAN_COMPUTE_SHARE=0 holds the job from here (exit report)
    from tf_antman import exit_report, jobside

    _active.steps.start_agent(jobside.start_agent)

    exit_report.register(_active.native)
