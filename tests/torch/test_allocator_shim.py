"""The C functions CUDAPluggableAllocator calls (cc/torch/allocator_shim.h), driven through ctypes
exactly as PyTorch calls them (size, device, stream), on the emulated backend: no GPU, no torch.

antman_torch_malloc, the function PyTorch is given, throws a C++ exception when it cannot serve
a request (a C++ exception through ctypes ends the process): ctypes calls go to
antman_torch_try_malloc, which returns NULL instead, and the exception is checked from C++ (a
small program built with g++ that calls the built library as PyTorch does) and, where a Python
with torch is at hand ($TF_ANTMAN_TORCH_PYTHON), through torch itself on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.torch.python_with_torch import torch_python
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


def test_refusals_of_try_malloc_return_null_and_are_counted(lib: object) -> None:
    mem = make(lib, host=8 * MiB)
    assert mem.malloc(0) == 0  # empty tensors: PyTorch passes 0
    assert mem.failures() == 0
    assert mem.malloc(40 * MiB) == 0  # over the limit and over the host cap
    assert lib.antman_torch_try_malloc(MiB, 5, None) is None  # no core for device 5
    assert lib.antman_torch_try_malloc(MiB, -1, None) is None
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


# ---- the PyTorch-facing entry point: out of memory is an exception, never NULL ---------------

# Calls the built library as PyTorch does: dlopen, the alloc function's address wrapped in a
# std::function (CUDAPluggableAllocator::malloc), and whatever comes back used unchecked.
CALLER = r"""
#include <dlfcn.h>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include "cc/torch/allocator_shim.h"

template <typename F> F Sym(void* h, const char* name) { return reinterpret_cast<F>(dlsym(h, name)); }

