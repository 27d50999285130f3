#include "cc/core/bfc.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "cc/core/test_check.h"
#include "cc/core/test_region_source.h"

using antman::Bfc;
using antman::BfcOptions;
using antman_test::TestRegionSource;

namespace {

constexpr size_t KiB = 1024;
constexpr size_t MiB = 1024 * 1024;

BfcOptions Options(uint64_t limit, size_t min_region, size_t max_region = size_t{1} << 30) {
  BfcOptions o;
  o.limit = limit;
  o.min_region = min_region;
  o.max_region = max_region;
  return o;
}

char* At(void* p, size_t offset) { return static_cast<char*>(p) + offset; }

}  // namespace

TEST(SplitsFromOneRegionAndCoalescesFreedNeighbours) {
  TestRegionSource source;
  Bfc bfc(&source, Options(MiB, MiB));
  void* a = bfc.Allocate(0, 1000);  // rounds to 1024
  void* b = bfc.Allocate(0, 256);
  void* c = bfc.Allocate(0, 5000);  // rounds to 5120
  REQUIRE(a && b && c);
  EXPECT(b == At(a, 1024));
  EXPECT(c == At(b, 256));
  EXPECT_EQ(bfc.GetStats().in_use, 1024u + 256u + 5120u);
  EXPECT_EQ(bfc.GetStats().regions, 1u);
  EXPECT_EQ(bfc.AllocatedSize(a), 1024u);
  EXPECT_CLEAN(bfc.CheckInvariants());

  EXPECT(bfc.Free(b));
  EXPECT_CLEAN(bfc.CheckInvariants());
  EXPECT(bfc.Free(a));  // merges with b's chunk into one 1280-byte hole
  EXPECT_CLEAN(bfc.CheckInvariants());
  // The best fit for 1280 bytes is that hole, not the large tail after c.
  void* d = bfc.Allocate(0, 1280);
  EXPECT(d == a);
  EXPECT(bfc.Free(d));
  EXPECT(bfc.Free(c));
  EXPECT_CLEAN(bfc.CheckInvariants());
  // Everything coalesced back into one chunk that spans the region: a full-region block fits.
  void* whole = bfc.Allocate(0, MiB);
  EXPECT(whole == a);
  EXPECT_EQ(bfc.GetStats().regions, 1u);
  EXPECT(bfc.Free(whole));
  EXPECT_EQ(bfc.GetStats().in_use, 0u);
}

