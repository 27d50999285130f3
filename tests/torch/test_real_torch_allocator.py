"""With PyPI's CUDA build of torch on the CPU (scripts/test.sh runs this file in .torchvenv; it
skips where torch has no CUDA build or the CUDA headers are missing): the allocator extension
(tf_antman/torch/cuda_allocator.cpp) is built by torch.utils.cpp_extension as a job builds it,
installed as PyTorch's CUDA allocator, and PyTorch's own entry points reach the memory core
through it: memory statistics under PyTorch's keys, peak reset, empty_cache, mem_get_info, and
CUDA graph capture / private pools refused before a capture begins. No GPU: the core is the
emulated one and its blocks are allocated through the shim's C functions (PyTorch cannot make a
CUDA tensor here), which is what the statistics then describe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="no torch in this venv: scripts/test.sh runs this file in .torchvenv")

from tf_antman.torch import _shim, activation  # noqa: E402
from tf_antman.torch.compute import build_allocator  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def extension() -> Any:
    if not torch.version.cuda:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build")
    home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    if not (home / "include" / "cuda_runtime_api.h").is_file():
        pytest.skip("no CUDA headers: set CUDA_HOME to a CUDA toolkit")
    from torch.utils import cpp_extension

    def no_gpu_query(*args: object) -> None:
        raise AssertionError("building the extension asked PyTorch about the GPUs, which "
                             "initialises CUDA: the allocator could not be installed after it")

    with pytest.MonkeyPatch.context() as mp:  # cpp_extension guessed CUDA_HOME at import
        mp.setattr(cpp_extension, "CUDA_HOME", str(home))
        mp.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
        for query in ("device_count", "get_device_capability", "get_device_properties", "_lazy_init"):
            mp.setattr(torch.cuda, query, no_gpu_query)
        return build_allocator()


@pytest.fixture(scope="module")
def memory(extension: Any) -> Any:
    path = _shim.shim_path()
    if not path.exists():
        pytest.skip(f"{path} is not built (python setup.py build_native)")
    lib = _shim.load(path)
    lib.antman_torch_reset_for_tests()
    mem = _shim.create(lib, path, "emulated", 0, 64 * MiB, 16 * MiB, 32 * MiB)
    assert activation.install_allocator(torch, lib, path, mem, build=lambda: extension)
    return mem


def test_the_extension_is_pytorchs_cuda_allocator(extension: Any, memory: Any) -> None:
    assert extension.current_name() == "tf-antman"


def test_memory_stats_come_from_the_core_under_pytorchs_keys(memory: Any) -> None:
    a = memory.malloc(3 * MiB)
    b = memory.malloc(MiB)
    live = [a, b]
    try:
        s = torch._C._cuda_memoryStats(0)  # what torch.cuda.memory_stats() reads
        assert s["requested_bytes"]["all"]["current"] == 4 * MiB
        assert s["allocated_bytes"]["all"]["current"] >= 4 * MiB
        assert s["allocation"]["all"]["current"] == 2
        assert s["reserved_bytes"]["all"]["current"] >= s["allocated_bytes"]["all"]["current"]
        memory.free(live.pop(0), 3 * MiB)
        assert torch._C._cuda_memoryStats(0)["requested_bytes"]["all"]["peak"] == 4 * MiB
        torch._C._cuda_resetPeakMemoryStats(0)  # reset_peak_memory_stats() (it raised before)
        assert torch._C._cuda_memoryStats(0)["requested_bytes"]["all"]["peak"] == MiB
    finally:
        for p in live:  # what a failed assertion left (the next test counts the regions)
            memory.free(p, MiB)


def test_empty_cache_gives_the_cores_regions_back(memory: Any) -> None:
    a = memory.malloc(5 * MiB)
    memory.free(a, 5 * MiB)
    assert memory.mem_stats().reserved > 0
    torch._C._cuda_emptyCache()
    assert memory.mem_stats().reserved == 0


def test_mem_get_info_reports_the_jobs_limit(memory: Any) -> None:
    a = memory.malloc(4 * MiB)
    try:
        free, total = torch.cuda.mem_get_info(0)
        assert total == 16 * MiB and free == 16 * MiB - memory.mem_stats().in_use
    finally:
        memory.free(a, 4 * MiB)


def test_cuda_graph_pools_are_refused_before_capture_with_what_to_do(memory: Any) -> None:
    # CUDAGraph::capture_begin and use_mem_pool call beginAllocateToPool before
    # cudaStreamBeginCapture: the refusal comes before any capture exists.
    with pytest.raises(RuntimeError, match="CUDA graph capture") as err:
        torch._C._cuda_beginAllocateToPool(0, (1, 0))
    assert "ANTMAN_" in str(err.value)


def test_a_forked_child_gets_pytorchs_fork_guard(memory: Any) -> None:
    # The memory core initialises the CUDA driver at activation, before PyTorch's own lazy init:
    # a forked DataLoader worker touching CUDA must still get PyTorch's fork guard. The extension
    # registers it at install; in torch 2.14.1 importing cpp_extension registers it too (its
    # device-count probe), so this checks the guard is there, and cannot show which did it.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once (no pytest teardown)
        os.write(write, b"1" if torch.cuda._is_in_bad_fork() else b"0")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
