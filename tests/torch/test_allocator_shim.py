"""The C functions CUDAPluggableAllocator calls (cc/torch/allocator_shim.h), driven through ctypes
exactly as PyTorch calls them (size, device, stream), on the emulated backend: no GPU, no torch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tf_antman.native import NativeError
from tf_antman.torch import _shim

MiB = 1 << 20


@pytest.fixture
def lib() -> Iterator[object]:
    if not _shim.shim_path().exists():
        pytest.skip(f"{_shim.shim_path()} is not built (python setup.py build_native)")
    lib = _shim.load()
    lib.antman_torch_reset_for_tests()
    yield lib
    lib.antman_torch_reset_for_tests()


def make(lib: object, device: int = 0, capacity: int = 64 * MiB, limit: int = 16 * MiB,
         host: int = 32 * MiB) -> _shim.TorchMemory:
    return _shim.create(lib, _shim.shim_path(), "emulated", device, capacity, limit, host)


def test_device_first_then_host_fallback_instead_of_oom(lib: object) -> None:
    mem = make(lib)
    a = mem.malloc(12 * MiB)
    b = mem.malloc(12 * MiB)  # 24 MiB > 16 MiB limit: served by the host arena, not refused
    assert a and b
    assert mem.is_host(a) == 0 and mem.is_host(b) == 1
    s = mem.mem_stats()
    assert s.host_fallbacks == 1 and s.host_in_use >= 12 * MiB and s.in_use >= 12 * MiB
    assert mem.failures() == 0
    for p in (a, b):
        mem.free(p, 12 * MiB)
    s = mem.mem_stats()
    assert s.in_use == 0 and s.host_in_use == 0
    assert mem.check_invariants() == ""


def test_refusals_return_null_and_are_counted(lib: object) -> None:
    mem = make(lib, host=8 * MiB)
    assert mem.malloc(0) == 0  # empty tensors: PyTorch passes 0
    assert mem.failures() == 0
    assert mem.malloc(40 * MiB) == 0  # over the limit and over the host cap
    assert lib.antman_torch_malloc(MiB, 5, None) is None  # no core for device 5
    assert lib.antman_torch_malloc(MiB, -1, None) is None
    assert mem.failures() == 3
    lib.antman_torch_free(None, 0, 0, None)  # ignored
    lib.antman_torch_free(12345, 16, 5, None)  # no core: reported, ignored
    assert mem.mem_stats().failed_allocs == 1


def test_one_core_per_device_and_validation(lib: object) -> None:
    make(lib, device=0)
    with pytest.raises(NativeError, match="device_ordinal: device 0 already"):
        make(lib, device=0)
    with pytest.raises(NativeError, match=r"device_ordinal: 64 is not in \[0, 64\)"):
        make(lib, device=64)
    with pytest.raises(NativeError, match="device_capacity"):
        make(lib, device=1, capacity=0)
    other = make(lib, device=3)
    p = other.malloc(MiB)
    assert p and other.mem_stats().in_use >= MiB
    assert make(lib, device=4).mem_stats().in_use == 0  # cores are separate


def test_limit_drop_releases_cache_at_step_boundary(lib: object) -> None:
    mem = make(lib, limit=48 * MiB)
    ptrs = [mem.malloc(8 * MiB) for _ in range(4)]
    for p in ptrs[1:]:
        mem.free(p, 8 * MiB)
    assert mem.mem_stats().reserved >= 32 * MiB  # freed blocks stay cached
    mem.request_limit(12 * MiB)
    assert mem.mem_stats().limit == 48 * MiB  # a request waits for the boundary
    mem.step_boundary()
    s = mem.mem_stats()
    assert s.limit == 12 * MiB
    assert s.reserved <= 12 * MiB and s.in_use >= 8 * MiB
    q = mem.malloc(8 * MiB)  # over the new limit: host memory, the job goes on
    assert mem.is_host(q) == 1
    assert mem.check_invariants() == ""