TEST(BestFitPicksTheSmallestHoleThatFits) {
  TestRegionSource source;
  Bfc bfc(&source, Options(MiB, MiB));
  std::vector<void*> p;
  for (size_t size : {2048, 256, 1024, 256, 4096, 256}) p.push_back(bfc.Allocate(0, size));
  for (void* q : p) REQUIRE(q != nullptr);
  EXPECT(bfc.Free(p[0]));  // 2048 hole
  EXPECT(bfc.Free(p[2]));  // 1024 hole
  EXPECT(bfc.Free(p[4]));  // 4096 hole
  EXPECT(bfc.Allocate(0, 1000) == p[2]);
  EXPECT(bfc.Allocate(0, 1500) == p[0]);
  EXPECT(bfc.Allocate(0, 3000) == p[4]);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(SmallRemaindersStayInsideTheBlock) {
  TestRegionSource source;
  Bfc bfc(&source, Options(4 * MiB, MiB));
  void* a = bfc.Allocate(0, MiB - 4096);  // the 4 KiB left is under 1/16: not split off
  REQUIRE(a != nullptr);
  EXPECT_EQ(bfc.AllocatedSize(a), MiB);
  EXPECT_EQ(bfc.GetStats().in_use, MiB);
  void* b = bfc.Allocate(0, MiB + 512 * KiB);  // 2 MiB region: the 512 KiB left is split off
  REQUIRE(b != nullptr);
  EXPECT_EQ(bfc.AllocatedSize(b), MiB + 512 * KiB);
  EXPECT(bfc.Allocate(0, 512 * KiB) != nullptr);
  EXPECT_EQ(bfc.GetStats().in_use, 3 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(LimitCapsReservedBytes) {
  TestRegionSource source;
  Bfc bfc(&source, Options(4 * MiB, MiB));
  int served = 0;
  while (bfc.Allocate(0, 512 * KiB) != nullptr) ++served;
  // Regions of 1 MiB, 2 MiB, then the 1 MiB of room left: 4 MiB, eight 512 KiB blocks.
  EXPECT_EQ(served, 8);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.reserved, 4 * MiB);
  EXPECT_EQ(s.in_use, 4 * MiB);
  EXPECT_EQ(s.failed_allocs, 1u);
  EXPECT_EQ(source.used(), 4 * MiB);
  std::vector<size_t> expected = {MiB, 2 * MiB, MiB};
  EXPECT(source.attempts() == expected);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(RegionsDoubleUpToTheCapAndNeverPastTheLimitRoom) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, MiB, 4 * MiB));
  for (int i = 0; i < 5; ++i) REQUIRE(bfc.Allocate(0, MiB) != nullptr);
  // 1 (full), 2 (two blocks), 4 (two blocks): five blocks in three regions, next would be 4.
  REQUIRE(bfc.Allocate(0, 3 * MiB) != nullptr);
  std::vector<size_t> expected = {MiB, 2 * MiB, 4 * MiB, 4 * MiB};
  EXPECT(source.attempts() == expected);

  TestRegionSource small;
  Bfc tight(&small, Options(2 * MiB + 512 * KiB, MiB));
  REQUIRE(tight.Allocate(0, MiB) != nullptr);
  REQUIRE(tight.Allocate(0, 256) != nullptr);  // wants 2 MiB, gets the 1.5 MiB of room
  std::vector<size_t> tight_expected = {MiB, MiB + 512 * KiB};
  EXPECT(small.attempts() == tight_expected);
  EXPECT_EQ(tight.GetStats().reserved, 2 * MiB + 512 * KiB);
  EXPECT(tight.Allocate(0, 2 * MiB) == nullptr);
}

