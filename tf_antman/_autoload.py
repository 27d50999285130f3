"""Imported at interpreter start by tf_antman-autoload.pth, only when an ANTMAN_* variable is
set (the .pth line checks os.environ itself, so without ANTMAN_* not even this package is
imported and TensorFlow behaves as stock). Arranges for tf-antman to be activated around the
first `import tensorflow` of an unchanged user script."""

from types import ModuleType

from tf_antman import importhook


def _after_torch(torch: ModuleType) -> None:
    from tf_antman.torch import activation

    activation.after_torch(torch)


importhook.install()
importhook.on_import("torch", after=_after_torch)  # PyTorch jobs: tf_antman/torch, docs/pytorch.md

