#include "cc/tf/allocator.h"

#include <cstdio>

namespace antman {
namespace {
thread_local bool t_pending_oom_report = false;
std::atomic<UniversalTfAllocator*> g_first{nullptr};
}  // namespace

UniversalTfAllocator* FirstTfAllocator() { return g_first.load(std::memory_order_acquire); }

void NoteTfAllocator(UniversalTfAllocator* allocator) {
  UniversalTfAllocator* none = nullptr;
  g_first.compare_exchange_strong(none, allocator, std::memory_order_acq_rel);
}

std::string DescribeMemory(antman_mem* mem) {
  antman_mem_stats s;
  antman_mem_get_stats(mem, &s);
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "tf-antman: device in use %llu of limit %llu bytes (reserved %llu, capacity %llu); "
                "host fallback in use %llu of %llu bytes; %llu host fallbacks, %llu failed allocations",
                (unsigned long long)s.in_use, (unsigned long long)s.limit,
                (unsigned long long)s.reserved, (unsigned long long)s.device_capacity,
                (unsigned long long)s.host_in_use, (unsigned long long)s.host_capacity,
                (unsigned long long)s.host_fallbacks, (unsigned long long)s.failed_allocs);
  return buf;
}

std::string UniversalTfAllocator::Name() {
  if (t_pending_oom_report) {
    t_pending_oom_report = false;
    return std::string(kAllocatorName) + " [" + DescribeMemory(mem_) + "]";
  }
  return kAllocatorName;
}

void* UniversalTfAllocator::AllocateRaw(size_t alignment, size_t num_bytes) {
  return AllocateRaw(alignment, num_bytes, tsl::AllocationAttributes());
}

void* UniversalTfAllocator::AllocateRaw(size_t alignment, size_t num_bytes,
                                        const tsl::AllocationAttributes& attr) {
  if (num_bytes == 0) num_bytes = 1;  // TF expects a valid pointer for empty buffers.
  if (!attr.retry_on_failure) {
    // The caller has a fallback for NULL (a smaller algorithm, no autotuning): device memory
    // or nothing, and no OOM report, as TF's BFC allocator does not log these.
    return antman_mem_alloc_device_only(mem_, alignment, num_bytes);
  }
  void* p = antman_mem_alloc(mem_, alignment, num_bytes);
  if (p == nullptr) t_pending_oom_report = true;
  return p;
}

void UniversalTfAllocator::DeallocateRaw(void* ptr) { antman_mem_free(mem_, ptr); }

size_t UniversalTfAllocator::RequestedSize(const void* ptr) const {
  return antman_mem_allocated_size(mem_, ptr);
}

size_t UniversalTfAllocator::AllocatedSize(const void* ptr) const {
  return antman_mem_allocated_size(mem_, ptr);
}

std::optional<tsl::AllocatorStats> UniversalTfAllocator::GetStats() {
  antman_mem_stats s;
  antman_mem_get_stats(mem_, &s);
  // In-use and peak from one read of the extended statistics (peak >= current there).
  antman_mem_ext_stats x{};
  antman_mem_get_ext_stats(mem_, &x, sizeof(x));
  tsl::AllocatorStats out;
  const uint64_t allocs = s.device_allocs + s.host_fallbacks;
  const uint64_t base = allocs_at_clear_.load(std::memory_order_relaxed);
  out.num_allocs = static_cast<int64_t>(allocs >= base ? allocs - base : 0);
  out.bytes_in_use = static_cast<int64_t>(x.total_in_use);
  out.peak_bytes_in_use = static_cast<int64_t>(x.peak_total_in_use);
  out.largest_alloc_size = static_cast<int64_t>(x.largest_alloc);
  out.bytes_reserved = static_cast<int64_t>(s.reserved);
  out.bytes_limit = static_cast<int64_t>(s.limit);
  return out;
}

bool UniversalTfAllocator::ClearStats() {
  antman_mem_stats s;
  antman_mem_get_stats(mem_, &s);
  allocs_at_clear_.store(s.device_allocs + s.host_fallbacks, std::memory_order_relaxed);
  antman_mem_reset_peaks(mem_);
  return true;
}

}  // namespace antman