int main(int argc, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) { std::printf("{\"error\": \"dlopen\"}\n"); return 2; }
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_EMULATED;
  c.device_capacity = 64 << 20;
  c.limit = 16 << 20;
  c.host_capacity = 0;  // no host fallback
  char err[256] = {0};
  if (Sym<int (*)(const antman_mem_config*, char*, size_t)>(h, "antman_torch_mem_create")(&c, err, sizeof(err)) != 0) {
    std::printf("{\"error\": \"create\"}\n"); return 2;
  }
  std::function<void*(size_t, int, void*)> alloc_fn = Sym<void* (*)(size_t, int, void*)>(h, "antman_torch_malloc");
  auto try_malloc = Sym<void* (*)(ssize_t, int, void*)>(h, "antman_torch_try_malloc");
  auto failures = Sym<uint64_t (*)()>(h, "antman_torch_failures");
  void* kept = alloc_fn(12 << 20, 0, nullptr);
  std::string thrown, no_core;
  long long returned = -1;
  try {
    returned = reinterpret_cast<long long>(alloc_fn(8 << 20, 0, nullptr));  // 20 MiB > 16 MiB
  } catch (const std::exception& e) { thrown = e.what(); }
  try { alloc_fn(1 << 20, 5, nullptr); } catch (const std::exception& e) { no_core = e.what(); }
  const bool try_null = try_malloc(8 << 20, 0, nullptr) == nullptr;
  std::printf("{\"kept\": %d, \"returned\": %lld, \"try_null\": %d, \"failures\": %llu}\n", kept != nullptr,
              returned, try_null, static_cast<unsigned long long>(failures()));
  std::printf("%s\n%s\n", thrown.c_str(), no_core.c_str());
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_the_pytorch_entry_point_throws_out_of_memory_and_try_malloc_returns_null(tmp_path: Path) -> None:
    if not _shim.shim_path().exists():
        pytest.skip(f"{_shim.shim_path()} is not built (python setup.py build_native)")
    src = tmp_path / "caller.cc"
    src.write_text(CALLER)
    exe = tmp_path / "caller"
    subprocess.run(["g++", "-std=c++17", f"-I{REPO}", str(src), "-o", str(exe), "-ldl"], check=True,
                   capture_output=True, timeout=300)
    proc = subprocess.run([str(exe), str(_shim.shim_path())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc {proc.returncode} (an exception that was not caught ends in SIGABRT)\n" \
                                 f"{proc.stdout}\n{proc.stderr}"
    first, thrown, no_core = proc.stdout.splitlines()[:3]
    out = json.loads(first)
    # NULL used to come back here: PyTorch made it a tensor at address 0, and the next kernel
    # faulted with an illegal memory access that poisoned CUDA for the whole process.
    assert out["kept"] == 1 and out["returned"] == -1
    assert thrown.startswith("tf-antman: CUDA out of memory. Tried to allocate 8.00 MiB (8388608 bytes) on device 0")
    assert "limit 16.00 MiB (16777216 bytes)" in thrown and "Host fallback: none" in thrown
    assert no_core.startswith("tf-antman: no memory core for CUDA device 5") and "serves device(s) 0" in no_core
    assert out["try_null"] == 1 and out["failures"] == 3  # counted as before, and reported on stderr
    assert "antman_torch_malloc(8388608 bytes, device 0) failed" in proc.stderr


# A CPU stand-in for CUDAPluggableAllocator (torch/csrc/cuda/CUDAPluggableAllocator.cpp): PyTorch's
# CPU wheel has no pluggable CUDA allocator, so this installs one for CPU tensors that calls
# antman_torch_malloc exactly as that class does (a std::function over the address, the pointer
# put in the DataPtr unchecked), and Python allocates tensors through it.
PROBE = r"""
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>
#include <functional>

namespace {
std::function<void*(size_t, int, void*)> g_alloc;
std::function<void(void*, size_t, int, void*)> g_free;
c10::Allocator* g_previous = nullptr;

void Delete(void* p) { g_free(p, 0, 0, nullptr); }

struct Pluggable final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* r = g_alloc(n, 0, nullptr);
    return {r, r, &Delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
Pluggable g_pluggable;
}  // namespace

extern "C" int antman_probe_install(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return 1;
  g_alloc = reinterpret_cast<void* (*)(size_t, int, void*)>(dlsym(h, "antman_torch_malloc"));
  g_free = reinterpret_cast<void (*)(void*, size_t, int, void*)>(dlsym(h, "antman_torch_free"));
  g_previous = c10::GetAllocator(c10::DeviceType::CPU);
  c10::SetAllocator(c10::DeviceType::CPU, &g_pluggable, 200);
  return 0;
}

extern "C" void antman_probe_uninstall() { c10::SetAllocator(c10::DeviceType::CPU, g_previous, 200); }
"""

PROBE_SCRIPT = """
import ctypes, json, sys
from pathlib import Path
import torch
from torch.utils import cpp_extension
from tf_antman.torch import _shim

shim, src, build = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
mem = _shim.create(_shim.load(shim), shim, "emulated", 0, 64 << 20, 16 << 20, 0)  # no host fallback
so = cpp_extension.load(name="antman_oom_probe", sources=[src], build_directory=build,
                        is_python_module=False)
probe = ctypes.CDLL(so)
assert probe.antman_probe_install(str(shim).encode()) == 0
out = {}
try:
    t = torch.ones(1 << 20)  # 4 MiB, served by the core
    out["in_use"] = mem.mem_stats().in_use
    try:
        torch.empty(32 << 20, dtype=torch.uint8)  # 32 MiB > the 16 MiB limit
        out["raised"] = None
    except Exception as e:
        out["raised"] = [type(e).__name__, str(e)]
    out["goes_on"] = float((t + 1).sum())  # the process is fine after it
    out["failed_allocs"] = mem.mem_stats().failed_allocs
finally:
    probe.antman_probe_uninstall()
print(json.dumps(out))
"""


def test_with_torch_out_of_memory_is_a_runtime_error_the_job_can_catch(tmp_path: Path) -> None:
    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    if not _shim.shim_path().exists():
        pytest.skip(f"{_shim.shim_path()} is not built (python setup.py build_native)")
    src = tmp_path / "probe.cpp"
    src.write_text(PROBE)
    build = tmp_path / "build"
    build.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(PYTHONPATH=str(REPO), PATH=os.pathsep.join([str(Path(python).parent), env.get("PATH", "")]))
    proc = subprocess.run([python, "-c", PROBE_SCRIPT, str(_shim.shim_path()), str(src), str(build)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["in_use"] >= 4 * MiB  # the tensors really came from the core
    kind, message = out["raised"]
    assert kind == "RuntimeError"  # not torch.OutOfMemoryError: pytorch/pytorch#133280
    assert message.startswith("tf-antman: CUDA out of memory. Tried to allocate 32.00 MiB (33554432 bytes)")
    assert "limit 16.00 MiB" in message
    assert out["goes_on"] == 2.0 * (1 << 20) and out["failed_allocs"] == 1


def test_memory_stats_under_pytorch_keys_and_peak_reset(lib: object) -> None:
    # What torch.cuda.memory_stats() / memory_allocated() / max_memory_allocated() /
    # memory_reserved() / reset_peak_memory_stats() read under the extension (cc/torch/torch_stats.h).
    mem = make(lib)
    a = mem.malloc(3 * MiB)
    b = mem.malloc(MiB)
    s = _shim.torch_memory_stats(mem.torch_stats())
    assert s["allocated_bytes.all.current"] >= 4 * MiB and s["requested_bytes.all.current"] == 4 * MiB
    assert s["allocation.all.current"] == 2 and s["allocation.all.allocated"] == 2
    assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
    assert s["allocated_bytes.small_pool.current"] == 0 and s["num_ooms"] == 0
    mem.free(a, 3 * MiB)
    s = _shim.torch_memory_stats(mem.torch_stats())
    assert s["requested_bytes.all.current"] == MiB and s["requested_bytes.all.peak"] == 4 * MiB
    mem.reset_peaks()
    assert _shim.torch_memory_stats(mem.torch_stats())["requested_bytes.all.peak"] == MiB
    mem.free(b, MiB)
    assert mem.empty_cache() == 0 and mem.mem_stats().reserved == 0  # every region given back


def test_record_stream_of_an_unknown_block_is_refused(lib: object) -> None:
    mem = make(lib)
    a = mem.malloc(MiB, stream=0x10)
    assert mem.record_stream(a, 0x20)
    mem.free(a, MiB, stream=0x10)
    assert not mem.record_stream(a, 0x20)  # freed: nothing to record
    assert lib.antman_torch_record_stream(a, 7, 0x20) == 1  # no core for device 7
