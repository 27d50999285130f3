// Randomized use of the C API: alloc/free of mixed sizes and alignments, limit changes now and
// at step boundaries, cache releases; first on one thread with the invariants checked after every
// operation, then on several threads at once. Every live block carries a pattern that is
// checked when it is freed, so overlapping blocks or a shrink that frees live memory show up.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/antman_memory.h"
#include "cc/core/test_check.h"

namespace {

constexpr uint64_t MiB = 1024 * 1024;
// Blocks up to this size are filled and checked in full; larger ones at a stride (and at both ends).
constexpr size_t kFullPattern = 64 * 1024;
constexpr size_t kStride = 4096;

struct Block {
  unsigned char* p;
  size_t n;
  uint64_t tag;
};

unsigned char PatternByte(uint64_t tag, size_t i) {
  return static_cast<unsigned char>((tag * 0x9e3779b97f4a7c15ULL + i * 31) >> 56);
}

template <typename F>
void ForPatternOffsets(size_t n, F f) {
  if (n <= kFullPattern) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  for (size_t i = 0; i < 256; ++i) f(i);
  for (size_t i = 256; i < n - 256; i += kStride) f(i);
  for (size_t i = n - 256; i < n; ++i) f(i);
}

void Fill(const Block& b) {
  ForPatternOffsets(b.n, [&](size_t i) { b.p[i] = PatternByte(b.tag, i); });
}

bool Intact(const Block& b) {
  bool ok = true;
  ForPatternOffsets(b.n, [&](size_t i) { ok = ok && b.p[i] == PatternByte(b.tag, i); });
  return ok;
}

size_t RandomSize(std::mt19937_64& rng) {
  const int r = static_cast<int>(rng() % 100);
  if (r < 70) return 1 + rng() % (16 * 1024);
  if (r < 95) return 1 + rng() % MiB;
  return 1 + rng() % (4 * MiB);
}

antman_mem* Create() {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_EMULATED;
  c.device_capacity = 48 * MiB;
  c.limit = 24 * MiB;
  c.host_capacity = 16 * MiB;
  c.min_region = 256 * 1024;
  antman_mem* mem = nullptr;
  char err[256];
  if (antman_mem_create(&c, &mem, err, sizeof(err)) != 0) {
    std::fprintf(stderr, "create failed: %s\n", err);
    return nullptr;
  }
  return mem;
}

struct Counters {
  std::atomic<uint64_t> served{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> on_host{0};
  std::atomic<uint64_t> clobbered{0};
  std::atomic<uint64_t> broken{0};
};

// One worker's loop. check_every: run the invariant checker after every that many operations.
void Work(antman_mem* mem, uint64_t seed, int ops, int check_every, Counters* counters,
          std::vector<Block>* live) {
  std::mt19937_64 rng(seed);
  char err[512];
  for (int op = 0; op < ops; ++op) {
    const int kind = static_cast<int>(rng() % 100);
    if (kind < 48) {
      const size_t n = RandomSize(rng);
      const size_t alignment = size_t{1} << (rng() % 13);
      auto* p = static_cast<unsigned char*>(antman_mem_alloc(mem, alignment, n));
      if (p == nullptr) {
        counters->refused.fetch_add(1);
      } else {
        counters->served.fetch_add(1);
        if (antman_mem_is_host(mem, p) == 1) counters->on_host.fetch_add(1);
        if (reinterpret_cast<uintptr_t>(p) % alignment != 0 ||
            antman_mem_allocated_size(mem, p) < n) {
          counters->broken.fetch_add(1);
        }
        Block b{p, n, seed * 1000003 + static_cast<uint64_t>(op)};
        Fill(b);
        live->push_back(b);
      }
    } else if (kind < 90) {
      if (!live->empty()) {
        const size_t i = rng() % live->size();
        if (!Intact((*live)[i])) counters->clobbered.fetch_add(1);
        antman_mem_free(mem, (*live)[i].p);
        (*live)[i] = live->back();
        live->pop_back();
      }
    } else if (kind < 94) {
      uint64_t unfreed = 0;
      antman_mem_set_limit(mem, (rng() % 40) * MiB, &unfreed);
    } else if (kind < 97) {
      antman_mem_request_limit(mem, (rng() % 40) * MiB);
    } else if (kind < 99) {
      antman_mem_step_boundary(mem);
    } else {
      antman_mem_release_cached(mem);
    }
    if (op % check_every == 0 && antman_mem_check_invariants(mem, err, sizeof(err)) != 0) {
      std::fprintf(stderr, "op %d (seed %llu): %s\n", op, static_cast<unsigned long long>(seed),
                   err);
      counters->broken.fetch_add(1);
      return;
    }
  }
}

uint64_t SumSizes(antman_mem* mem, const std::vector<Block>& live, int want_host) {
  uint64_t sum = 0;
  for (const Block& b : live) {
    if (antman_mem_is_host(mem, b.p) == want_host) sum += antman_mem_allocated_size(mem, b.p);
  }
  return sum;
}

void DrainAndCheckEmpty(antman_mem* mem, std::vector<Block>* live, Counters* counters) {
  for (const Block& b : *live) {
    if (!Intact(b)) counters->clobbered.fetch_add(1);
    antman_mem_free(mem, b.p);
  }
  live->clear();
  antman_mem_stats s;
  antman_mem_get_stats(mem, &s);
  EXPECT_EQ(s.in_use, 0u);
  EXPECT_EQ(s.host_in_use, 0u);
  antman_mem_release_cached(mem);
  antman_mem_get_stats(mem, &s);
  EXPECT_EQ(s.reserved, 0u);
  EXPECT_EQ(s.regions, 0u);
}

}  // namespace

TEST(SingleThreadCheckedAfterEveryOperation) {
  antman_mem* mem = Create();
  REQUIRE(mem != nullptr);
  Counters counters;
  std::vector<Block> live;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    Work(mem, seed, 2000, 1, &counters, &live);
    // Accounting equals the sum of the live blocks, device and host separately.
    antman_mem_stats s;
    antman_mem_get_stats(mem, &s);
    EXPECT_EQ(s.in_use, SumSizes(mem, live, 0));
    EXPECT_EQ(s.host_in_use, SumSizes(mem, live, 1));
    EXPECT(s.host_in_use <= 16 * MiB);
  }
  std::printf("served %llu (host %llu), refused %llu\n",
              static_cast<unsigned long long>(counters.served.load()),
              static_cast<unsigned long long>(counters.on_host.load()),
              static_cast<unsigned long long>(counters.refused.load()));
  EXPECT_EQ(counters.broken.load(), 0u);
  EXPECT_EQ(counters.clobbered.load(), 0u);
  // The mix must really exercise both arenas and refusals, or the test proves little.
  EXPECT(counters.served.load() > 1000u);
  EXPECT(counters.on_host.load() > 0u);
  EXPECT(counters.refused.load() > 0u);
  DrainAndCheckEmpty(mem, &live, &counters);
  EXPECT_EQ(counters.clobbered.load(), 0u);
  antman_mem_destroy(mem);
}

TEST(ManyThreadsAtOnce) {
  antman_mem* mem = Create();
  REQUIRE(mem != nullptr);
  Counters counters;
  constexpr int kThreads = 4;
  std::vector<std::vector<Block>> live(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back(Work, mem, 100 + t, 3000, 8, &counters, &live[t]);
  }
  for (auto& t : threads) t.join();
  char err[512];
  EXPECT_EQ(antman_mem_check_invariants(mem, err, sizeof(err)), 0);
  std::vector<Block> all;
  for (auto& l : live) all.insert(all.end(), l.begin(), l.end());
  antman_mem_stats s;
  antman_mem_get_stats(mem, &s);
  EXPECT_EQ(s.in_use, SumSizes(mem, all, 0));
  EXPECT_EQ(s.host_in_use, SumSizes(mem, all, 1));
  EXPECT_EQ(counters.broken.load(), 0u);
  EXPECT(counters.served.load() > 2000u);
  DrainAndCheckEmpty(mem, &all, &counters);
  EXPECT_EQ(counters.clobbered.load(), 0u);
  antman_mem_destroy(mem);
}

TEST_MAIN()
