// tf-antman memory for PyTorch: CUDAPluggableAllocator's alloc/free over the memory core.
// The interface and its contract: allocator_shim.h.
#include "cc/torch/allocator_shim.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cc/torch/core_source.h"
#include "cc/torch/cuda_events.h"
#include "cc/torch/stream_ordered.h"

namespace {

using antman_torch::StreamOrderedCache;

// The emulated backend has no asynchronous work: every event is done when recorded.
class ImmediateEvents : public antman_torch::StreamEvents {
 public:
  antman_torch::Event Record(antman_torch::Stream) override { return this; }
  bool Done(antman_torch::Event) override { return true; }
  void Wait(antman_torch::Event) override {}
  void Synchronize(antman_torch::Stream) override {}
  void Release(antman_torch::Event) override {}
};

// One device served: its memory core and the stream-ordered cache over it (stream_ordered.h).
struct Device {
  explicit Device(antman_mem* m, bool cuda, int ordinal)
      : mem(m), source(m),
        events(cuda ? std::unique_ptr<antman_torch::StreamEvents>(
                          new antman_torch::CudaEvents(ordinal, "libcuda.so.1"))
                    : std::unique_ptr<antman_torch::StreamEvents>(new ImmediateEvents())),
        cache(&source, events.get()) {}
  antman_mem* const mem;  // kept here only: published with the Device (MemFor)
  antman_torch::CoreSource source;
  std::unique_ptr<antman_torch::StreamEvents> events;
  StreamOrderedCache cache;
};

// Read on every allocation without a lock; written under g_create_mu at start and in tests.
std::atomic<Device*> g_dev[ANTMAN_TORCH_MAX_DEVICES];
std::mutex g_create_mu;
std::atomic<uint64_t> g_failures{0};
constexpr uint64_t kReportedFailures = 8;  // then only counted: a failing job must not flood logs

void SetError(char* err, size_t errlen, const std::string& message) {
  if (err == nullptr || errlen == 0) return;
  std::snprintf(err, errlen, "%s", message.c_str());
}

Device* DeviceFor(int device) {
  if (device < 0 || device >= ANTMAN_TORCH_MAX_DEVICES) return nullptr;
  return g_dev[device].load(std::memory_order_acquire);
}

antman_mem* MemFor(int device) {
  Device* dev = DeviceFor(device);
  return dev != nullptr ? dev->mem : nullptr;
}

void ReportFailure(const char* fn, const char* what, ssize_t size, int device) noexcept {
  const uint64_t n = g_failures.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n > kReportedFailures) return;
  std::fprintf(stderr, "tf-antman: %s(%lld bytes, device %d) failed: %s%s\n", fn,
               static_cast<long long>(size), device, what,  // NOLINT(runtime/int)
               n == kReportedFailures ? " (further failures are only counted)" : "");
}

enum class Refusal { kNone, kNoCore, kOutOfMemory };

// One request (size > 0) of either entry point: the block, or NULL with why (counted, reported).
// Not noexcept: an exception from inside the core (std::bad_alloc of its own bookkeeping) goes
// on to PyTorch from antman_torch_malloc; antman_torch_try_malloc turns it into NULL.
void* Serve(const char* fn, ssize_t size, int device, void* stream, Refusal* why) {
  Device* dev = DeviceFor(device);
  if (dev == nullptr) {
    *why = Refusal::kNoCore;
    ReportFailure(fn, "no tf-antman memory core for this device", size, device);
    return nullptr;
  }
  void* p = dev->cache.Malloc(static_cast<size_t>(size), stream);
  if (p == nullptr) {
    *why = Refusal::kOutOfMemory;
    ReportFailure(fn, "neither device memory (at its limit) nor the host fallback could serve it",
                  size, device);
    return nullptr;
  }
  *why = Refusal::kNone;
  return p;
}

std::string Bytes(uint64_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB (%llu bytes)", static_cast<double>(n) / (1 << 20),
                static_cast<unsigned long long>(n));  // NOLINT(runtime/int)
  return buf;
}

