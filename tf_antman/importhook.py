"""Activation around `import tensorflow` (and Keras), without changing the user's script.

A meta-path finder wraps the loader of the `tensorflow` package: before its module runs, the
native library is loaded and configured (so its device factory is registered before TF can
create a device); after it ran, the step hooks are installed. Keras is patched when it is
imported, whichever comes first.
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


class _WrappedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, before: Callable[[], None] | None,
                 after: Callable[[ModuleType], None] | None) -> None:
        self._inner = inner
        self._before = before
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self._before:
            self._before()
        self._inner.exec_module(module)
        if self._after:
            self._after(module)

    def __getattr__(self, name: str) -> Any:  # is_package, get_code, ... of the real loader
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, tuple[Callable[[], None] | None, Callable[[ModuleType], None] | None]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.hooks:
            return None
        # Not popped here: importlib.util.find_spec("torch") (as transformers does to see what is
        # installed) calls this without importing; the hooks must wait for the real import.
        before, after = self.hooks[fullname]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrappedLoader(spec.loader, self._once(fullname, before),
                                     self._once(fullname, after, last=True))
        return spec

    def _once(self, fullname: str, hook: Callable[..., None] | None,
              last: bool = False) -> Callable[..., None] | None:
        """Runs `hook` only while `fullname`'s hooks are still registered (once per process)."""
        if hook is None and not last:
            return None

        def run(*args: Any) -> None:
            if fullname not in self.hooks:
                return
            if last:
                self.hooks.pop(fullname, None)
            if hook is not None:
                hook(*args)

        return run


_finder = _Finder()


def on_import(name: str, before: Callable[[], None] | None = None,
              after: Callable[[ModuleType], None] | None = None) -> None:
    """Runs before/after around the import of top-level module `name` (at once if imported)."""
    if name in sys.modules:
        if after:
            after(sys.modules[name])
        return
    _finder.hooks[name] = (before, after)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def install() -> None:
    from tf_antman import activation

    on_import("tensorflow", before=activation.before_tensorflow, after=activation.after_tensorflow)
