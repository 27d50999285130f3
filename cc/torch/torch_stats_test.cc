// MapTorchStats: the core's and the cache's figures under PyTorch's DeviceStats fields
// (torch_stats.h), which torch.cuda.memory_stats() reports as "allocated_bytes.all.current" etc.
#include "cc/torch/torch_stats.h"

#include <cstdio>

namespace {

int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

void TestFieldByField() {
  antman_torch::StreamCacheStats c;
  c.live_blocks = 3;
  c.live_bytes = 3000;
  c.live_requested = 2900;
  c.peak_live_blocks = 5;
  c.peak_live_bytes = 7000;
  c.peak_live_requested = 6800;
  c.allocs = 10;
  c.frees = 7;
  c.alloc_bytes = 10000;
  c.free_bytes = 7000;
  c.alloc_requested = 9500;
  c.free_requested = 6600;
  c.kept_blocks = 2;
  c.kept_bytes = 512;
  c.retries = 1;
  c.failures = 4;
  c.host_waits = 6;
  antman_mem_stats core{};
  core.reserved = 1 << 20;
  core.regions = 2;
  core.in_use = 3512;  // the core counts kept blocks as in use; PyTorch must not
  antman_mem_ext_stats ext{};
  ext.host_reserved = 1 << 21;
  ext.host_regions = 1;
  ext.fit_retry_allocs = 2;

  const antman_torch_device_stats s = antman_torch::MapTorchStats(c, core, ext);
  CHECK(s.allocated_bytes.current == 3000 && s.allocated_bytes.peak == 7000);
  CHECK(s.allocated_bytes.allocated == 10000 && s.allocated_bytes.freed == 7000);
  CHECK(s.requested_bytes.current == 2900 && s.requested_bytes.peak == 6800);
  CHECK(s.allocation.current == 3 && s.allocation.peak == 5 && s.allocation.allocated == 10);
  CHECK(s.active.current == 5 && s.active_bytes.current == 3512);  // live + kept
  CHECK(s.reserved_bytes.current == (1 << 20) + (1 << 21));        // device + host regions
  CHECK(s.reserved_bytes.peak == s.reserved_bytes.current);
  CHECK(s.segment.current == 3);
  CHECK(s.num_alloc_retries == 3 && s.num_ooms == 4 && s.num_sync_all_streams == 6);
  CHECK(s.inactive_split.current == 0 && s.num_device_alloc == 0);
}

void TestAPeakIsNeverBelowCurrent() {
  antman_torch::StreamCacheStats c;
  c.live_bytes = 100;  // a peak reset races an allocation: peak read as 0
  c.kept_bytes = 50;
  const antman_torch_device_stats s = antman_torch::MapTorchStats(c, antman_mem_stats{}, antman_mem_ext_stats{});
  CHECK(s.allocated_bytes.peak == 100);
  CHECK(s.active_bytes.peak == 150);
}

}  // namespace

int main() {
  TestFieldByField();
  TestAPeakIsNeverBelowCurrent();
  std::printf("torch_stats_test: %d failures\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
