"""tf-antman: AntMan-style dynamic GPU sharing for TensorFlow.

Set ANTMAN_* variables (docs/configuration.md) and run an unchanged script, or call
`tf_antman.enable(...)` before the first TensorFlow op. Importing this package never imports
TensorFlow by itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tf_antman import activation, config, units
from tf_antman.config import ConfigError, Settings

__all__ = [
    "ConfigError", "Settings", "compute_stats", "device_info", "enable", "is_active",
    "keras_callback", "memory_stats", "release_cached", "set_compute_share", "set_memory_limit",
    "settings", "step", "step_end",
]
__version__ = "0.1.0"

def enable(**options: Any) -> Settings:
    """Turns tf-antman on from code. Options are the ANTMAN_* variables in lower case without
    the prefix (device_memory="2GiB", compute_share=0.5, ...); they override the environment."""
    state = activation.activate(config.enable_environment(options))
    assert state is not None
    return state.settings


def _state() -> activation.Active:
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
    coordinator limit received after this request replaces it (the newer one wins)."""
    n = units.parse_bytes(limit) if isinstance(limit, str) else int(limit)
    if not config.MiB <= n <= config.MAX_BYTES:
        raise ValueError(f"memory limit {n} out of range 1MiB..1PiB")
    _state().steps.limits.request(n)


def release_cached() -> int:
    """Frees every cached device region now; returns the bytes released."""
    return _state().native.release_cached()


def set_compute_share(share: float) -> None:
    """Holds the job to a share (0..1) of its device's compute from the next op on."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"compute share {share!r} out of range 0.0..1.0")
    _state().native.set_share(share)


def step_end(seconds: float | None = None, training: bool = True) -> None:
    """Marks a mini-batch boundary in a custom loop (duration: time since the last call)."""
    _state().steps.step_end(seconds, training)


@contextlib.contextmanager
def step(training: bool = True) -> Iterator[None]:
    """`with tf_antman.step(): train_step(x, y)` times the block as one mini-batch."""
    with _state().steps.step(training):
        yield


def keras_callback() -> Any:
    """The callback Model.fit gets automatically; for code that builds its own callback list."""
    from tf_antman import hooks

    return hooks.keras_callback(_state().steps)


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
