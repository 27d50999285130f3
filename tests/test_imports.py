"""The import structure of scheduler_lite and tf_antman.

- The scheduler loads the job protocol (tf_antman.protocol), never the training runtime: the
  daemon process must not import tf_antman's activation, import hook, native loader, core or step
  hooks (they are the job's side of the contract, docs/protocol.md).
- No import circle anywhere: neither the module-level imports of both packages nor those inside
  functions (deferred until the function runs) form a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO, clean_env

PACKAGES = ("scheduler_lite", "tf_antman")
RUNTIME = ("tf_antman.activation", "tf_antman.importhook", "tf_antman.native", "tf_antman.core",
           "tf_antman.steps")


def test_the_daemon_imports_no_training_runtime() -> None:
    code = ("import sys, scheduler_lite.daemon\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('tf_antman'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert "tf_antman.protocol" in out  # the contract it does use
    assert [m for m in out if m in RUNTIME or m.startswith(tuple(r + "." for r in RUNTIME))] == []


def test_the_public_names_still_reach_the_runtime() -> None:
    # The runtime loads on first use: the package's own names and its `activation` attribute.
    code = ("import sys, tf_antman\n"
            "assert 'tf_antman.activation' not in sys.modules\n"
            "assert tf_antman.is_active() is False\n"
            "assert tf_antman.activation.active() is None\n"
            "assert callable(tf_antman.enable) and tf_antman.Settings and tf_antman.ConfigError\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: its top level, inside if/try (TYPE_CHECKING ones
    included: they state a dependency a type checker follows)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)


def _everywhere(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        for n in ast.walk(node):
            if isinstance(n, ast.Import | ast.ImportFrom):
                yield n


def _graph(walk: type[object] | object) -> dict[str, set[str]]:
    """Module -> the modules of both packages it names in an import. `from pkg import name` counts
    as an import of the submodule pkg.name when there is one, else of pkg. A package's parents are
    not counted: Python has them in sys.modules before the submodule runs."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in walk(ast.parse(path.read_text()).body):  # type: ignore[operator]
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            edges |= {t for t in targets if t in mods and t != name}
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_at_module_level() -> None:
    assert [sorted(c) for c in _circles(_graph(_module_level))] == []


def test_no_import_circle_even_inside_functions() -> None:
    # A deferred import hides a circle from the module level, not from a reader.
    assert [sorted(c) for c in _circles(_graph(_everywhere))] == []
