"""Compute scaling for a PyTorch job: the op manager, the CUDA event gate and the op hook.

The op hook (op_hook.cpp) is a C++ extension built at run time with torch.utils.cpp_extension
against the job's own PyTorch (its C++ ABI must match; the build is cached by PyTorch in
TORCH_EXTENSIONS_DIR, so only the first job of a PyTorch install and toolchain compiles it,
about a minute). It is
installed at start and enabled only while the share is below 1.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tf_antman import core as antman_core
from tf_antman._log import log

HOOK_SOURCE = Path(__file__).resolve().parent / "op_hook.cpp"
HOOK_NAME = "tf_antman_torch_op_hook"
# PyTorch's CUDA allocator over the memory cores (cuda_allocator.cpp): CUDA builds only.
ALLOCATOR_SOURCE = Path(__file__).resolve().parent / "cuda_allocator.cpp"
ALLOCATOR_NAME = "tf_antman_torch_allocator"


def build_hook(with_cuda: bool, verbose: bool = False) -> Any:
    """Compiles (or loads from PyTorch's extension cache) the op hook module."""
    return build_extension(HOOK_SOURCE, HOOK_NAME, with_cuda, "op hook", verbose)


def build_allocator(verbose: bool = False) -> Any:
    """Compiles (or loads from the cache) the CUDA allocator extension (cuda_allocator.cpp)."""
    return build_extension(ALLOCATOR_SOURCE, ALLOCATOR_NAME, True, "CUDA allocator", verbose)


def build_extension(source: Path, base_name: str, with_cuda: bool, what: str,
                    verbose: bool = False) -> Any:
    from torch.utils import cpp_extension

    # NDEBUG as in libtorch's own build: at::RecordFunction's layout depends on it (op_hook.cpp).
    flags = ["-O2", "-DNDEBUG", *(["-DANTMAN_WITH_CUDA"] if with_cuda else [])]
    name, build_dir = hook_build_dir(with_cuda, flags, extensions_root(), source, base_name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir), _no_gpu_queries(with_cuda):
        if not any(build_dir.glob(f"{name}*.so")):
            log.info("compiling tf-antman's PyTorch %s in %s (once per PyTorch install and "
                     "toolchain: about a minute)", what, build_dir)
        return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags,
                                  build_directory=str(build_dir), with_cuda=with_cuda, verbose=verbose)


@contextlib.contextmanager
def _no_gpu_queries(with_cuda: bool) -> Iterator[None]:
    """Without TORCH_CUDA_ARCH_LIST, a CUDA build asks every visible GPU for its architecture
    (cpp_extension's arch flags), which initialises CUDA in PyTorch: the allocator, installed
    right after, could then no longer replace PyTorch's ("Can't swap an already initialized
    allocator"). The sources hold no device code, so any architecture does for the build."""
    if not with_cuda or os.environ.get("TORCH_CUDA_ARCH_LIST"):
        yield
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def extensions_root() -> str:
    """Where PyTorch keeps built extensions: $TORCH_EXTENSIONS_DIR as cpp_extension reads it,
    else its per-user cache (get_default_build_root, which does not read the variable)."""
    from torch.utils import cpp_extension

    return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def hook_build_dir(with_cuda: bool, flags: list[str], root: str, source: Path = HOOK_SOURCE,
                   base_name: str = HOOK_NAME) -> tuple[str, Path]:
    """The hook's module name and build directory. The name carries a digest of everything the
    build depends on: the source and flags (PyTorch's cache reused a build made with other flags,
    seen on torch 2.13, and a stale hook must never be loaded), and the source's path, the
    interpreter, torch, ninja and the compiler (two installs or toolchains that shared one
    directory rebuilt it each time they alternated, 30 s a job start)."""
    import torch

    key = [source.read_bytes(), " ".join(flags), str(source), sys.executable,
           torch.__version__, str(torch.version.cuda), shutil.which("ninja") or "",
           os.environ.get("CXX", "")]
    digest = hashlib.sha256("\0".join(k if isinstance(k, str) else k.hex() for k in key).encode()).hexdigest()[:12]
    name = f"{base_name}_{'cuda' if with_cuda else 'cpu'}_{digest}"
    return name, Path(root) / name


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder at a time, by an flock the kernel releases when its holder dies. PyTorch's own
    lock is a file that a job killed while compiling (a cancel in its first minute) leaves
    behind, and every later job then waited for it for ever inside `import torch`: under this
    lock, a PyTorch lock file present is such a leftover, and is removed."""
    with open(build_dir / "tf_antman.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process compiling tf-antman's PyTorch op hook in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists() and _torch_lock_is_a_baton():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _torch_lock_is_a_baton() -> bool:
    """Whether cpp_extension's `lock` file blocks by existing (a FileBaton: torch 2.13 and older),
    so one left behind is stale. torch 2.14 holds an OS lock on that file instead (its FileLock),
    which stays after every build and blocks nobody: removing it then would only log a false
    warning at each job start."""
    from torch.utils import cpp_extension

    return getattr(cpp_extension, "FileLock", None) is None


class Compute:
    """Owns the op manager, the gate (on CUDA) and the installed hook of this process."""

    def __init__(self, core: antman_core.CoreLib, share: float, device: int, on_cuda: bool,
                 hook_module: Any = None) -> None:
        self.core = core
        self.opm = antman_core.OpManager(core, share=share)
        self.gate = antman_core.CudaGate(core, self.opm, device_ordinal=device) if on_cuda else None
        self.hook = hook_module if hook_module is not None else build_hook(with_cuda=on_cuda)
        fns = core.function_addresses()
        self.hook.install("device" if on_cuda else "host", self.opm.handle,
                          self.gate.handle if self.gate else 0,
                          fns["antman_opm_admit"], fns["antman_opm_finish"],
                          fns["antman_gate_begin"], fns["antman_gate_end"])
        self.hook.set_enabled(share < 1.0)
        # The hook holds raw pointers to the op manager and the gate, which Python frees when it
        # tears the interpreter down (their __del__): before that, atexit stops it for good.
        atexit.register(self.shutdown)

    def shutdown(self, timeout_s: float = 5.0) -> int:
        """No op is gated from now on (the process is ending): ops waiting for admission are let
        go, and the gated ops still running are waited for (up to timeout_s), so the manager and
        the gate can be freed after. Returns the ops still in flight (0 normally)."""
        if not hasattr(self.hook, "shutdown"):  # a stand-in hook in tests
            return 0
        self.opm.set_share(1.0)
        left = int(self.hook.shutdown(timeout_s))
        if left:
            log.warning("%d PyTorch op(s) still gated at exit after %.1f s", left, timeout_s)
        return left

    def set_share(self, share: float) -> None:
        # Below 1: the manager first, then the hook, so no op is admitted under the old share by
        # a hook that was just enabled. To 1: the hook off first, then ops waiting are released.
        if share < 1.0:
            self.opm.set_share(share)
            self.hook.set_enabled(True)
        else:
            self.hook.set_enabled(False)
            self.opm.set_share(share)

    def stats(self) -> antman_core.OpmStats:
        return self.opm.raw_stats()

    def hook_stats(self) -> dict[str, Any]:
        out = dict(self.hook.stats())
        if self.gate is not None:
            out["gate"] = self.gate.stats()
        return out
