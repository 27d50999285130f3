"""tf-antman for PyTorch: the same memory core, op manager and coordinator protocol as for
TensorFlow, serving a PyTorch job (docs/pytorch.md).

Set ANTMAN_* variables and run an unchanged training script (tf-antman activates when `torch`
is imported), or call `tf_antman.torch.enable(...)` before the first CUDA tensor. Steps end at
every `optimizer.step()`; custom loops use `tf_antman.step()`. Statistics and controls go
through $ANTMAN_JOB_DIR like a TensorFlow job's. Importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any

from tf_antman import config
from tf_antman.config import Settings

__all__ = ["enable", "is_active", "op_hook_stats"]


def enable(**options: Any) -> Settings:
    """Options as for tf_antman.enable (device_memory="20GiB", memory_limit="8GiB",
    compute_share=0.5, job_dir=..., ...); they override the environment. ANTMAN_DEVICE defaults
    to cuda here."""
    from tf_antman.torch import activation

    state = activation.activate(config.enable_environment(options))
    assert state is not None
    return state.settings


def is_active() -> bool:
    from tf_antman.torch import activation

    return activation.active() is not None


def op_hook_stats() -> dict[str, Any]:
    """Counters of the op hook (ops gated, nested, not on the device, threads) and of the gate."""
    from tf_antman.torch import activation

    state = activation.active()
    if state is None or state.native.compute is None:
        return {}
    return state.native.compute.hook_stats()
