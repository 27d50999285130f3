// The shim's two allocation entry points on the emulated backend: antman_torch_malloc (the one
// PyTorch is given) throws a C++ exception that says "out of memory" where it used to return NULL
// (PyTorch wraps NULL in a tensor unchecked: an illegal memory access later), and
// antman_torch_try_malloc (for C and ctypes callers) returns NULL. The same calls through the
// built libantman_torch.so, as PyTorch makes them: tests/torch/test_allocator_shim.py.
#include "cc/torch/allocator_shim.h"

#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>

namespace {

// PyTorch calls the alloc function from C++; C and ctypes callers cannot take an exception.
static_assert(!noexcept(antman_torch_malloc(0, 0, nullptr)), "antman_torch_malloc must throw");
static_assert(noexcept(antman_torch_try_malloc(0, 0, nullptr)), "try_malloc must not throw");

constexpr uint64_t MiB = 1024 * 1024;
int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

void MakeCore(int device, uint64_t limit, uint64_t host) {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_EMULATED;
  c.device_ordinal = device;
  c.device_capacity = 64 * MiB;
  c.limit = limit;
  c.host_capacity = host;
  char err[256] = {0};
  const int rc = antman_torch_mem_create(&c, err, sizeof(err));
  if (rc != 0) std::fprintf(stderr, "antman_torch_mem_create: %s\n", err);
  CHECK(rc == 0);
}

// What antman_torch_malloc threw, called as PyTorch calls it (through a std::function); "" if
// it returned (the block is freed then).
std::string Thrown(ssize_t size, int device) {
  const std::function<void*(size_t, int, void*)> alloc_fn = [](size_t n, int d, void* s) {
    return antman_torch_malloc(static_cast<ssize_t>(n), d, s);
  };
  try {
    void* p = alloc_fn(static_cast<size_t>(size), device, nullptr);
    if (p != nullptr) antman_torch_free(p, size, device, nullptr);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

void OverTheLimitWithoutHostFallbackThrowsOutOfMemory() {
  MakeCore(0, 16 * MiB, 0);
  void* a = antman_torch_malloc(12 * MiB, 0, nullptr);
  CHECK(a != nullptr);
  const std::string what = Thrown(8 * MiB, 0);  // 20 MiB > 16 MiB, and no host fallback
  std::printf("  thrown: %s\n", what.c_str());
  CHECK(Contains(what, "tf-antman: CUDA out of memory. Tried to allocate 8.00 MiB (8388608 bytes)"));
  CHECK(Contains(what, "on device 0"));
  CHECK(Contains(what, "limit 16.00 MiB (16777216 bytes)"));
  CHECK(Contains(what, "Host fallback: none (ANTMAN_HOST_MEMORY=0)"));
  CHECK(antman_torch_failures() == 1);
  antman_mem_stats s{};
  antman_mem_get_stats(antman_torch_mem(0), &s);
  CHECK(s.failed_allocs == 1 && s.in_use >= 12 * MiB);
  antman_torch_free(a, 12 * MiB, 0, nullptr);
  antman_torch_reset_for_tests();
}

void WithAFullHostFallbackTheMessageGivesItsUse() {
  MakeCore(0, 16 * MiB, 8 * MiB);
  void* a = antman_torch_malloc(12 * MiB, 0, nullptr);
  void* b = antman_torch_malloc(6 * MiB, 0, nullptr);  // over the limit: host memory
  CHECK(a != nullptr && b != nullptr);
  const std::string what = Thrown(6 * MiB, 0);  // neither: 18 MiB device, 12 MiB host > 8
  CHECK(Contains(what, "CUDA out of memory. Tried to allocate 6.00 MiB"));
  CHECK(Contains(what, "Host fallback: capacity 8.00 MiB (8388608 bytes)"));
  CHECK(Thrown(2 * MiB, 0).empty());  // still served below both caps
  antman_torch_free(a, 0, 0, nullptr);
  antman_torch_free(b, 0, 0, nullptr);
  antman_torch_reset_for_tests();
}

void TryMallocReturnsNullAndCounts() {
  MakeCore(0, 16 * MiB, 0);
  void* a = antman_torch_try_malloc(12 * MiB, 0, nullptr);
  CHECK(a != nullptr);
  CHECK(antman_torch_try_malloc(8 * MiB, 0, nullptr) == nullptr);
  CHECK(antman_torch_try_malloc(MiB, 5, nullptr) == nullptr);  // no core for device 5
  CHECK(antman_torch_failures() == 2);
  antman_torch_free(a, 12 * MiB, 0, nullptr);
  antman_torch_reset_for_tests();
}

void ADeviceWithoutACoreThrows() {
  MakeCore(2, 16 * MiB, 0);
  std::string what = Thrown(MiB, 5);
  CHECK(Contains(what, "tf-antman: no memory core for CUDA device 5"));
  CHECK(Contains(what, "serves device(s) 2"));
  CHECK(Contains(Thrown(MiB, -1), "no memory core for CUDA device -1"));
  CHECK(Contains(Thrown(MiB, ANTMAN_TORCH_MAX_DEVICES), "no memory core for CUDA device 64"));
  CHECK(antman_torch_failures() == 3);
  antman_torch_reset_for_tests();
  CHECK(Contains(Thrown(MiB, 0), "serves device(s) none"));
  antman_torch_reset_for_tests();
}

void EmptyRequestsAreNullNotErrors() {
  MakeCore(0, 16 * MiB, 0);
  CHECK(Thrown(0, 0).empty());
  CHECK(antman_torch_malloc(0, 0, nullptr) == nullptr);
  CHECK(antman_torch_malloc(-1, 7, nullptr) == nullptr);
  CHECK(antman_torch_try_malloc(0, 0, nullptr) == nullptr);
  CHECK(antman_torch_failures() == 0);
  antman_torch_reset_for_tests();
}

}  // namespace

int main() {
  const struct {
    const char* name;
    void (*fn)();
  } cases[] = {
      {"OverTheLimitWithoutHostFallbackThrowsOutOfMemory",
       OverTheLimitWithoutHostFallbackThrowsOutOfMemory},
      {"WithAFullHostFallbackTheMessageGivesItsUse", WithAFullHostFallbackTheMessageGivesItsUse},
      {"TryMallocReturnsNullAndCounts", TryMallocReturnsNullAndCounts},
      {"ADeviceWithoutACoreThrows", ADeviceWithoutACoreThrows},
      {"EmptyRequestsAreNullNotErrors", EmptyRequestsAreNullNotErrors},
  };
  int failed_cases = 0;
  for (const auto& c : cases) {
    const int before = g_failures;
    std::printf("[ RUN  ] %s\n", c.name);
    try {
      c.fn();
    } catch (const std::exception& e) {  // an exception the case did not expect
      std::fprintf(stderr, "unexpected exception: %s\n", e.what());
      ++g_failures;
      antman_torch_reset_for_tests();
    }
    const bool ok = g_failures == before;
    failed_cases += !ok;
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
  }
  std::printf("%zu cases, %d failed\n", sizeof(cases) / sizeof(cases[0]), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}
