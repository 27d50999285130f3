// The C API as the TensorFlow glue sees it: config validation, backend bring-up and the
// emulated backend end to end.
#include <dlfcn.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "cc/core/antman_memory.h"
#include "cc/core/test_check.h"

namespace {

constexpr uint64_t MiB = 1024 * 1024;

antman_mem_config Emulated(uint64_t capacity, uint64_t limit, uint64_t host) {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_EMULATED;
  c.device_capacity = capacity;
  c.limit = limit;
  c.host_capacity = host;
  c.min_region = MiB;
  return c;
}

// The error text for a config that must be refused (empty if it was accepted).
std::string Refusal(const antman_mem_config* c) {
  char err[256] = "untouched";
  antman_mem* mem = reinterpret_cast<antman_mem*>(&err);  // must be reset to NULL
  const int rc = antman_mem_create(c, &mem, err, sizeof(err));
  if (rc == 0) {
    antman_mem_destroy(mem);
    return "";
  }
  if (mem != nullptr) return "out not reset to NULL";
  return err;
}

antman_mem_stats Stats(antman_mem* mem) {
  antman_mem_stats s;
  std::memset(&s, 0xff, sizeof(s));
  antman_mem_get_stats(mem, &s);
  return s;
}

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(RefusesBadConfigsNamingTheField) {
  antman_mem_config c = Emulated(8 * MiB, 0, 0);
  c.backend = 7;
  EXPECT(Contains(Refusal(&c), "backend: 7"));
  c = Emulated(0, 0, 0);
  EXPECT(Contains(Refusal(&c), "device_capacity"));
  c = Emulated(8 * MiB, 0, 0);
  c.min_region = 100;
  EXPECT(Contains(Refusal(&c), "min_region: 100"));
  c.min_region = 1000;  // not a multiple of 256
  EXPECT(Contains(Refusal(&c), "min_region"));
  c = Emulated(8 * MiB, 0, 0);
  c.device_ordinal = -1;
  EXPECT(Contains(Refusal(&c), "device_ordinal"));
  EXPECT(Contains(Refusal(nullptr), "config"));
  c = Emulated(8 * MiB, 0, 0);
  EXPECT(Refusal(&c).empty());
  char err[8];
  EXPECT(antman_mem_create(&c, nullptr, err, sizeof(err)) != 0);
  EXPECT_EQ(std::strlen(err), 7u);  // truncated, still terminated
}

TEST(CudaBackendWithoutADriverIsAnErrorNotACrash) {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_CUDA;
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  char err[512] = "";
  antman_mem* mem = nullptr;
  const int rc = antman_mem_create(&c, &mem, err, sizeof(err));
  if (driver == nullptr) {
    EXPECT(rc != 0);
    EXPECT(mem == nullptr);
    EXPECT(Contains(err, "libcuda.so.1"));
  } else {
    // With a driver the backend either comes up or says why (e.g. no device).
    EXPECT(rc == 0 ? mem != nullptr : std::strlen(err) > 0);
    if (mem != nullptr) antman_mem_destroy(mem);
    dlclose(driver);
  }
}

TEST(LimitZeroMeansDeviceCapacityAndCapacityBoundsGrowth) {
  // The limit is above the capacity: the emulated device itself runs out at 4 MiB.
  antman_mem_config c = Emulated(4 * MiB, 0, 0);
  antman_mem* mem = nullptr;
  REQUIRE(antman_mem_create(&c, &mem, nullptr, 0) == 0);
  EXPECT_EQ(Stats(mem).limit, 4 * MiB);
  EXPECT_EQ(Stats(mem).device_capacity, 4 * MiB);
  antman_mem_destroy(mem);

  c = Emulated(4 * MiB, 16 * MiB, 8 * MiB);
  REQUIRE(antman_mem_create(&c, &mem, nullptr, 0) == 0);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(antman_mem_alloc(mem, 0, MiB));
  const antman_mem_stats s = Stats(mem);
  EXPECT_EQ(s.reserved, 4 * MiB);
  EXPECT_EQ(s.in_use, 4 * MiB);
  EXPECT_EQ(s.host_in_use, 4 * MiB);
  EXPECT_EQ(s.host_fallbacks, 4u);
  for (void* p : blocks) antman_mem_free(mem, p);
  EXPECT_EQ(antman_mem_check_invariants(mem, nullptr, 0), 0);
  antman_mem_destroy(mem);
}

TEST(EmulatedEndToEnd) {
  antman_mem_config c = Emulated(64 * MiB, 8 * MiB, 16 * MiB);
  antman_mem* mem = nullptr;
  char err[256];
  REQUIRE(antman_mem_create(&c, &mem, err, sizeof(err)) == 0);
  void* d = antman_mem_alloc(mem, 64, 6 * MiB);
  void* h = antman_mem_alloc(mem, 4096, 6 * MiB);  // 8 MiB limit: this one lands on the host
  REQUIRE(d && h);
  EXPECT_EQ(antman_mem_is_host(mem, d), 0);
  EXPECT_EQ(antman_mem_is_host(mem, h), 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h) % 4096, 0u);
  EXPECT_EQ(antman_mem_allocated_size(mem, d), 6 * MiB);
  // May keep a small remainder (< 1/16) of the chunk it was cut from.
  EXPECT(antman_mem_allocated_size(mem, h) >= 6 * MiB);
  EXPECT(antman_mem_allocated_size(mem, h) <= 6 * MiB + 6 * MiB / 16);
  std::memset(d, 1, 6 * MiB);
  std::memset(h, 2, 6 * MiB);
  EXPECT(antman_mem_alloc(mem, 0, 0) == nullptr);
  EXPECT(antman_mem_alloc(mem, 8192, 16) == nullptr);