TEST(SourceFailureRetriesWithASmallerRegion) {
  TestRegionSource source(/*capacity=*/2 * MiB + 512 * KiB);
  Bfc bfc(&source, Options(64 * MiB, MiB));
  REQUIRE(bfc.Allocate(0, MiB) != nullptr);
  void* p = bfc.Allocate(0, MiB + 512 * KiB);  // 2 MiB region does not fit the source
  EXPECT(p != nullptr);
  std::vector<size_t> expected = {MiB, 2 * MiB, MiB + 512 * KiB};
  EXPECT(source.attempts() == expected);
  EXPECT(bfc.Allocate(0, MiB) == nullptr);  // source exhausted
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(ShrinkFreesWholeFreeRegions) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, MiB));
  std::vector<void*> blocks;
  for (int i = 0; i < 12; ++i) blocks.push_back(bfc.Allocate(0, MiB));
  const auto before = bfc.GetStats();
  EXPECT(before.regions >= 3u);
  for (void* b : blocks) EXPECT(bfc.Free(b));
  const auto r = bfc.SetLimit(0);
  EXPECT_EQ(r.bytes_freed, before.reserved);
  EXPECT_EQ(r.regions_freed, before.regions);
  EXPECT_EQ(r.unfreed, 0u);
  const auto after = bfc.GetStats();
  EXPECT_EQ(after.reserved, 0u);
  EXPECT_EQ(after.regions, 0u);
  EXPECT_EQ(after.shrink_bytes_freed, before.reserved);
  EXPECT_EQ(source.live_regions(), 0u);
  EXPECT_EQ(source.bad_frees(), 0u);
  EXPECT(bfc.Allocate(0, 256) == nullptr);  // limit 0: nothing may be reserved
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(ShrinkKeepsRegionsWithLiveBlocksAndReportsUnfreed) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, MiB));
  // One block per region: regions of 1, 2, 4 and 8 MiB.
  void* r1 = bfc.Allocate(0, MiB);
  void* r2 = bfc.Allocate(0, 2 * MiB);
  void* r4 = bfc.Allocate(0, 4 * MiB);
  void* r8 = bfc.Allocate(0, 8 * MiB);
  REQUIRE(r1 && r2 && r4 && r8);
  EXPECT_EQ(bfc.GetStats().regions, 4u);
  std::memset(r1, 0x5a, MiB);
  EXPECT(bfc.Free(r2));
  EXPECT(bfc.Free(r8));

  // 15 MiB reserved, target 14: the smallest free region that covers the excess (2 MiB), not
  // the largest, so the cache does not drop far below the target.
  auto r = bfc.SetLimit(14 * MiB);
  EXPECT_EQ(r.bytes_freed, 2 * MiB);
  EXPECT_EQ(r.unfreed, 0u);
  EXPECT_EQ(bfc.GetStats().reserved, 13 * MiB);
  EXPECT(!source.Holds(r2) && source.Holds(r8));

  r = bfc.SetLimit(0);
  EXPECT_EQ(r.bytes_freed, 8 * MiB);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.reserved, 5 * MiB);
  EXPECT_EQ(r.unfreed, 5 * MiB);
  EXPECT_EQ(s.last_shrink_unfreed, 5 * MiB);
  // Within one region of max(in_use, limit).
  EXPECT(s.reserved - std::max<uint64_t>(s.in_use, s.limit) <= s.largest_region);
  EXPECT(source.Holds(r1) && source.Holds(r4));
  EXPECT_EQ(source.live_regions(), 2u);
  for (size_t i = 0; i < MiB; ++i) {
    if (static_cast<unsigned char*>(r1)[i] != 0x5a) {
      EXPECT(false);
      break;
    }
  }
  // Above the limit nothing more is handed out, not even memory the allocator still holds:
  // the limit bounds live bytes, so the job's next tensors go to the host.
  EXPECT(bfc.Free(r4));
  const uint64_t room = s.limit > bfc.GetStats().in_use ? s.limit - bfc.GetStats().in_use : 0;
  EXPECT(bfc.Allocate(0, room + 256) == nullptr);
  if (room >= 256) EXPECT(bfc.Allocate(0, room) != nullptr);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(RaisingTheLimitLetsItGrowAgain) {
  TestRegionSource source;
  Bfc bfc(&source, Options(2 * MiB, 2 * MiB));
  REQUIRE(bfc.Allocate(0, 2 * MiB) != nullptr);
  EXPECT(bfc.Allocate(0, MiB) == nullptr);
  EXPECT_EQ(bfc.SetLimit(8 * MiB).bytes_freed, 0u);
  void* p = bfc.Allocate(0, MiB);
  EXPECT(p != nullptr);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.limit, 8 * MiB);
  EXPECT_EQ(s.regions, 2u);
  EXPECT(s.reserved > 2 * MiB && s.reserved <= 8 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(ReleaseCachedFreesOnlyWhollyFreeRegions) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, MiB));
  void* keep = bfc.Allocate(0, MiB);
  void* drop = bfc.Allocate(0, 2 * MiB);
  REQUIRE(keep && drop);
  EXPECT(bfc.Free(drop));
  const auto r = bfc.ReleaseCached();
  EXPECT_EQ(r.bytes_freed, 2 * MiB);
  EXPECT_EQ(bfc.GetStats().limit, 64 * MiB);  // the limit is not touched
  EXPECT(source.Holds(keep));
  EXPECT_EQ(source.live_regions(), 1u);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(HonoursAlignmentUpTo4096) {
  TestRegionSource source(0, /*offset=*/256);  // regions are 256- but not 4096-aligned
  Bfc bfc(&source, Options(MiB, MiB));
  void* first = bfc.Allocate(0, 256);
  REQUIRE(first != nullptr);
  EXPECT(reinterpret_cast<uintptr_t>(first) % 4096 != 0);
  for (size_t alignment : {512, 1024, 2048, 4096}) {
    void* p = bfc.Allocate(alignment, 300);
    REQUIRE(p != nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % alignment, 0u);
    EXPECT_EQ(bfc.AllocatedSize(p), 512u);
    EXPECT_CLEAN(bfc.CheckInvariants());
  }
  EXPECT_EQ(bfc.GetStats().in_use, 256u + 4 * 512u);  // skipped heads stay free
  EXPECT(bfc.Allocate(8192, 16) == nullptr);
  EXPECT(bfc.Allocate(3, 16) == nullptr);
  EXPECT(bfc.Allocate(0, 0) == nullptr);
}

