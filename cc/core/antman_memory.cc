// The C API of the memory core: validation of the config at the edge, then thin forwarding to
// UniversalAllocator.
#include "cc/core/antman_memory.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "cc/core/backend.h"
#include "cc/core/universal.h"

struct antman_mem {
  antman::Backend backend;  // sources outlive the allocator: declared first, destroyed last
  std::unique_ptr<antman::UniversalAllocator> allocator;
};

namespace {

// Regions smaller than a chunk are meaningless; larger than 1 TiB is surely a units mistake.
constexpr uint64_t kMaxMinRegion = uint64_t{1} << 40;
constexpr uint64_t kDefaultHostIdleReleaseMs = 10000;
constexpr uint64_t kMaxHostIdleReleaseMs = 86400000;  // one day

void SetError(char* err, size_t errlen, const std::string& message) {
  if (err == nullptr || errlen == 0) return;
  std::snprintf(err, errlen, "%s", message.c_str());
}

std::string Validate(const antman_mem_config& c) {
  if (c.backend != ANTMAN_BACKEND_EMULATED && c.backend != ANTMAN_BACKEND_CUDA) {
    return "backend: " + std::to_string(c.backend) +
           " is not one of 0 (ANTMAN_BACKEND_EMULATED), 1 (ANTMAN_BACKEND_CUDA)";
  }
  if (c.device_ordinal < 0) {
    return "device_ordinal: " + std::to_string(c.device_ordinal) + " must be >= 0";
  }
  if (c.backend == ANTMAN_BACKEND_EMULATED && c.device_capacity == 0) {
    return "device_capacity: must be > 0 bytes for the emulated backend";
  }
  if (c.min_region != 0 &&
      (c.min_region < antman::kMinChunkBytes || c.min_region > kMaxMinRegion ||
       c.min_region % antman::kMinChunkBytes != 0)) {
    return "min_region: " + std::to_string(c.min_region) +
           " must be 0 (2 MiB) or a multiple of 256 in [256, 2^40] bytes";
  }
  if (c.host_idle_release_ms > kMaxHostIdleReleaseMs) {
    return "host_idle_release_ms: " + std::to_string(c.host_idle_release_ms) +
           " must be 0 (10000 ms) or in [1, 86400000] ms";
  }
  return "";
}

}  // namespace

extern "C" {

int antman_mem_create(const antman_mem_config* config, antman_mem** out, char* err,
                      size_t errlen) {
  if (out == nullptr) {
    SetError(err, errlen, "out: must not be NULL");
    return 1;
  }
  *out = nullptr;
  if (config == nullptr) {
    SetError(err, errlen, "config: must not be NULL");
    return 1;
  }
  const std::string invalid = Validate(*config);
  if (!invalid.empty()) {
    SetError(err, errlen, invalid);
    return 1;
  }
  auto mem = std::make_unique<antman_mem>();
  std::string why;
  const bool ok = config->backend == ANTMAN_BACKEND_CUDA
                      ? antman::MakeCudaBackend(*config, &mem->backend, &why)
                      : antman::MakeEmulatedBackend(*config, &mem->backend, &why);
  if (!ok) {
    SetError(err, errlen, why);
    return 2;
  }
  antman::UniversalOptions options;
  options.device_capacity = mem->backend.device_capacity;
  options.limit = config->limit != 0 ? config->limit : mem->backend.device_capacity;
  options.host_capacity = config->host_capacity;
  if (config->min_region != 0) options.min_region = config->min_region;
  options.max_region = std::max<size_t>(options.min_region, antman::kDefaultMaxRegion);
  const uint64_t idle_ms =
      config->host_idle_release_ms != 0 ? config->host_idle_release_ms : kDefaultHostIdleReleaseMs;
  options.host_idle_release_ns = idle_ms * 1000 * 1000;
  mem->allocator = std::make_unique<antman::UniversalAllocator>(
      mem->backend.device.get(), mem->backend.host.get(), options);
  *out = mem.release();
  return 0;
}

void antman_mem_destroy(antman_mem* mem) {
  if (mem == nullptr) return;
  mem->allocator.reset();
  delete mem;
}

void* antman_mem_alloc(antman_mem* mem, size_t alignment, size_t bytes) {
  if (mem == nullptr) return nullptr;
  return mem->allocator->Allocate(alignment, bytes);
}

void* antman_mem_alloc_device_only(antman_mem* mem, size_t alignment, size_t bytes) {
  if (mem == nullptr) return nullptr;
  return mem->allocator->AllocateDeviceOnly(alignment, bytes);
}

void antman_mem_reset_peaks(antman_mem* mem) {
  if (mem != nullptr) mem->allocator->ResetPeaks();
}

void antman_mem_free(antman_mem* mem, void* ptr) {
  if (mem == nullptr || ptr == nullptr) return;
  if (!mem->allocator->Free(ptr)) {
    std::fprintf(stderr, "antman_mem_free: %p is not a live block of this allocator (ignored)\n",
                 ptr);
  }
}

int antman_mem_is_host(antman_mem* mem, const void* ptr) {
  return mem == nullptr ? -1 : mem->allocator->IsHost(ptr);
}

size_t antman_mem_allocated_size(antman_mem* mem, const void* ptr) {
  if (mem == nullptr) return 0;
  return mem->allocator->AllocatedSize(ptr);
}

uint64_t antman_mem_set_limit(antman_mem* mem, uint64_t limit, uint64_t* unfreed) {
  if (unfreed != nullptr) *unfreed = 0;
  if (mem == nullptr) return 0;
  const antman::ShrinkResult r = mem->allocator->SetLimit(limit);
  if (unfreed != nullptr) *unfreed = r.unfreed;
  return r.bytes_freed;
}

void antman_mem_request_limit(antman_mem* mem, uint64_t limit) {
  if (mem == nullptr) return;
  mem->allocator->RequestLimit(limit);
}

uint64_t antman_mem_release_cached(antman_mem* mem) {
  return mem == nullptr ? 0 : mem->allocator->ReleaseCached();
}

void antman_mem_step_boundary(antman_mem* mem) {
  if (mem != nullptr) mem->allocator->StepBoundary();
}

void antman_mem_get_stats(antman_mem* mem, antman_mem_stats* out) {
  if (out == nullptr) return;
  if (mem == nullptr) {
    *out = antman_mem_stats{};
    return;
  }
  mem->allocator->GetStats(out);
}

size_t antman_mem_get_ext_stats(antman_mem* mem, antman_mem_ext_stats* out, size_t size) {
  if (mem == nullptr || out == nullptr) return 0;
  antman_mem_ext_stats s;
  mem->allocator->GetExtStats(&s);
  const size_t n = std::min(size, sizeof(s));
  std::memcpy(out, &s, n);
  return n;
}

int antman_mem_check_invariants(antman_mem* mem, char* err, size_t errlen) {
  if (mem == nullptr) {
    SetError(err, errlen, "mem: must not be NULL");
    return 1;
  }
  const std::string why = mem->allocator->CheckInvariants();
  if (why.empty()) return 0;
  SetError(err, errlen, why);
  return 1;
}

}  // extern "C"
