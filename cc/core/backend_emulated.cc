// Host RAM stands in for device memory, so the allocator, the TensorFlow glue and the scheduler
// can be exercised on machines without a GPU. Regions are anonymous mappings: untouched pages
// cost nothing, and a freed region really goes back to the kernel.
#include <sys/mman.h>

#include <atomic>
#include <cstdio>

#include "cc/core/backend.h"

namespace antman {
namespace {

class MmapRegionSource : public RegionSource {
 public:
  // capacity 0: unbounded (the caller's limit bounds it).
  explicit MmapRegionSource(uint64_t capacity) : capacity_(capacity) {}

  void* AllocRegion(size_t bytes) override {
    if (capacity_ != 0) {
      uint64_t used = used_.load();
      do {
        if (used + bytes > capacity_) return nullptr;
      } while (!used_.compare_exchange_weak(used, used + bytes));
    } else {
      used_.fetch_add(bytes);
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
      used_.fetch_sub(bytes);
      return nullptr;
    }
    return p;
  }

  void FreeRegion(void* ptr, size_t bytes) override {
    if (munmap(ptr, bytes) != 0) std::perror("antman emulated backend: munmap");
    used_.fetch_sub(bytes);
  }

 private:
  const uint64_t capacity_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace

bool MakeEmulatedBackend(const antman_mem_config& config, Backend* out, std::string* err) {
  (void)err;
  out->device = std::make_unique<MmapRegionSource>(config.device_capacity);
  // The host arena's own limit (host_capacity) bounds host memory.
  out->host = std::make_unique<MmapRegionSource>(0);
  out->device_capacity = config.device_capacity;
  return true;
}

}  // namespace antman