  int outside = 0;
  const antman_mem_stats before = Stats(mem);
  antman_mem_free(mem, &outside);  // reported and ignored
  antman_mem_free(mem, nullptr);
  EXPECT_EQ(Stats(mem).in_use, before.in_use);
  EXPECT_EQ(antman_mem_is_host(mem, &outside), -1);
  EXPECT_EQ(antman_mem_allocated_size(mem, &outside), 0u);

  antman_mem_free(mem, d);
  uint64_t unfreed = 1;
  const uint64_t freed = antman_mem_set_limit(mem, 0, &unfreed);
  EXPECT_EQ(freed, before.reserved);
  EXPECT_EQ(unfreed, 0u);
  antman_mem_stats s = Stats(mem);
  EXPECT_EQ(s.reserved, 0u);
  EXPECT_EQ(s.limit, 0u);
  EXPECT_EQ(s.shrink_bytes_freed, before.reserved);
  EXPECT_EQ(s.shrink_regions_freed, before.regions);

  antman_mem_request_limit(mem, 32 * MiB);
  EXPECT_EQ(Stats(mem).pending_limit, 32 * MiB);
  EXPECT(antman_mem_alloc(mem, 0, MiB) != nullptr);  // limit 0 still: host
  EXPECT_EQ(Stats(mem).host_fallbacks, 2u);
  antman_mem_step_boundary(mem);
  s = Stats(mem);
  EXPECT_EQ(s.limit, 32 * MiB);
  EXPECT_EQ(s.steps, 1u);
  void* d2 = antman_mem_alloc(mem, 0, MiB);
  EXPECT_EQ(antman_mem_is_host(mem, d2), 0);
  antman_mem_free(mem, d2);
  antman_mem_free(mem, h);
  EXPECT(antman_mem_release_cached(mem) > 0);
  EXPECT_EQ(Stats(mem).reserved, 0u);
  EXPECT_EQ(antman_mem_check_invariants(mem, err, sizeof(err)), 0);
  antman_mem_destroy(mem);
}

// A NULL handle or out pointer is a caller's bug answered with "nothing",
// never a crash (each of these segfaulted).
TEST(NullArgumentsAreNotACrash) {
  EXPECT(antman_mem_alloc(nullptr, 0, 1024) == nullptr);
  antman_mem_free(nullptr, nullptr);
  EXPECT_EQ(antman_mem_is_host(nullptr, nullptr), -1);
  EXPECT_EQ(antman_mem_allocated_size(nullptr, nullptr), 0u);
  uint64_t unfreed = 7;
  EXPECT_EQ(antman_mem_set_limit(nullptr, 0, &unfreed), 0u);
  EXPECT_EQ(unfreed, 0u);
  antman_mem_request_limit(nullptr, 0);
  EXPECT_EQ(antman_mem_release_cached(nullptr), 0u);
  antman_mem_step_boundary(nullptr);
  antman_mem_stats zeroed;
  std::memset(&zeroed, 0xff, sizeof(zeroed));
  antman_mem_get_stats(nullptr, &zeroed);
  EXPECT_EQ(zeroed.in_use, 0u);
  char err[64] = "";
  EXPECT_EQ(antman_mem_check_invariants(nullptr, err, sizeof(err)), 1);
  EXPECT(std::strstr(err, "mem: must not be NULL") != nullptr);

  antman_mem_config c = Emulated(64 * MiB, 8 * MiB, 16 * MiB);
  antman_mem* mem = nullptr;
  REQUIRE(antman_mem_create(&c, &mem, nullptr, 0) == 0);
  antman_mem_get_stats(mem, nullptr);
  EXPECT_EQ(antman_mem_get_ext_stats(mem, nullptr, sizeof(antman_mem_ext_stats)), 0u);
  antman_mem_destroy(mem);
}

