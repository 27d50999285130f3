// Universal memory of one device (AntMan §3.1.1, §4.1): the limited device BFC first; when it
// cannot serve a request, a host arena (a second BFC over pinned host memory) capped by the host
// capacity. Pointers are classified by the regions that hold them, so no per-pointer table is kept.
#ifndef TF_ANTMAN_CC_CORE_UNIVERSAL_H_
#define TF_ANTMAN_CC_CORE_UNIVERSAL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/core/bfc.h"
#include "cc/core/region_source.h"

namespace antman {

// Host regions that have had no live block for this long are unpinned and given back (see
// docs/memory-core.md, "Host arena: idle release"). Pinning is slow (hundreds of ms per GiB),
// so a job that spills every step keeps its host regions; 10 s is many steps of any job, yet
// short next to the scheduler's limit changes, after which the pinned memory is no longer needed.
inline constexpr uint64_t kDefaultHostIdleReleaseNs = uint64_t{10} * 1000 * 1000 * 1000;

struct UniversalOptions {
  uint64_t device_capacity = 0;
  uint64_t limit = 0;
  uint64_t host_capacity = 0;  // 0: no host fallback
  size_t min_region = kDefaultMinRegion;
  size_t max_region = kDefaultMaxRegion;
  uint64_t host_idle_release_ns = kDefaultHostIdleReleaseNs;  // > 0
  ClockFn clock = nullptr;  // nullptr: SteadyNowNs
};

class UniversalAllocator {
 public:
  // host may be null when options.host_capacity is 0. Sources must outlive the allocator.
  UniversalAllocator(RegionSource* device, RegionSource* host, UniversalOptions options);

  void* Allocate(size_t alignment, size_t bytes);
  // Device memory or nullptr, never the host arena (fail-fast requests: TF's
  // retry_on_failure=false, cuDNN scratch, autotuning).
  void* AllocateDeviceOnly(size_t alignment, size_t bytes);
  // false if ptr is not a live block of either arena.
  bool Free(void* ptr);
  // 1 host, 0 device, -1 neither (by region address range; interior pointers classify too).
  int IsHost(const void* ptr) const;
  size_t AllocatedSize(const void* ptr) const;

  ShrinkResult SetLimit(uint64_t limit);
  void RequestLimit(uint64_t limit);
  // Device and host arenas; returns the bytes freed in both.
  uint64_t ReleaseCached();
  // The safe point: applies a pending limit, gives back the regions frees queued (device and
  // host, after the sources' Quiesce) and host regions idle for host_idle_release_ns (checked at
  // most every quarter of that time). Allocations and frees never return memory to a source,
  // except an allocation's own fit release (docs/memory-core.md, "When memory goes back").
  void StepBoundary();
  // Peaks (device, host, total) and largest_alloc start again from the current values.
  void ResetPeaks();

  void GetStats(antman_mem_stats* out) const;
  void GetExtStats(antman_mem_ext_stats* out) const;
  const Bfc& device() const { return device_; }
  const Bfc* host() const { return host_.get(); }
  std::string CheckInvariants() const;

 private:
  // The device branch of Allocate and AllocateDeviceOnly: the device Bfc's block, counted in
  // use; nullptr (nothing counted) when the device cannot serve it. What a refusal means is the
  // caller's: host fallback or a device-only failure.
  void* AllocateOnDevice(size_t alignment, size_t bytes);
  void MaybeReleaseIdleHost();

  const UniversalOptions options_;
  const ClockFn clock_;
  Bfc device_;
  std::unique_ptr<Bfc> host_;  // null without fallback

  mutable std::mutex pending_mu_;
  bool has_pending_ = false;
  uint64_t pending_limit_ = 0;

  std::atomic<uint64_t> host_fallbacks_{0};
  std::atomic<uint64_t> host_bytes_served_{0};
  std::atomic<uint64_t> failed_allocs_{0};
  std::atomic<uint64_t> steps_{0};
  std::atomic<uint64_t> next_idle_check_ns_{0};
  std::atomic<uint64_t> total_in_use_{0};   // device + host bytes in live blocks
  std::atomic<uint64_t> peak_total_{0};
  std::atomic<uint64_t> device_only_failures_{0};
  void AddInUse(uint64_t bytes);
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_UNIVERSAL_H_