TEST(RejectsFreesOfUnknownPointers) {
  TestRegionSource source;
  Bfc bfc(&source, Options(MiB, MiB));
  void* p = bfc.Allocate(0, 4096);
  REQUIRE(p != nullptr);
  int outside = 0;
  EXPECT(!bfc.Free(&outside));
  EXPECT(!bfc.Free(At(p, 256)));  // interior
  EXPECT(!bfc.Free(At(p, 1)));
  EXPECT(bfc.Free(p));
  EXPECT(!bfc.Free(p));  // double free
  EXPECT_EQ(bfc.AllocatedSize(p), 0u);
  EXPECT(bfc.Contains(At(p, 100)));
  EXPECT(!bfc.Contains(&outside));
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(TracksStepAndLifetimePeaks) {
  TestRegionSource source;
  Bfc bfc(&source, Options(16 * MiB, MiB));
  void* a = bfc.Allocate(0, 3 * MiB);
  void* b = bfc.Allocate(0, MiB);
  EXPECT(bfc.Free(a));
  auto s = bfc.GetStats();
  EXPECT_EQ(s.peak_in_use, 4 * MiB);
  EXPECT_EQ(s.step_peak_in_use, 4 * MiB);
  EXPECT_EQ(s.step_min_in_use, 0u);
  EXPECT_EQ(s.allocs, 2u);
  EXPECT_EQ(s.bytes_served, 4 * MiB);
  bfc.ResetStepStats();
  void* c = bfc.Allocate(0, 2 * MiB);
  EXPECT(bfc.Free(b));
  s = bfc.GetStats();
  EXPECT_EQ(s.peak_in_use, 4 * MiB);
  EXPECT_EQ(s.step_peak_in_use, 3 * MiB);
  EXPECT_EQ(s.step_min_in_use, MiB);
  EXPECT(bfc.Free(c));
}

// If the allocator held its lock across a region source call, the helper thread's GetStats
// would block until the call returned; the wait below would then time out (a deadlock guard,
// not a speed requirement).
TEST(DoesNotHoldTheLockAcrossRegionSourceCalls) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, MiB));
  int calls = 0;
  int blocked = 0;
  source.on_call = [&] {
    ++calls;
    auto f = std::async(std::launch::async, [&] { return bfc.GetStats().limit; });
    if (f.wait_for(std::chrono::seconds(20)) != std::future_status::ready) ++blocked;
    else f.get();
  };
  void* p = bfc.Allocate(0, MiB);
  EXPECT(p != nullptr);
  EXPECT(bfc.Free(p));
  EXPECT_EQ(bfc.SetLimit(0).regions_freed, 1u);
  source.on_call = nullptr;
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(blocked, 0);
}

// A region being fetched (lock dropped) already counts against the limit: a second grower that
// runs meanwhile must not push reserved above it.
TEST(ConcurrentGrowersStayWithinTheLimit) {
  TestRegionSource source;
  Bfc bfc(&source, Options(2 * MiB, 2 * MiB));
  void* second = reinterpret_cast<void*>(1);
  bool once = false;
  source.on_call = [&] {
    if (once) return;
    once = true;
    std::thread other([&] { second = bfc.Allocate(0, MiB); });
    other.join();
  };
  void* first = bfc.Allocate(0, MiB + 512 * KiB);
  source.on_call = nullptr;
  EXPECT(first != nullptr);
  EXPECT(second == nullptr);
  EXPECT_EQ(source.attempts().size(), 1u);
  EXPECT_EQ(bfc.GetStats().reserved, 2 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST(RandomOperationsKeepInvariantsAndContents) {
  TestRegionSource source;
  Bfc bfc(&source, Options(8 * MiB, 256 * KiB, 2 * MiB));
  std::mt19937_64 rng(7);
  struct Live {
    unsigned char* p;
    size_t n;
    unsigned char tag;
  };
  std::vector<Live> live;
  uint64_t live_bytes = 0;
  for (int op = 0; op < 4000; ++op) {
    const int kind = static_cast<int>(rng() % 100);
    if (kind < 50) {
      const size_t n = 1 + rng() % (rng() % 8 == 0 ? 512 * KiB : 8 * KiB);
      const size_t alignment = size_t{1} << (rng() % 13);
      auto* p = static_cast<unsigned char*>(bfc.Allocate(alignment, n));
      if (p != nullptr) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % alignment, 0u);
        const auto tag = static_cast<unsigned char>(op);
        std::memset(p, tag, n);
        live.push_back({p, n, tag});
        live_bytes += bfc.AllocatedSize(p);
      }
    } else if (kind < 90 && !live.empty()) {
      const size_t i = rng() % live.size();
      const Live l = live[i];
      for (size_t k = 0; k < l.n; ++k) {
        if (l.p[k] != l.tag) {
          EXPECT(false && "live block clobbered");
          break;
        }
      }
      live_bytes -= bfc.AllocatedSize(l.p);
      EXPECT(bfc.Free(l.p));
      live[i] = live.back();
      live.pop_back();
    } else if (kind < 97) {
      bfc.SetLimit((1 + rng() % 8) * MiB);
    } else {
      bfc.ResetStepStats();
    }
    EXPECT_CLEAN(bfc.CheckInvariants());
    EXPECT_EQ(bfc.GetStats().in_use, live_bytes);
    if (antman_test::Failures() > 0) return;
  }
  for (const Live& l : live) EXPECT(bfc.Free(l.p));
  bfc.ReleaseCached();
  EXPECT_EQ(bfc.GetStats().reserved, 0u);
  EXPECT_EQ(source.live_regions(), 0u);
}

