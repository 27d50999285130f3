"""ctypes binding of libantman_torch.so (cc/torch/allocator_shim.h): the memory cores that serve
PyTorch's CUDA tensors through CUDAPluggableAllocator. No torch import: tests drive the same C
functions PyTorch calls, on the emulated backend."""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path

from tf_antman.native import MemStats, NativeError, lib_path

LIB_NAME = "libantman_torch.so"
ABI_VERSION = 3  # ANTMAN_TORCH_ABI_VERSION
# Given to PyTorch only: it throws a C++ exception when it cannot serve a request (PyTorch raises
# it as RuntimeError "tf-antman: CUDA out of memory. ..."); called through ctypes, that exception
# would end the process, so this module calls antman_torch_try_malloc (NULL instead) itself.
MALLOC_FN = "antman_torch_malloc"
FREE_FN = "antman_torch_free"
# What tf_antman/torch/cuda_allocator.cpp's install() takes, in order, by address.
ALLOCATOR_FNS = ("antman_torch_malloc", "antman_torch_free", "antman_torch_record_stream",
                 "antman_torch_empty_cache", "antman_torch_get_stats", "antman_torch_reset_peaks",
                 "antman_torch_reset_accumulated")
BACKENDS = {"emulated": 0, "cuda": 1}
MAX_DEVICES = 64


class MemConfig(ctypes.Structure):
    """Mirror of antman_mem_config (cc/core/antman_memory.h); field order matters."""

    _fields_ = [
        ("backend", ctypes.c_int), ("device_ordinal", ctypes.c_int),
        ("device_capacity", ctypes.c_uint64), ("limit", ctypes.c_uint64),
        ("host_capacity", ctypes.c_uint64), ("min_region", ctypes.c_uint64),
        ("host_idle_release_ms", ctypes.c_uint64),  # 0 = the core's default (10 s)
    ]


class TorchStat(ctypes.Structure):
    """Mirror of antman_torch_stat (cc/torch/torch_stats.h): PyTorch's Stat."""

    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64),
                ("allocated", ctypes.c_int64), ("freed", ctypes.c_int64)]


# antman_torch_device_stats's Stat fields, in order: PyTorch's DeviceStats names.
STAT_FIELDS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
COUNT_FIELDS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                "num_device_free")


class TorchDeviceStats(ctypes.Structure):
    """Mirror of antman_torch_device_stats (cc/torch/torch_stats.h); field order matters."""

    _fields_ = [*((f, TorchStat) for f in STAT_FIELDS), *((f, ctypes.c_int64) for f in COUNT_FIELDS)]


def torch_memory_stats(s: TorchDeviceStats) -> dict[str, int]:
    """The flat dict torch.cuda.memory_stats() returns, from the device's stats: PyTorch's keys
    ("allocated_bytes.all.current", ...) with the pools tf-antman does not have ("small_pool",
    "large_pool") reported as 0, so scripts that read either find a number."""
    out: dict[str, int] = {}
    for name in STAT_FIELDS:
        stat = getattr(s, name)
        for pool in ("all", "small_pool", "large_pool"):
            for part in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{pool}.{part}"] = int(getattr(stat, part)) if pool == "all" else 0
    for name in COUNT_FIELDS:
        out[name] = int(getattr(s, name))
    return dict(sorted(out.items()))


def mem_get_info(stats: MemStats) -> tuple[int, int]:
    """torch.cuda.mem_get_info() of a managed device: (free, total) of what this job may hold on
    it, the limit in force, rather than the driver's view of the whole GPU (which other jobs
    share): code that sizes its batches from it then fits under the limit."""
    total = int(stats.limit)
    return max(0, total - int(stats.in_use)), total


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of one of the library's C functions (the extensions call them directly)."""
    return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)


