"""tf-antman: AntMan-style dynamic GPU sharing for TensorFlow.

Set ANTMAN_* variables (docs/configuration.md) and run an unchanged script, or call
`tf_antman.enable(...)` before the first TensorFlow op. Importing this package never imports
TensorFlow by itself.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tf_antman import config, units
from tf_antman.config import ConfigError, Settings

if TYPE_CHECKING:
    from tf_antman import activation

__all__ = [
    "ConfigError", "Settings", "compute_stats", "device_info", "enable", "is_active",
    "keras_callback", "memory_stats", "release_cached", "set_compute_share", "set_memory_limit",
    "settings", "step", "step_end",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`tf_antman.activation`, loaded on first use: the scheduler imports tf_antman.protocol, which
    runs this file, and must not load the training runtime (activation, its native loader, import
    and step hooks) with it."""
    if name == "activation":
        import importlib

        return importlib.import_module("tf_antman.activation")
    raise AttributeError(f"module 'tf_antman' has no attribute {name!r}")


def enable(**options: Any) -> Settings:
    """Turns tf-antman on from code. Options are the ANTMAN_* variables in lower case without
    the prefix (device_memory="2GiB", compute_share=0.5, ...); they override the environment."""
    from tf_antman import activation

    state = activation.activate(config.enable_environment(options))
    assert state is not None
    return state.settings


def _state() -> activation.Active:
    from tf_antman import activation

    state = activation.active() or _torch_state()
    if state is None:
        raise RuntimeError("tf-antman is not active: set ANTMAN_ENABLE=1 or call tf_antman.enable()")
    return state


def _torch_state() -> Any:
    """The PyTorch front-end's state (same shape: settings, native, steps), if it is active."""
    import sys

    torch_activation = sys.modules.get("tf_antman.torch.activation")
    return torch_activation.active() if torch_activation is not None else None


def is_active() -> bool:
    from tf_antman import activation

    return activation.active() is not None or _torch_state() is not None


def settings() -> Settings:
    return _state().settings


def memory_stats() -> dict[str, int]:
    """Memory figures of the device in bytes (see docs/memory-core.md for each field)."""
    return _state().native.mem_stats().as_dict()


def compute_stats() -> dict[str, Any]:
    return _state().native.op_stats().as_dict()


def set_memory_limit(limit: int | str) -> None:
    """Requests a device-memory limit; it takes effect at the next step boundary, unless a
    coordinator limit received after this request replaces it (the newer one wins).

    `limit`: bytes (an int) or a size string ("2GiB", docs/configuration.md), from 1MiB to the
    device's memory (ANTMAN_DEVICE_MEMORY; on cuda the GPU memory the job may use)."""
    state = _state()
    if isinstance(limit, str):
        try:
            n = units.parse_bytes(limit)
        except ValueError as err:
            raise ValueError(f"set_memory_limit: limit {err}") from None
    elif isinstance(limit, numbers.Integral) and not isinstance(limit, bool):
        n = int(limit)  # numpy's integers too
    else:
        raise TypeError(f"set_memory_limit: limit must be an int (bytes) or a size string such as "
                        f"'2GiB', got {type(limit).__name__} {limit!r}")
    capacity = int(state.native.mem_stats().device_capacity)
    if not config.MiB <= n <= capacity:
        raise ValueError(f"set_memory_limit: limit {limit!r} ({n} bytes) is out of range: accepted 1MiB.."
                         f"{units.format_bytes(capacity)} (the device's memory, {capacity} bytes)")
    state.steps.limits.request(n)


def release_cached() -> int:
    """Frees every cached device region now; returns the bytes released."""
    return _state().native.release_cached()


def set_compute_share(share: float) -> None:
    """Holds the job to a share (0..1) of its device's compute from the next op on; 0 holds its
    ops until a larger share is set (or Ctrl-C, which releases them: docs/configuration.md)."""
    _check_real("set_compute_share", "share", share, "a number in 0.0..1.0")
    if not 0.0 <= share <= 1.0:  # also NaN
        raise ValueError(f"set_compute_share: share {share!r} is out of range: accepted 0.0..1.0")
    state = _state()
    agent = state.steps.agent
    if agent is not None:  # it knows the pause in force and the coordinator's controls (newest wins)
        agent.user_share(float(share))
    else:
        state.native.set_share(float(share))


def step_end(seconds: float | None = None, training: bool = True) -> None:
    """Marks a mini-batch boundary in a custom loop. `seconds`: the step's duration, a finite
    number >= 0, or None for the time since the previous call (the first call is not timed).
    `training`: False for an evaluation step: not counted, not timed and not a boundary (a
    control waits for the next training step, docs/steps.md)."""
    if seconds is not None:
        _check_real("step_end", "seconds", seconds, "a number of seconds >= 0, or None")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"step_end: seconds {seconds!r} is out of range: accepted a finite "
                             "number >= 0, or None")
    _check_bool("step_end", training)
    _state().steps.step_end(None if seconds is None else float(seconds), training)


@contextlib.contextmanager
def step(training: bool = True) -> Iterator[None]:
    """`with tf_antman.step(): train_step(x, y)` times the block as one mini-batch."""
    _check_bool("step", training)
    with _state().steps.step(training):
        yield


def _check_real(fn: str, name: str, value: object, accepted: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {name} must be {accepted}, got {type(value).__name__} {value!r}")


def _check_bool(fn: str, training: object) -> None:
    if not isinstance(training, bool):
        raise TypeError(f"{fn}: training must be True or False, got {type(training).__name__} {training!r}")


def keras_callback(model: Any = None) -> Any:
    """The callback Model.fit gets automatically; for code that builds its own callback list.

    `model`: the model it will train, whose Keras (Keras 3 or tf_keras) gives the callback's base
    class; without it, tf_keras when `tf.keras` is tf_keras (TF_USE_LEGACY_KERAS=1) or when only
    tf_keras was imported, else Keras 3 (docs/steps.md). Either works in either Keras's fit."""
    from tf_antman import hooks

    return hooks.keras_callback(_state().steps, model=model)


def device_info() -> dict[str, str]:
    """Runs an op on the job's device (the emulated CPU device, or GPU:0 under ANTMAN_DEVICE=cuda)
    and reports which allocator serves its tensors."""
    import tensorflow as tf

    from tf_antman import native

    ops = tf.load_op_library(str(native.lib_path(native.OPS_LIB)))
    on_gpu = is_active() and settings().device == "cuda"
    with tf.device("/device:GPU:0" if on_gpu else "/device:CPU:0"):
        allocator, device = ops.antman_device_info()
    return {"allocator": allocator.numpy().decode(), "device": device.numpy().decode()}
