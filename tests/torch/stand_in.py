"""The smallest stand-in for the parts of PyTorch that tf_antman.torch touches without a GPU,
written to a directory that goes first on PYTHONPATH of a job subprocess (CI installs no torch).

It mirrors torch 2.x where the front-end relies on it: `torch.cuda.is_initialized()`, and
`torch.optim.optimizer.register_optimizer_step_post_hook(hook)` whose hooks every
`Optimizer.step()` calls as `hook(optimizer, args, kwargs)` after the update.
"""

from __future__ import annotations

from pathlib import Path

INIT = '''
class _Cuda:
    @staticmethod
    def is_initialized():
        return False

cuda = _Cuda()
from torch import optim  # noqa: E402
'''

OPTIMIZER = '''
_post_hooks = {}

class _Handle:
    def __init__(self, key):
        self.key = key

    def remove(self):
        _post_hooks.pop(self.key, None)

def register_optimizer_step_post_hook(hook):
    key = len(_post_hooks)
    _post_hooks[key] = hook
    return _Handle(key)

class Optimizer:
    def step(self, *args, **kwargs):
        for hook in list(_post_hooks.values()):
            hook(self, args, kwargs)
'''


def write(root: Path) -> Path:
    pkg = root / "torch"
    (pkg / "optim").mkdir(parents=True)
    (pkg / "__init__.py").write_text(INIT)
    (pkg / "optim" / "__init__.py").write_text("from torch.optim import optimizer\n")
    (pkg / "optim" / "optimizer.py").write_text(OPTIMIZER)
    return root