TEST(HostIdleReleaseIsValidated) {
  antman_mem_config c = Emulated(8 * MiB, 0, 8 * MiB);
  c.host_idle_release_ms = 86400001;
  const std::string why = Refusal(&c);
  EXPECT(Contains(why, "host_idle_release_ms: 86400001"));
  EXPECT(Contains(why, "[1, 86400000]"));
  for (uint64_t ok : {uint64_t{0}, uint64_t{1}, uint64_t{86400000}}) {
    c.host_idle_release_ms = ok;
    EXPECT(Refusal(&c).empty());
  }
  c.host_idle_release_ms = 0;
  antman_mem* mem = nullptr;
  char err[256];
  REQUIRE(antman_mem_create(&c, &mem, err, sizeof(err)) == 0);
  antman_mem_ext_stats e;
  EXPECT_EQ(antman_mem_get_ext_stats(mem, &e, sizeof(e)), sizeof(e));
  EXPECT_EQ(e.host_idle_release_ns, uint64_t{10000} * 1000 * 1000);  // the default
  // A caller built against a shorter struct gets only its part.
  uint64_t first[2] = {7, 7};
  EXPECT_EQ(antman_mem_get_ext_stats(mem, reinterpret_cast<antman_mem_ext_stats*>(first), 8), 8u);
  EXPECT_EQ(first[1], 7u);
  antman_mem_destroy(mem);
}

// The front-ends' additions: fail-fast device-only allocations, peak resets, the total peak and
// the largest allocation (TF's AllocatorStats, torch.cuda.memory_stats).
TEST(DeviceOnlyAllocationsAndPeakResets) {
  antman_mem_config c = Emulated(64 * MiB, 4 * MiB, 64 * MiB);
  antman_mem* mem = nullptr;
  char err[256];
  REQUIRE(antman_mem_create(&c, &mem, err, sizeof(err)) == 0);
  void* d = antman_mem_alloc(mem, 0, 3 * MiB);
  REQUIRE(d != nullptr);
  EXPECT_EQ(antman_mem_is_host(mem, d), 0);
  // Past the limit: the ordinary call spills to host memory, the device-only one refuses.
  EXPECT(antman_mem_alloc_device_only(mem, 0, 2 * MiB) == nullptr);
  void* h = antman_mem_alloc(mem, 0, 2 * MiB);
  REQUIRE(h != nullptr);
  EXPECT_EQ(antman_mem_is_host(mem, h), 1);
  void* small = antman_mem_alloc_device_only(mem, 0, 512 * 1024);  // fits: device
  REQUIRE(small != nullptr);
  EXPECT_EQ(antman_mem_is_host(mem, small), 0);
  EXPECT(antman_mem_alloc_device_only(mem, 0, 0) == nullptr);
  EXPECT(antman_mem_alloc_device_only(nullptr, 0, 256) == nullptr);
  antman_mem_ext_stats e{};
  EXPECT_EQ(antman_mem_get_ext_stats(mem, &e, sizeof(e)), sizeof(e));
  EXPECT_EQ(e.device_only_failures, 1u);
  EXPECT_EQ(e.largest_alloc, 3 * MiB);
  EXPECT_EQ(e.total_in_use, 3 * MiB + 2 * MiB + 512 * 1024);
  EXPECT_EQ(e.peak_total_in_use, e.total_in_use);
  antman_mem_free(mem, d);
  antman_mem_free(mem, h);
  antman_mem_get_ext_stats(mem, &e, sizeof(e));
  EXPECT_EQ(e.total_in_use, 512 * 1024u);
  EXPECT_EQ(e.peak_total_in_use, 5 * MiB + 512 * 1024);  // device + host, not device only
  antman_mem_stats s = Stats(mem);
  EXPECT_EQ(s.peak_in_use, 3 * MiB + 512 * 1024);
  EXPECT_EQ(s.host_peak, 2 * MiB);
  antman_mem_reset_peaks(mem);
  antman_mem_get_ext_stats(mem, &e, sizeof(e));
  s = Stats(mem);
  EXPECT_EQ(e.peak_total_in_use, 512 * 1024u);
  EXPECT_EQ(e.largest_alloc, 0u);
  EXPECT_EQ(s.peak_in_use, 512 * 1024u);
  EXPECT_EQ(s.host_peak, 0u);
  antman_mem_reset_peaks(nullptr);  // not a crash
  // An older caller's smaller struct gets only its own bytes.
  antman_mem_ext_stats old{};
  old.largest_alloc = 12345;
  EXPECT_EQ(antman_mem_get_ext_stats(mem, &old, offsetof(antman_mem_ext_stats, largest_alloc)),
            offsetof(antman_mem_ext_stats, largest_alloc));
  EXPECT_EQ(old.largest_alloc, 12345u);
  antman_mem_free(mem, small);
  antman_mem_destroy(mem);
}

TEST_MAIN()