// A request that no cached chunk fits while the cache fills the limit: the allocator gives back
// its wholly free regions and grows on the device instead of failing (and spilling to host).
TEST(ReleasesItsOwnCachedRegionsToMakeRoomBeforeFailing) {
  TestRegionSource source;
  Bfc bfc(&source, Options(8 * MiB, 2 * MiB, 2 * MiB));
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(bfc.Allocate(0, 2 * MiB));
  for (void* b : blocks) REQUIRE(b != nullptr);
  EXPECT_EQ(bfc.GetStats().reserved, 8 * MiB);
  void* keep = blocks[0];
  for (int i = 1; i < 4; ++i) EXPECT(bfc.Free(blocks[i]));
  // 6 MiB cached in three 2 MiB regions; 4 MiB fits in none of them.
  void* big = bfc.Allocate(0, 4 * MiB);
  EXPECT(big != nullptr);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.fit_release_regions, 2u);  // exactly the room needed, not the whole cache
  EXPECT_EQ(s.fit_release_bytes, 4 * MiB);
  EXPECT_EQ(s.fit_retry_allocs, 1u);
  EXPECT_EQ(s.reserved, 8 * MiB);
  EXPECT_EQ(source.used(), 8 * MiB);
  EXPECT(source.Holds(keep));
  // Nothing can make room for more: the live blocks fill the limit.
  EXPECT(bfc.Allocate(0, 4 * MiB) == nullptr);
  EXPECT_EQ(bfc.GetStats().fit_release_regions, 2u);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// Releasing would not make room (live blocks hold the limit): the cache is left alone.
