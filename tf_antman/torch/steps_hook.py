"""Step boundaries of a PyTorch job: after every `optimizer.step()` of the process.

One global post-hook (torch.optim.optimizer.register_optimizer_step_post_hook) sees every
optimizer, including those driven by PyTorch Lightning, Hugging Face Trainer and GradScaler,
which all end in `Optimizer.step`. With several optimizers (a GAN's generator and
discriminator), only the first one seen to step marks steps, so one training iteration is one
step; if it is garbage-collected, the next optimizer that steps takes over. Custom loops without
an optimizer mark steps with `tf_antman.step()` / `tf_antman.step_end()`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol


class StepSink(Protocol):
    def step_end(self, seconds: float | None = None, training: bool = True) -> None: ...


class OptimizerStepHook:
    """The post-hook: `hook(optimizer, args, kwargs)` as PyTorch calls it."""

    def __init__(self, steps: StepSink) -> None:
        self._steps = steps
        self._lead: weakref.ReferenceType[Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
        with self._lock:
            lead = self._lead() if self._lead is not None else None
            if lead is None:
                self._lead = weakref.ref(optimizer)
                lead = optimizer
        if optimizer is lead:
            # Duration: time since the previous step end (includes input loading and the forward
            # and backward passes: the mini-batch time the coordinator judges interference by).
            self._steps.step_end(None, training=True)


def install(steps: StepSink, optimizer_module: Any = None) -> Any:
    """Registers the hook; returns PyTorch's handle (`.remove()` takes it off)."""
    if optimizer_module is None:
        import torch.optim.optimizer as optimizer_module
    return optimizer_module.register_optimizer_step_post_hook(OptimizerStepHook(steps))
