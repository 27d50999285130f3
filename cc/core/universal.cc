#include "cc/core/universal.h"

#include <algorithm>

namespace antman {

UniversalAllocator::UniversalAllocator(RegionSource* device, RegionSource* host,
                                       UniversalOptions options)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : &SteadyNowNs),
      device_(device,
              BfcOptions{options.limit, options.min_region, options.max_region, options.clock}) {
  if (host != nullptr && options.host_capacity > 0) {
    host_ = std::make_unique<Bfc>(host, BfcOptions{options.host_capacity, options.min_region,
                                                   options.max_region, options.clock});
  }
}

void UniversalAllocator::MaybeReleaseIdleHost() {
  if (host_ == nullptr) return;
  const uint64_t now = clock_();
  uint64_t next = next_idle_check_ns_.load(std::memory_order_relaxed);
  if (now < next) return;
  const uint64_t interval = std::max<uint64_t>(options_.host_idle_release_ns / 4, 1);
  // One thread does the scan; the others go on.
  if (!next_idle_check_ns_.compare_exchange_strong(next, now + interval)) return;
  host_->ReleaseIdle(options_.host_idle_release_ns);
}

void UniversalAllocator::AddInUse(uint64_t bytes) {
  const uint64_t now = total_in_use_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  uint64_t peak = peak_total_.load(std::memory_order_relaxed);
  while (now > peak && !peak_total_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void* UniversalAllocator::AllocateOnDevice(size_t alignment, size_t bytes) {
  size_t chunk = 0;
  void* p = device_.Allocate(alignment, bytes, &chunk);
  if (p != nullptr) AddInUse(chunk);
  return p;
}

void* UniversalAllocator::Allocate(size_t alignment, size_t bytes) {
  void* p = AllocateOnDevice(alignment, bytes);
  if (p != nullptr) return p;
  if (bytes == 0) return nullptr;
  if (host_ != nullptr) {
    // No idle release here: unpinning host memory inside an allocation (cuMemFreeHost)
    // synchronises the device; it waits for the step boundary.
    size_t chunk = 0;
    p = host_->Allocate(alignment, bytes, &chunk);
    if (p != nullptr) {
      host_fallbacks_.fetch_add(1, std::memory_order_relaxed);
      host_bytes_served_.fetch_add(chunk, std::memory_order_relaxed);
      AddInUse(chunk);
      return p;
    }
  }
  failed_allocs_.fetch_add(1, std::memory_order_relaxed);
  return nullptr;
}

void* UniversalAllocator::AllocateDeviceOnly(size_t alignment, size_t bytes) {
  void* p = AllocateOnDevice(alignment, bytes);
  if (p == nullptr && bytes != 0) device_only_failures_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

bool UniversalAllocator::Free(void* ptr) {
  size_t chunk = 0;
  if (!device_.Free(ptr, &chunk) && (host_ == nullptr || !host_->Free(ptr, &chunk))) return false;
  total_in_use_.fetch_sub(chunk, std::memory_order_relaxed);
  return true;
}

void UniversalAllocator::ResetPeaks() {
  device_.ResetPeak();
  if (host_ != nullptr) host_->ResetPeak();
  peak_total_.store(total_in_use_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

int UniversalAllocator::IsHost(const void* ptr) const {
  if (host_ != nullptr && host_->Contains(ptr)) return 1;
  if (device_.Contains(ptr)) return 0;
  return -1;
}

size_t UniversalAllocator::AllocatedSize(const void* ptr) const {
  const size_t n = device_.AllocatedSize(ptr);
  if (n != 0 || host_ == nullptr) return n;
  return host_->AllocatedSize(ptr);
}

ShrinkResult UniversalAllocator::SetLimit(uint64_t limit) { return device_.SetLimit(limit); }

void UniversalAllocator::RequestLimit(uint64_t limit) {
  std::lock_guard<std::mutex> lock(pending_mu_);
  has_pending_ = true;
  pending_limit_ = limit;
}

uint64_t UniversalAllocator::ReleaseCached() {
  uint64_t freed = device_.ReleaseCached().bytes_freed;
  if (host_ != nullptr) freed += host_->ReleaseCached().bytes_freed;
  return freed;
}

void UniversalAllocator::StepBoundary() {
  bool apply = false;
  uint64_t limit = 0;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    std::swap(apply, has_pending_);
    limit = pending_limit_;
    pending_limit_ = 0;
  }
  if (apply) device_.SetLimit(limit);  // also gives back what frees queued
  device_.ReleaseDeferred();
  if (host_ != nullptr) host_->ReleaseDeferred();
  MaybeReleaseIdleHost();
  device_.ResetStepStats();
  if (host_ != nullptr) host_->ResetStepStats();
  steps_.fetch_add(1, std::memory_order_relaxed);
}

void UniversalAllocator::GetStats(antman_mem_stats* out) const {
  const BfcStats d = device_.GetStats();
  const BfcStats h = host_ != nullptr ? host_->GetStats() : BfcStats();
  antman_mem_stats s{};
  s.limit = d.limit;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    s.pending_limit = has_pending_ ? pending_limit_ : 0;
  }
  s.device_capacity = options_.device_capacity;
  s.in_use = d.in_use;
  // Held from the driver: regions queued for the next safe point too (the scheduler and the
  // front-ends' memory_reserved must not see memory as returned before it is).
  s.reserved = d.reserved + d.deferred_bytes;
  s.peak_in_use = d.peak_in_use;
  s.step_peak_in_use = d.step_peak_in_use;
  s.step_min_in_use = d.step_min_in_use;
  s.host_in_use = h.in_use;
  s.host_peak = h.peak_in_use;
  s.step_host_peak = h.step_peak_in_use;
  s.host_capacity = host_ != nullptr ? options_.host_capacity : 0;
  s.host_fallbacks = host_fallbacks_.load(std::memory_order_relaxed);
  s.host_bytes_served = host_bytes_served_.load(std::memory_order_relaxed);
  s.device_allocs = d.allocs;
  s.device_bytes_served = d.bytes_served;
  s.failed_allocs = failed_allocs_.load(std::memory_order_relaxed);
  s.regions = d.regions;
  s.shrink_regions_freed = d.shrink_regions_freed;
  s.shrink_bytes_freed = d.shrink_bytes_freed;
  s.last_shrink_ns = d.last_shrink_ns;
  s.last_shrink_unfreed = d.last_shrink_unfreed;
  s.largest_region = d.largest_region;
  s.steps = steps_.load(std::memory_order_relaxed);
  *out = s;
}

void UniversalAllocator::GetExtStats(antman_mem_ext_stats* out) const {
  const BfcStats d = device_.GetStats();
  const BfcStats h = host_ != nullptr ? host_->GetStats() : BfcStats();
  antman_mem_ext_stats s{};
  s.device_pinned = d.pinned;
  s.fit_release_regions = d.fit_release_regions;
  s.fit_release_bytes = d.fit_release_bytes;
  s.fit_retry_allocs = d.fit_retry_allocs;
  s.growth_returns = d.growth_returns;
  s.host_reserved = h.reserved + h.deferred_bytes;
  s.host_regions = h.regions;
  s.host_idle_release_regions = h.idle_release_regions;
  s.host_idle_release_bytes = h.idle_release_bytes;
  s.host_idle_release_ns = options_.host_idle_release_ns;
  s.largest_alloc = std::max(d.largest_alloc, h.largest_alloc);
  // Read current before peak, and never report a peak below it: a reader racing an allocation
  // may see the new total before the peak was raised.
  s.total_in_use = total_in_use_.load(std::memory_order_relaxed);
  s.peak_total_in_use = std::max(peak_total_.load(std::memory_order_relaxed), s.total_in_use);
  s.driver_refusals = d.driver_refusals;
  s.driver_cap = d.driver_cap;
  s.deferred_release_bytes = d.deferred_bytes + h.deferred_bytes;
  s.deferred_release_regions = d.deferred_regions + h.deferred_regions;
  s.deferred_released_bytes = d.deferred_released_bytes + h.deferred_released_bytes;
  s.release_syncs = d.release_syncs + h.release_syncs;
  s.last_release_sync_ns = d.last_release_sync_ns;
  s.device_only_failures = device_only_failures_.load(std::memory_order_relaxed);
  *out = s;
}

std::string UniversalAllocator::CheckInvariants() const {
  std::string err = device_.CheckInvariants();
  if (!err.empty()) return "device: " + err;
  if (host_ != nullptr) {
    err = host_->CheckInvariants();
    if (!err.empty()) return "host: " + err;
  }
  return "";
}

}  // namespace antman