TEST(KeepsTheCacheWhenReleasingCannotMakeRoom) {
  TestRegionSource source;
  Bfc bfc(&source, Options(8 * MiB, 2 * MiB, 2 * MiB));
  void* a = bfc.Allocate(0, 2 * MiB);
  void* b = bfc.Allocate(0, 2 * MiB);
  void* c = bfc.Allocate(0, 2 * MiB);
  REQUIRE(a && b && c);
  EXPECT(bfc.Free(c));  // 2 MiB cached, 4 MiB live, 2 MiB room
  EXPECT(bfc.Allocate(0, 6 * MiB) == nullptr);  // above the limit in live bytes anyway
  EXPECT(bfc.Allocate(0, 4 * MiB + 256) == nullptr);  // needs the cache and then some
  EXPECT_EQ(bfc.GetStats().fit_release_regions, 0u);
  EXPECT_EQ(bfc.GetStats().reserved, 6 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// The source (the device) is short while the allocator caches free regions: they go back and the
// request is retried, as TensorFlow's BFC does.
TEST(SourceShortReleasesCachedRegionsAndRetries) {
  TestRegionSource source(/*capacity=*/8 * MiB);
  Bfc bfc(&source, Options(64 * MiB, 2 * MiB, 2 * MiB));
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(bfc.Allocate(0, 2 * MiB));
  for (void* b : blocks) REQUIRE(b != nullptr);
  for (void* b : blocks) EXPECT(bfc.Free(b));
  void* big = bfc.Allocate(0, 6 * MiB);
  EXPECT(big != nullptr);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.fit_release_bytes, 8 * MiB);
  EXPECT_EQ(s.reserved, 6 * MiB);
  EXPECT_EQ(source.used(), 6 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

uint64_t g_bfc_now_ns = 1;
uint64_t BfcNow() { return g_bfc_now_ns; }

// Another process holds the device memory this job's limit would allow. Each step the job
// takes a small block (a cached region) and then misses on a large one. Before issue 29 every
// miss asked the driver again and then gave back the whole cache (ReleaseAllForSource: a
// cuMemFree, which synchronises) and regrew it next step: a flush per step. Now the first
// refusal caps growth at what the driver said was free, for a backoff period.
TEST(DriverRefusalCapsGrowthInsteadOfFlushingOnEveryMiss) {
  TestRegionSource source(/*capacity=*/16 * MiB);
  source.set_held_by_others(8 * MiB);
  BfcOptions o = Options(64 * MiB, 2 * MiB, 2 * MiB);
  o.clock = &BfcNow;
  g_bfc_now_ns = 1;
  Bfc bfc(&source, o);
  std::vector<void*> live;
  for (int i = 0; i < 3; ++i) live.push_back(bfc.Allocate(0, 2 * MiB));
  for (void* p : live) REQUIRE(p != nullptr);
  for (int step = 0; step < 20; ++step) {
    void* small = bfc.Allocate(0, MiB);
    REQUIRE(small != nullptr);
    EXPECT(bfc.Free(small));
    EXPECT(bfc.Allocate(0, 4 * MiB) == nullptr);  // the caller falls back to host memory
  }
  auto s = bfc.GetStats();
  EXPECT(source.frees() <= 1u);   // before: 20 (one flush per step)
  EXPECT(s.driver_refusals <= 2u);
  EXPECT(source.attempts().size() <= 7u);  // 3 + 2 small regions + the refused ones
  EXPECT_EQ(s.driver_cap, 8 * MiB);       // held 8 MiB + 0 free when refused
  EXPECT_CLEAN(bfc.CheckInvariants());
  // The other process leaves and the backoff lapses: the device serves the large block.
  source.set_held_by_others(0);
  g_bfc_now_ns += 200'000'000;
  void* big = bfc.Allocate(0, 4 * MiB);
  EXPECT(big != nullptr);
  EXPECT_EQ(bfc.GetStats().driver_cap, 0u);
  EXPECT(bfc.Free(big));
  for (void* p : live) EXPECT(bfc.Free(p));
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// A remainder kept inside a block must not put in_use above the limit. Here the limit was lowered
// below the held regions (they hold live blocks), and the best fit is a hole only 32 KiB larger
// than the request: keeping the sliver would put in_use 32 KiB above the limit.
TEST(CarveSlackNeverPutsInUseAboveTheLimit) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, 8 * MiB, 8 * MiB));
  void* a = bfc.Allocate(0, 256 * KiB);
  void* hole = bfc.Allocate(0, MiB + 32 * KiB);
  void* c = bfc.Allocate(0, 256 * KiB);
  REQUIRE(a && hole && c);
  EXPECT(bfc.Free(hole));
  bfc.SetLimit(MiB + 512 * KiB);  // region pinned by a and c: reserved stays 8 MiB
  EXPECT_EQ(bfc.GetStats().reserved, 8 * MiB);
  void* p = bfc.Allocate(0, MiB);  // in_use 512 KiB + 1 MiB == limit: admitted
  REQUIRE(p != nullptr);
  EXPECT(p == hole);
  EXPECT_EQ(bfc.AllocatedSize(p), MiB);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.in_use, MiB + 512 * KiB);
  EXPECT(s.in_use <= s.limit);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// After a shrink had to keep a region for its live blocks, the region stops being served as soon
// as its last block is freed (reserved never stays above max(limit, pinned)), but it goes back to
// the source only at the next safe point, after one Quiesce: a driver free inside the free call
// (a framework's free callback, mid-backward) would synchronise the device (issues 29, 30).
// Before that change this test asserted the release inside Free.
TEST(FreeingThePinningBlockQueuesARegionAboveTheLimitForTheSafePoint) {
  TestRegionSource source;
  Bfc bfc(&source, Options(64 * MiB, 2 * MiB, 2 * MiB));
  void* a = bfc.Allocate(0, MiB);
  void* b = bfc.Allocate(0, 2 * MiB);
  REQUIRE(a && b);
  EXPECT_EQ(bfc.GetStats().regions, 2u);
  const auto r = bfc.SetLimit(0);
  EXPECT_EQ(r.unfreed, 4 * MiB);
  EXPECT(bfc.Free(a));
  auto s = bfc.GetStats();
  EXPECT_EQ(s.reserved, 2 * MiB);
  EXPECT_EQ(s.pinned, 2 * MiB);
  EXPECT_EQ(s.deferred_bytes, 2 * MiB);
  EXPECT(source.Holds(a));  // no driver call inside the free
  EXPECT(bfc.Free(b));
  s = bfc.GetStats();
  EXPECT_EQ(s.reserved, 0u);
  EXPECT_EQ(s.deferred_bytes, 4 * MiB);
  EXPECT_EQ(s.deferred_regions, 2u);
  EXPECT_EQ(source.frees(), 0u);
  EXPECT_EQ(source.quiesces(), 0u);
  EXPECT(bfc.Allocate(0, 256) == nullptr);  // limit 0: queued regions are not served
  EXPECT_CLEAN(bfc.CheckInvariants());
  const auto d = bfc.ReleaseDeferred();  // the safe point
  EXPECT_EQ(d.bytes_freed, 4 * MiB);
  EXPECT_EQ(source.live_regions(), 0u);
  EXPECT_EQ(source.quiesces(), 1u);      // one synchronisation for the batch, before the frees
  s = bfc.GetStats();
  EXPECT_EQ(s.deferred_bytes, 0u);
  EXPECT_EQ(s.deferred_released_bytes, 4 * MiB);
  EXPECT_EQ(s.release_syncs, 1u);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// Queued regions still count as held: growth under a raised limit cannot pass the limit through
// them, and a SetLimit (a safe point) gives them back at once.
TEST(QueuedRegionsCountUntilASetLimitGivesThemBack) {
  TestRegionSource source;
  Bfc bfc(&source, Options(8 * MiB, 2 * MiB, 2 * MiB));
  void* a = bfc.Allocate(0, 2 * MiB);
  void* b = bfc.Allocate(0, 2 * MiB);
  REQUIRE(a && b);
  bfc.SetLimit(2 * MiB);
  EXPECT(bfc.Free(a));  // queued: reserved 2 MiB (b), deferred 2 MiB
  EXPECT_EQ(bfc.GetStats().deferred_bytes, 2 * MiB);
  bfc.SetLimit(5 * MiB);  // raised: gives the queued region back, then room is 3 MiB
  EXPECT_EQ(bfc.GetStats().deferred_bytes, 0u);
  EXPECT_EQ(source.used(), 2 * MiB);
  void* c = bfc.Allocate(0, 2 * MiB);
  REQUIRE(c != nullptr);
  EXPECT(source.used() <= 5 * MiB);
  EXPECT(bfc.Free(b) && bfc.Free(c));
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// SetLimit lowers the limit while a region is being fetched under the old one (lock dropped):
// the grower must not take the region in above the new limit, and SetLimit must not return while
// that region is still held from the source.
TEST(LimitLoweredWhileARegionGrowsIsNeverExceeded) {
  TestRegionSource source;
  Bfc bfc(&source, Options(16 * MiB, 8 * MiB, 8 * MiB));
  std::thread setter;
  std::atomic<bool> set_returned{false};
  size_t used_when_set_returned = ~size_t{0};
  bool once = false;
  source.on_call = [&] {
    if (once) return;
    once = true;
    setter = std::thread([&] {
      bfc.SetLimit(4 * MiB);
      used_when_set_returned = source.used();
      set_returned = true;
    });
    // Let the new limit land while this region is still in flight.
    while (bfc.GetStats().limit != 4 * MiB) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT(!set_returned.load());  // it waits for this grower
  };
  void* p = bfc.Allocate(0, 6 * MiB);  // planned as an 8 MiB region under 16 MiB
  setter.join();
  source.on_call = nullptr;
  EXPECT(p == nullptr);  // 6 MiB does not fit under 4 MiB
  EXPECT_EQ(used_when_set_returned, 0u);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.reserved, 0u);
  EXPECT_EQ(s.growth_returns, 1u);
  EXPECT_EQ(source.live_regions(), 0u);
  // A request that fits the new limit is served after the returned region.
  EXPECT(bfc.Allocate(0, MiB) != nullptr);
  EXPECT(bfc.GetStats().reserved <= 4 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

// Regions a shrink is returning still count against the limit until the source has them back,
// or a grower could hold them and its new region at once. The grower waits for the release and
// then grows on the device (instead of failing over to host memory).
TEST(RegionsBeingReleasedCountUntilTheSourceHasThem) {
  TestRegionSource source;
  Bfc bfc(&source, Options(4 * MiB, 4 * MiB, 4 * MiB));
  void* a = bfc.Allocate(0, 4 * MiB);
  REQUIRE(a != nullptr);
  EXPECT(bfc.Free(a));
  std::thread other;
  std::atomic<bool> other_done{false};
  void* b = nullptr;
  size_t used_at_second_alloc = ~size_t{0};
  int calls = 0;
  source.on_call = [&] {
    ++calls;
    if (calls == 1) {  // inside FreeRegion of the shrink below
      other = std::thread([&] {
        b = bfc.Allocate(0, 2 * MiB);
        other_done = true;
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      EXPECT(!other_done.load());  // waits for the region to be back
    } else if (calls == 2) {  // AllocRegion of the other thread
      used_at_second_alloc = source.used();
    }
  };
  bfc.ReleaseCached();
  other.join();
  source.on_call = nullptr;
  EXPECT(b != nullptr);
  EXPECT_EQ(used_at_second_alloc, 0u);
  EXPECT(source.used() <= 4 * MiB);
  EXPECT_CLEAN(bfc.CheckInvariants());
}

uint64_t g_fake_now_ns = 0;
uint64_t FakeNow() { return g_fake_now_ns; }

TEST(ReleaseIdleFreesOnlyRegionsIdleLongEnough) {
  TestRegionSource source;
  BfcOptions o = Options(64 * MiB, 2 * MiB, 2 * MiB);
  o.clock = &FakeNow;
  g_fake_now_ns = 1000;
  Bfc bfc(&source, o);
  void* a = bfc.Allocate(0, 2 * MiB);
  void* b = bfc.Allocate(0, 2 * MiB);
  void* c = bfc.Allocate(0, 2 * MiB);
  REQUIRE(a && b && c);
  EXPECT(bfc.Free(a));  // idle from t = 1000
  g_fake_now_ns = 5000;
  EXPECT(bfc.Free(b));  // idle from t = 5000
  g_fake_now_ns = 1000 + 9999;
  EXPECT_EQ(bfc.ReleaseIdle(10000).regions_freed, 0u);
  g_fake_now_ns = 1000 + 10000;
  auto r = bfc.ReleaseIdle(10000);
  EXPECT_EQ(r.regions_freed, 1u);
  EXPECT(!source.Holds(a) && source.Holds(b) && source.Holds(c));
  // A region used again restarts its idle time.
  void* b2 = bfc.Allocate(0, MiB);
  EXPECT(b2 == b);
  g_fake_now_ns = 20000;
  EXPECT(bfc.Free(b2));
  g_fake_now_ns = 29999;
  EXPECT_EQ(bfc.ReleaseIdle(10000).regions_freed, 0u);
  g_fake_now_ns = 30000;
  EXPECT_EQ(bfc.ReleaseIdle(10000).regions_freed, 1u);
  const auto s = bfc.GetStats();
  EXPECT_EQ(s.idle_release_regions, 2u);
  EXPECT_EQ(s.idle_release_bytes, 4 * MiB);
  EXPECT_EQ(s.reserved, 2 * MiB);  // c is live
  EXPECT_CLEAN(bfc.CheckInvariants());
}

TEST_MAIN()
