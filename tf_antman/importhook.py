"""Activation around `import tensorflow` (and Keras), without changing the user's script.

A meta-path finder wraps the loader of a module we care about: `before` runs just before the
module's code, `after` once it has run to its end. For `tensorflow`, the native library is loaded
and configured before (so its device factory is registered before TF can create a device); the
step hooks are installed on the modules that *define* the patched classes (Keras 3's TensorFlow
trainer, tf_keras's Model, TF's Session), after each has finished executing.

Why the defining modules and not `keras` itself: the import orders interleave. `import keras`
imports tensorflow half-way through keras's own `__init__`, and tensorflow imports keras (or
tf_keras) while it is itself half-imported; a hook that reaches for `keras.Model` from
tensorflow's import finds a partially initialized module. A module's own `after` hook runs only
when that module is complete, whichever import started the chain.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# The .pth line the wheel (setup.py) and the development hook (scripts/setup.sh) install: it checks
# os.environ itself, so without ANTMAN_* not even the tf_antman package is imported.
PTH_LINE = ('import os; any(k.startswith("ANTMAN_") for k in os.environ) '
            'and __import__("tf_antman._autoload")\n')

Before = Callable[[], None]
After = Callable[[ModuleType], None]


class _WrappedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, before: list[Before], after: list[After]) -> None:
        self._inner = inner
        self._before = before
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        for hook in self._before:
            hook()
        self._inner.exec_module(module)
        for hook in self._after:
            hook(module)

    def __getattr__(self, name: str) -> Any:  # is_package, get_code, ... of the real loader
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, tuple[list[Before], list[After]]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.hooks:
            return None
        # Not popped here: importlib.util.find_spec("torch") (as transformers does to see what is
        # installed) calls this without importing; the hooks must wait for the real import.
        befores, afters = self.hooks[fullname]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrappedLoader(spec.loader, [self._once(fullname, befores)],
                                     [self._once(fullname, afters, last=True)])
        return spec

    def _once(self, fullname: str, hooks: list[Any], last: bool = False) -> Callable[..., None]:
        """Runs `hooks` only while `fullname`'s hooks are still registered: the first module
        execution that gets here runs them, later probes' loaders do nothing."""

        def run(*args: Any) -> None:
            if fullname not in self.hooks:
                return
            if last:
                self.hooks.pop(fullname, None)
            for hook in list(hooks):
                hook(*args)

        return run


_finder = _Finder()


def initializing(module: ModuleType) -> bool:
    """True while the module's own code is still running (it is in sys.modules, half-built)."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def imported(name: str) -> ModuleType | None:
    """The module if it has been imported completely, else None (absent or still initializing)."""
    module = sys.modules.get(name)
    return None if module is None or initializing(module) else module


def on_import(name: str, before: Before | None = None, after: After | None = None) -> bool:
    """Runs `before`/`after` around the import of module `name` (a dotted name is fine).

    Already imported completely: `after` runs at once. Not imported yet: both run around its
    import. Half-imported (its code is on the stack right now): nothing can be wrapped any more,
    returns False and the caller decides (tf-antman registers its hooks before any of these
    modules can be on the stack: at interpreter start, or in `tf_antman.enable()`).
    """
    module = sys.modules.get(name)
    if module is not None:
        if initializing(module):
            return False
        if after:
            after(module)
        return True
    befores, afters = _finder.hooks.setdefault(name, ([], []))
    if before:
        befores.append(before)
    if after:
        afters.append(after)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return True
