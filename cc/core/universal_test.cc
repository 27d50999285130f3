#include "cc/core/universal.h"

#include <cstring>
#include <vector>

#include "cc/core/test_check.h"
#include "cc/core/test_region_source.h"

using antman::UniversalAllocator;
using antman::UniversalOptions;
using antman_test::TestRegionSource;

namespace {

constexpr size_t MiB = 1024 * 1024;

UniversalOptions Options(uint64_t limit, uint64_t host_capacity) {
  UniversalOptions o;
  o.device_capacity = 64 * MiB;
  o.limit = limit;
  o.host_capacity = host_capacity;
  o.min_region = MiB;
  return o;
}

antman_mem_stats Stats(const UniversalAllocator& u) {
  antman_mem_stats s;
  u.GetStats(&s);
  return s;
}

}  // namespace

TEST(FallsBackToHostWhenTheDeviceIsAtItsLimit) {
  TestRegionSource device;
  TestRegionSource host;
  UniversalAllocator u(&device, &host, Options(4 * MiB, 8 * MiB));
  std::vector<void*> on_device;
  std::vector<void*> on_host;
  for (int i = 0; i < 6; ++i) {
    void* p = u.Allocate(0, MiB);
    REQUIRE(p != nullptr);
    (device.Holds(p) ? on_device : on_host).push_back(p);
    EXPECT(device.Holds(p) != host.Holds(p));
  }
  EXPECT_EQ(on_device.size(), 4u);
  EXPECT_EQ(on_host.size(), 2u);
  for (void* p : on_device) EXPECT_EQ(u.IsHost(p), 0);
  for (void* p : on_host) {
    EXPECT_EQ(u.IsHost(p), 1);
    EXPECT_EQ(u.IsHost(static_cast<char*>(p) + 4096), 1);  // interior pointers classify too
    std::memset(p, 0xab, MiB);  // host memory really backs it
  }
  int outside = 0;
  EXPECT_EQ(u.IsHost(&outside), -1);

  const antman_mem_stats s = Stats(u);
  EXPECT_EQ(s.in_use, 4 * MiB);
  EXPECT_EQ(s.reserved, 4 * MiB);
  EXPECT_EQ(s.host_in_use, 2 * MiB);
  EXPECT_EQ(s.host_peak, 2 * MiB);
  EXPECT_EQ(s.host_fallbacks, 2u);
  EXPECT_EQ(s.host_bytes_served, 2 * MiB);
  EXPECT_EQ(s.device_allocs, 4u);
  EXPECT_EQ(s.device_bytes_served, 4 * MiB);
  EXPECT_EQ(s.failed_allocs, 0u);
  EXPECT_EQ(s.host_capacity, 8 * MiB);

  for (void* p : on_host) EXPECT(u.Free(p));
  for (void* p : on_device) EXPECT(u.Free(p));
  EXPECT(!u.Free(&outside));
  const antman_mem_stats after = Stats(u);
  EXPECT_EQ(after.in_use, 0u);
  EXPECT_EQ(after.host_in_use, 0u);
  EXPECT_EQ(after.host_peak, 2 * MiB);
  EXPECT_CLEAN(u.CheckInvariants());
}

TEST(HostCapacityBoundsTheFallback) {
  TestRegionSource device;
  TestRegionSource host;
  UniversalAllocator u(&device, &host, Options(2 * MiB, 2 * MiB));
  EXPECT(u.Allocate(0, 2 * MiB) != nullptr);  // device
  EXPECT(u.Allocate(0, 2 * MiB) != nullptr);  // host
  EXPECT(u.Allocate(0, MiB) == nullptr);
  const antman_mem_stats s = Stats(u);
  EXPECT_EQ(s.failed_allocs, 1u);
  EXPECT_EQ(s.host_fallbacks, 1u);
  EXPECT(host.used() <= 2 * MiB);
}

TEST(NoHostFallbackWhenHostCapacityIsZero) {
  TestRegionSource device;
  TestRegionSource host;
  UniversalAllocator u(&device, &host, Options(MiB, 0));
  EXPECT(u.Allocate(0, MiB) != nullptr);
  EXPECT(u.Allocate(0, 256) == nullptr);
  EXPECT_EQ(host.attempts().size(), 0u);
  const antman_mem_stats s = Stats(u);
  EXPECT_EQ(s.failed_allocs, 1u);
  EXPECT_EQ(s.host_capacity, 0u);
}

TEST(PendingLimitAppliesAtTheStepBoundary) {
  TestRegionSource device;
  TestRegionSource host;
  UniversalAllocator u(&device, &host, Options(16 * MiB, 16 * MiB));
  void* a = u.Allocate(0, 4 * MiB);
  void* b = u.Allocate(0, 4 * MiB);
  REQUIRE(a && b);
  EXPECT(u.Free(b));
  u.RequestLimit(8 * MiB);
  u.RequestLimit(MiB);  // the last request wins
  antman_mem_stats s = Stats(u);
  EXPECT_EQ(s.limit, 16 * MiB);
  EXPECT_EQ(s.pending_limit, MiB);
  const uint64_t reserved_before = s.reserved;
  EXPECT(reserved_before > 4 * MiB);

  u.StepBoundary();
  s = Stats(u);
  EXPECT_EQ(s.limit, MiB);
  EXPECT_EQ(s.pending_limit, 0u);
  EXPECT_EQ(s.steps, 1u);
  EXPECT(s.reserved < reserved_before);
  EXPECT(s.reserved >= 4 * MiB);  // a's region stays
  EXPECT_EQ(s.shrink_bytes_freed, reserved_before - s.reserved);
  EXPECT_EQ(s.step_peak_in_use, 4 * MiB);
  EXPECT_EQ(s.step_min_in_use, 4 * MiB);
  // Over the limit now: the next request goes to the host.
  void* c = u.Allocate(0, 2 * MiB);
  EXPECT_EQ(u.IsHost(c), 1);
  EXPECT_EQ(Stats(u).step_host_peak, 2 * MiB);
  u.StepBoundary();
  EXPECT_EQ(Stats(u).limit, MiB);  // no pending request: unchanged
  EXPECT(u.Free(c));
  u.StepBoundary();
  s = Stats(u);
  EXPECT_EQ(s.step_host_peak, 0u);
  EXPECT_EQ(s.host_peak, 2 * MiB);
  EXPECT_EQ(s.steps, 3u);
  EXPECT(u.Free(a));
  EXPECT_CLEAN(u.CheckInvariants());
}

TEST(ReleaseCachedEmptiesBothArenas) {
  TestRegionSource device;
  TestRegionSource host;
  UniversalAllocator u(&device, &host, Options(MiB, 4 * MiB));
  void* d = u.Allocate(0, MiB);
  void* h = u.Allocate(0, MiB);
  REQUIRE(d && h);
  EXPECT_EQ(u.IsHost(h), 1);
  EXPECT(u.Free(d));
  EXPECT(u.Free(h));
  EXPECT_EQ(u.ReleaseCached(), 2 * MiB);  // one 1 MiB region in each arena
  EXPECT_EQ(device.live_regions(), 0u);
  EXPECT_EQ(host.live_regions(), 0u);
  EXPECT_EQ(u.IsHost(h), -1);
}

TEST_MAIN()