@dataclasses.dataclass
class TorchMemory:
    """The memory core of one device inside libantman_torch.so."""

    lib: ctypes.CDLL
    path: Path
    device: int

    @property
    def handle(self) -> int:
        return int(self.lib.antman_torch_mem(self.device) or 0)

    def mem_stats(self) -> MemStats:
        s = MemStats()
        self.lib.antman_mem_get_stats(self.handle, ctypes.byref(s))
        return s

    def request_limit(self, limit: int) -> None:
        self.lib.antman_mem_request_limit(self.handle, limit)

    def set_limit_now(self, limit: int) -> tuple[int, int]:
        unfreed = ctypes.c_uint64(0)
        freed = self.lib.antman_mem_set_limit(self.handle, limit, ctypes.byref(unfreed))
        return int(freed), int(unfreed.value)

    def release_cached(self) -> int:
        return int(self.lib.antman_mem_release_cached(self.handle))

    def step_boundary(self) -> None:
        # Freed blocks whose streams are done go back to the core first, so that a limit applied
        # at this boundary can release their regions (no waiting: stream_ordered.h).
        self.lib.antman_torch_poll(self.device)
        self.lib.antman_mem_step_boundary(self.handle)

    def torch_stats(self) -> TorchDeviceStats:
        s = TorchDeviceStats()
        self.lib.antman_torch_get_stats(self.device, ctypes.byref(s))
        return s

    def reset_peaks(self) -> None:
        self.lib.antman_torch_reset_peaks(self.device)

    def empty_cache(self) -> int:
        return int(self.lib.antman_torch_empty_cache(self.device))

    def record_stream(self, ptr: int, stream: int) -> bool:
        return self.lib.antman_torch_record_stream(ptr, self.device, stream) == 0

    def is_host(self, ptr: int) -> int:
        return int(self.lib.antman_mem_is_host(self.handle, ptr))

    def check_invariants(self) -> str:
        buf = ctypes.create_string_buffer(512)
        rc = self.lib.antman_mem_check_invariants(self.handle, buf, len(buf))
        return "" if rc == 0 else buf.value.decode(errors="replace") or f"code {rc}"

    # What PyTorch calls, for tests (PyTorch calls them by address, not through here). malloc is
    # antman_torch_try_malloc: 0 where the PyTorch-facing antman_torch_malloc throws.
    def malloc(self, size: int, stream: int = 0) -> int:
        return int(self.lib.antman_torch_try_malloc(size, self.device, stream) or 0)

    def free(self, ptr: int, size: int, stream: int = 0) -> None:
        self.lib.antman_torch_free(ptr, size, self.device, stream)

    def failures(self) -> int:
        return int(self.lib.antman_torch_failures())


def shim_path() -> Path:
    return lib_path(LIB_NAME)


def load(path: Path | None = None) -> ctypes.CDLL:
    """Loads the library RTLD_LOCAL (it exports C functions only) and checks its ABI version.
    CUDAPluggableAllocator later opens the same path, which yields this same instance."""
    path = shim_path() if path is None else path
    if not path.exists():
        raise NativeError(f"{path} is missing: build it with `python setup.py build_native` "
                          "(or install the tf-antman wheel)")
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    u64, i32, vp, sz = ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_ssize_t
    lib.antman_torch_abi_version.restype = i32
    version = lib.antman_torch_abi_version()
    if version != ABI_VERSION:
        raise NativeError(f"{path} has ABI version {version}, this package expects {ABI_VERSION}")
    lib.antman_torch_mem_create.argtypes = [ctypes.POINTER(MemConfig), ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_torch_mem_create.restype = i32
    lib.antman_torch_mem.argtypes = [i32]
    lib.antman_torch_mem.restype = vp
    # Not antman_torch_malloc: it throws, and a C++ exception through ctypes ends the process.
    lib.antman_torch_try_malloc.argtypes = [sz, i32, vp]
    lib.antman_torch_try_malloc.restype = vp
    lib.antman_torch_free.argtypes = [vp, sz, i32, vp]
    lib.antman_torch_free.restype = None
    lib.antman_torch_failures.restype = u64
    lib.antman_torch_record_stream.argtypes = [vp, i32, vp]
    lib.antman_torch_record_stream.restype = i32
    lib.antman_torch_empty_cache.argtypes = [i32]
    lib.antman_torch_empty_cache.restype = u64
    lib.antman_torch_poll.argtypes = [i32]
    lib.antman_torch_poll.restype = None
    lib.antman_torch_get_stats.argtypes = [i32, ctypes.POINTER(TorchDeviceStats)]
    lib.antman_torch_get_stats.restype = i32
    lib.antman_torch_reset_peaks.argtypes = [i32]
    lib.antman_torch_reset_peaks.restype = None
    lib.antman_torch_reset_accumulated.argtypes = [i32]
    lib.antman_torch_reset_accumulated.restype = None
    lib.antman_torch_reset_for_tests.restype = None
    lib.antman_mem_get_stats.argtypes = [vp, ctypes.POINTER(MemStats)]
    lib.antman_mem_request_limit.argtypes = [vp, u64]
    lib.antman_mem_set_limit.argtypes = [vp, u64, ctypes.POINTER(u64)]
    lib.antman_mem_set_limit.restype = u64
    lib.antman_mem_release_cached.argtypes = [vp]
    lib.antman_mem_release_cached.restype = u64
    lib.antman_mem_step_boundary.argtypes = [vp]
    lib.antman_mem_is_host.argtypes = [vp, vp]
    lib.antman_mem_is_host.restype = i32
    lib.antman_mem_check_invariants.argtypes = [vp, ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_mem_check_invariants.restype = i32
    return lib


def create(lib: ctypes.CDLL, path: Path, backend: str, device: int, device_capacity: int,
           limit: int, host_capacity: int) -> TorchMemory:
    """The memory core of `device` (capacity / limit 0: the device's free memory)."""
    cfg = MemConfig(BACKENDS[backend], device, device_capacity, limit, host_capacity, 0, 0)
    err = ctypes.create_string_buffer(512)
    if lib.antman_torch_mem_create(ctypes.byref(cfg), err, len(err)) != 0:
        raise NativeError(err.value.decode(errors="replace"))
    return TorchMemory(lib=lib, path=path, device=device)
