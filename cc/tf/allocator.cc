#include "cc/tf/allocator.h"

#include <cstdio>

namespace antman {
namespace {
thread_local bool t_pending_oom_report = false;
}  // namespace

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
  if (num_bytes == 0) num_bytes = 1;  // TF expects a valid pointer for empty buffers.
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
  tsl::AllocatorStats out;
  out.num_allocs = static_cast<int64_t>(s.device_allocs + s.host_fallbacks);
  out.bytes_in_use = static_cast<int64_t>(s.in_use + s.host_in_use);
  out.peak_bytes_in_use = static_cast<int64_t>(s.peak_in_use);
  out.bytes_reserved = static_cast<int64_t>(s.reserved);
  out.bytes_limit = static_cast<int64_t>(s.limit);
  return out;
}

}  // namespace antman
