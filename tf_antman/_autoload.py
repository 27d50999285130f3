"""Imported at interpreter start by tf_antman-autoload.pth, only when an ANTMAN_* variable is
set (the .pth line checks os.environ itself, so without ANTMAN_* not even this package is
imported and TensorFlow behaves as stock). Arranges for tf-antman to be activated around the
first `import tensorflow` of an unchanged user script."""

import os
from types import ModuleType

from tf_antman import exit_status, importhook


def _install() -> None:
    # Here, above activation, hooks and importhook, so that none of them imports another that
    # imports it back; imported after the exit wrappers are in place, as before.
    from tf_antman import activation, config, hooks

    importhook.on_import("tensorflow", before=activation.before_tensorflow, after=activation.after_tensorflow)
    if config.requested():  # ANTMAN_ENABLE=0: TensorFlow and Keras stay unpatched
        # Now, at interpreter start, none of the defining modules can be half-imported.
        hooks.register_import_hooks(activation.active_steps)


def _after_torch(torch: ModuleType) -> None:
    from tf_antman.torch import activation

    activation.after_torch(torch)


if os.environ.get("ANTMAN_ENABLE", "").strip().lower() not in ("0", "false", "no", "off"):
    # Before the script runs, so that `from sys import exit` binds the wrapper (exit_status.py).
    exit_status.watch_exit_calls()
_install()
importhook.on_import("torch", after=_after_torch)  # PyTorch jobs: tf_antman/torch, docs/pytorch.md