// The message of the exception antman_torch_malloc throws. It starts as PyTorch's own
// out-of-memory message does ("CUDA out of memory. Tried to allocate ..."), so code that looks
// for that text in a RuntimeError recognises it.
std::string RefusalMessage(Refusal why, ssize_t size, int device) {
  const uint64_t bytes = static_cast<uint64_t>(size);
  if (why == Refusal::kNoCore) {
    std::string served;
    for (int d = 0; d < ANTMAN_TORCH_MAX_DEVICES; ++d) {
      if (DeviceFor(d) == nullptr) continue;
      served += (served.empty() ? "" : ", ") + std::to_string(d);
    }
    return "tf-antman: no memory core for CUDA device " + std::to_string(device) +
           ": cannot allocate " + Bytes(bytes) + " there (tf-antman serves device(s) " +
           (served.empty() ? std::string("none") : served) +
           " in this process; a job under tf-antman uses the one device it was given)";
  }
  std::string msg = "tf-antman: CUDA out of memory. Tried to allocate " + Bytes(bytes) +
                    " on device " + std::to_string(device) + ": neither device memory nor the "
                    "host fallback can serve it";
  antman_mem* mem = MemFor(device);
  if (mem != nullptr) {
    antman_mem_stats s{};
    antman_mem_get_stats(mem, &s);
    msg += ". Device: limit " + Bytes(s.limit) + ", " + Bytes(s.in_use) + " in use. Host fallback: ";
    msg += s.host_capacity == 0 ? std::string("none (ANTMAN_HOST_MEMORY=0)")
                                : "capacity " + Bytes(s.host_capacity) + ", " +
                                      Bytes(s.host_in_use) + " in use";
  }
  return msg + ". Raise the job's memory limit or ANTMAN_HOST_MEMORY, or use smaller batches.";
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
  if (DeviceFor(device) != nullptr) {
    SetError(err, errlen, "device_ordinal: device " + std::to_string(device) +
                              " already has a memory core in this process");
    return 1;
  }
  antman_mem* mem = nullptr;
  const int rc = antman_mem_create(config, &mem, err, errlen);
  if (rc != 0) return rc;
  g_dev[device].store(new Device(mem, config->backend == ANTMAN_BACKEND_CUDA, device),
                      std::memory_order_release);
  return 0;
}

antman_mem* antman_torch_mem(int device) { return MemFor(device); }

// Throws through extern "C": the library is built with exceptions (g++'s default; nothing in
// cc/torch/BUILD, .bazelrc or bench/gpu/build_torch.sh turns them off) and PyTorch calls this
// through a plain function pointer from C++, so the exception unwinds into PyTorch's frames.
void* antman_torch_malloc(ssize_t size, int device, void* stream) {
  if (size <= 0) return nullptr;
  Refusal why = Refusal::kNone;
  void* p = Serve("antman_torch_malloc", size, device, stream, &why);
  if (p == nullptr) throw std::runtime_error(RefusalMessage(why, size, device));
  return p;
}

void* antman_torch_try_malloc(ssize_t size, int device, void* stream) noexcept {
  if (size <= 0) return nullptr;
  Refusal why = Refusal::kNone;
  try {
    return Serve("antman_torch_try_malloc", size, device, stream, &why);
  } catch (const std::exception& e) {
    ReportFailure("antman_torch_try_malloc", e.what(), size, device);
    return nullptr;
  }
}

// The stream PyTorch passes is the allocation's: the cache knows it already.
void antman_torch_free(void* ptr, ssize_t /*size*/, int device, void* /*stream*/) {
  if (ptr == nullptr) return;
  Device* dev = DeviceFor(device);
  if (dev == nullptr) {
    std::fprintf(stderr, "tf-antman: antman_torch_free(%p, device %d): no memory core (ignored)\n",
                 ptr, device);
    return;
  }
  if (!dev->cache.Free(ptr)) {
    std::fprintf(stderr, "tf-antman: antman_torch_free(%p, device %d): not a block of this "
                 "allocator (ignored)\n", ptr, device);
  }
}

int antman_torch_record_stream(void* ptr, int device, void* stream) {
  Device* dev = DeviceFor(device);
  return dev != nullptr && dev->cache.RecordStream(ptr, stream) ? 0 : 1;
}

uint64_t antman_torch_empty_cache(int device) {
  Device* dev = DeviceFor(device);
  if (dev == nullptr) return 0;
  const uint64_t kept = dev->cache.Drain();
  antman_mem_release_cached(dev->mem);
  return kept;
}

void antman_torch_poll(int device) {
  if (Device* dev = DeviceFor(device)) dev->cache.Poll();
}

int antman_torch_get_stats(int device, antman_torch_device_stats* out) {
  if (out == nullptr) return 1;
  *out = antman_torch_device_stats{};
  Device* dev = DeviceFor(device);
  if (dev == nullptr) return 1;
  antman_mem_stats core{};
  antman_mem_ext_stats ext{};
  antman_mem_get_stats(dev->mem, &core);
  antman_mem_get_ext_stats(dev->mem, &ext, sizeof(ext));
  *out = antman_torch::MapTorchStats(dev->cache.Stats(), core, ext);
  return 0;
}

void antman_torch_reset_peaks(int device) {
  if (Device* dev = DeviceFor(device)) dev->cache.ResetPeaks();
}

void antman_torch_reset_accumulated(int device) {
  if (Device* dev = DeviceFor(device)) dev->cache.ResetAccumulated();
}

uint64_t antman_torch_failures(void) { return g_failures.load(std::memory_order_relaxed); }

void antman_torch_reset_for_tests(void) {
  std::lock_guard<std::mutex> lock(g_create_mu);
  for (int d = 0; d < ANTMAN_TORCH_MAX_DEVICES; ++d) {
    Device* dev = g_dev[d].exchange(nullptr, std::memory_order_acq_rel);
    if (dev == nullptr) continue;
    antman_mem* mem = dev->mem;
    delete dev;  // gives kept blocks back to the core first
    antman_mem_destroy(mem);
  }
  g_failures.store(0, std::memory_order_relaxed);
}

}  // extern "C"
