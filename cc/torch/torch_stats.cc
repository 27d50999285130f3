// PyTorch's allocator statistics from the core's figures (torch_stats.h).
#include "cc/torch/torch_stats.h"

#include <algorithm>

namespace antman_torch {

namespace {

int64_t I(uint64_t v) { return static_cast<int64_t>(v); }

antman_torch_stat Stat(uint64_t current, uint64_t peak, uint64_t allocated, uint64_t freed) {
  return {I(current), I(std::max(current, peak)), I(allocated), I(freed)};
}

}  // namespace

antman_torch_device_stats MapTorchStats(const StreamCacheStats& c, const antman_mem_stats& core,
                                        const antman_mem_ext_stats& ext) {
  antman_torch_device_stats s{};
  s.allocation = Stat(c.live_blocks, c.peak_live_blocks, c.allocs, c.frees);
  s.allocated_bytes = Stat(c.live_bytes, c.peak_live_bytes, c.alloc_bytes, c.free_bytes);
  s.requested_bytes = Stat(c.live_requested, c.peak_live_requested, c.alloc_requested, c.free_requested);
  // Active: PyTorch counts a freed block its streams may still use as active until its events
  // complete; so does the cache (kept blocks). Its peak is not tracked apart: the live peak
  // plus what is kept now is a lower bound, and never below current.
  s.active = Stat(c.live_blocks + c.kept_blocks, c.peak_live_blocks, c.allocs, c.frees);
  s.active_bytes = Stat(c.live_bytes + c.kept_bytes, c.peak_live_bytes, c.alloc_bytes, c.free_bytes);
  // Reserved: everything the core holds for tensors, device regions and pinned host regions
  // alike (a tensor past the limit lives in the latter). The core keeps no peak of it: peak is
  // the current value (documented), and no cumulative counts.
  const uint64_t reserved = core.reserved + ext.host_reserved;
  s.reserved_bytes = Stat(reserved, reserved, 0, 0);
  const uint64_t regions = core.regions + ext.host_regions;
  s.segment = Stat(regions, regions, 0, 0);
  s.num_alloc_retries = I(c.retries + ext.fit_retry_allocs);
  s.num_ooms = I(c.failures);
  s.num_sync_all_streams = I(c.host_waits);
  // num_device_alloc / num_device_free: the core counts blocks, not driver calls: left 0.
  return s;
}

}  // namespace antman_torch
