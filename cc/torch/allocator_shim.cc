// tf-antman memory for PyTorch: CUDAPluggableAllocator's alloc/free over the memory core.
// The interface and its contract: allocator_shim.h.
#include "cc/torch/allocator_shim.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace {

// Read on every allocation without a lock; written under g_create_mu at start and in tests.
std::atomic<antman_mem*> g_mem[ANTMAN_TORCH_MAX_DEVICES];
std::mutex g_create_mu;
std::atomic<uint64_t> g_failures{0};
constexpr uint64_t kReportedFailures = 8;  // then only counted: a failing job must not flood logs

void SetError(char* err, size_t errlen, const std::string& message) {
  if (err == nullptr || errlen == 0) return;
  std::snprintf(err, errlen, "%s", message.c_str());
}

antman_mem* MemFor(int device) {
  if (device < 0 || device >= ANTMAN_TORCH_MAX_DEVICES) return nullptr;
  return g_mem[device].load(std::memory_order_acquire);
}

void ReportFailure(const char* what, ssize_t size, int device) {
  const uint64_t n = g_failures.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n > kReportedFailures) return;
  std::fprintf(stderr,
               "tf-antman: antman_torch_malloc(%lld bytes, device %d) failed: %s%s\n",
               static_cast<long long>(size), device, what,  // NOLINT(runtime/int)
               n == kReportedFailures ? " (further failures are only counted)" : "");
}

}  // namespace

extern "C" {

int antman_torch_abi_version(void) { return ANTMAN_TORCH_ABI_VERSION; }

int antman_torch_mem_create(const antman_mem_config* config, char* err, size_t errlen) {
  if (config == nullptr) {
    SetError(err, errlen, "config: must not be NULL");
    return 1;
  }
  const int device = config->device_ordinal;
  if (device < 0 || device >= ANTMAN_TORCH_MAX_DEVICES) {
    SetError(err, errlen, "device_ordinal: " + std::to_string(device) + " is not in [0, " +
                              std::to_string(ANTMAN_TORCH_MAX_DEVICES) + ")");
    return 1;
  }
  std::lock_guard<std::mutex> lock(g_create_mu);
  if (g_mem[device].load(std::memory_order_acquire) != nullptr) {
    SetError(err, errlen, "device_ordinal: device " + std::to_string(device) +
                              " already has a memory core in this process");
    return 1;
  }
  antman_mem* mem = nullptr;
  const int rc = antman_mem_create(config, &mem, err, errlen);
  if (rc != 0) return rc;
  g_mem[device].store(mem, std::memory_order_release);
  return 0;
}

antman_mem* antman_torch_mem(int device) { return MemFor(device); }

void* antman_torch_malloc(ssize_t size, int device, void* /*stream*/) {
  if (size <= 0) return nullptr;
  antman_mem* mem = MemFor(device);
  if (mem == nullptr) {
    ReportFailure("no tf-antman memory core for this device", size, device);
    return nullptr;
  }
  void* p = antman_mem_alloc(mem, ANTMAN_TORCH_ALIGNMENT, static_cast<size_t>(size));
  if (p == nullptr) {
    ReportFailure("neither device memory (at its limit) nor the host fallback could serve it",
                  size, device);
  }
  return p;
}

void antman_torch_free(void* ptr, ssize_t /*size*/, int device, void* /*stream*/) {
  if (ptr == nullptr) return;
  antman_mem* mem = MemFor(device);
  if (mem == nullptr) {
    std::fprintf(stderr, "tf-antman: antman_torch_free(%p, device %d): no memory core (ignored)\n",
                 ptr, device);
    return;
  }
  antman_mem_free(mem, ptr);
}

uint64_t antman_torch_failures(void) { return g_failures.load(std::memory_order_relaxed); }

void antman_torch_reset_for_tests(void) {
  std::lock_guard<std::mutex> lock(g_create_mu);
  for (auto& slot : g_mem) {
    antman_mem* mem = slot.exchange(nullptr, std::memory_order_acq_rel);
    if (mem != nullptr) antman_mem_destroy(mem);
  }
  g_failures.store(0, std::memory_order_relaxed);
}

}  // extern "C"
