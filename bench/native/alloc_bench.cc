// Allocation throughput: tf-antman's universal allocator (through the C API that TF's device
// calls) and its BFC core, against tsl::BFCAllocator, TensorFlow's own, on the same pattern of
// mixed sizes (70% up to 16 KiB, 25% up to 1 MiB, 5% up to 16 MiB) over N live slots; thread CPU
// time, best of R repetitions. Then the time of a shrink that releases 1 GiB of cached regions.
// Prints one JSON line.
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <vector>

#include "cc/core/antman_memory.h"
#include "cc/core/bfc.h"
#include "xla/tsl/framework/bfc_allocator.h"

namespace {

void* MapAnon(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// Same region source for both allocators, so only the bookkeeping differs.
struct MmapSubAllocator : tsl::SubAllocator {
  MmapSubAllocator() : tsl::SubAllocator({}, {}) {}
  void* Alloc(size_t, size_t n, size_t* got) override {
    *got = n;
    return MapAnon(n);
  }
  void Free(void* p, size_t n) override { munmap(p, n); }
  bool SupportsCoalescing() const override { return false; }
};

struct MmapRegions : antman::RegionSource {
  void* AllocRegion(size_t n) override { return MapAnon(n); }
  void FreeRegion(void* p, size_t n) override { munmap(p, n); }
};

struct Op {
  int slot;
  size_t size;
};

std::vector<Op> Pattern(int n, int slots) {
  std::mt19937_64 rng(42);
  std::vector<Op> ops;
  ops.reserve(n);
  for (int i = 0; i < n; ++i) {
    const int r = static_cast<int>(rng() % 100);
    const size_t s = r < 70 ? 1 + rng() % 16384 : r < 95 ? 1 + rng() % (1 << 20) : 1 + rng() % (16 << 20);
    ops.push_back({static_cast<int>(rng() % slots), s});
  }
  return ops;
}

double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

double WallSeconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

template <class Alloc, class Free>
double NsPerOp(const std::vector<Op>& ops, int slots, Alloc alloc, Free dealloc) {
  std::vector<void*> live(slots, nullptr);
  const double t0 = ThreadSeconds();
  for (const Op& o : ops) {
    void*& s = live[o.slot];
    if (s != nullptr) {
      dealloc(s);
      s = nullptr;
    } else {
      s = alloc(o.size);
    }
  }
  const double t1 = ThreadSeconds();
  for (void* p : live)
    if (p != nullptr) dealloc(p);
  return (t1 - t0) * 1e9 / ops.size();
}

// Fills 1 GiB of device regions (touched, as tensors would be), frees the blocks so the
// regions are cached, then lowers the limit: the shrink releases them.
double ShrinkMs(uint64_t bytes) {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_EMULATED;
  c.device_capacity = bytes * 2;
  c.limit = bytes * 2;
  antman_mem* mem = nullptr;
  char err[256];
  if (antman_mem_create(&c, &mem, err, sizeof(err)) != 0) {
    std::fprintf(stderr, "create: %s\n", err);
    std::exit(1);
  }
  std::vector<void*> blocks;
  const size_t block = 64 << 20;
  for (uint64_t done = 0; done < bytes; done += block) {
    void* p = antman_mem_alloc(mem, 256, block);
    std::memset(p, 1, block);
    blocks.push_back(p);
  }
  for (void* p : blocks) antman_mem_free(mem, p);
  antman_mem_stats before;
  antman_mem_get_stats(mem, &before);
  const double t0 = WallSeconds();
  antman_mem_set_limit(mem, 16 << 20, nullptr);
  const double ms = (WallSeconds() - t0) * 1e3;
  antman_mem_stats after;
  antman_mem_get_stats(mem, &after);
  std::fprintf(stderr, "shrink: reserved %llu -> %llu bytes in %.2f ms\n",
               (unsigned long long)before.reserved, (unsigned long long)after.reserved, ms);
  antman_mem_destroy(mem);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2000000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const int slot_counts[] = {100, 1000, 10000};
  std::printf("{\"ops\": %d, \"reps\": %d, \"patterns\": [", n, reps);
  for (size_t k = 0; k < 3; ++k) {
    const int slots = slot_counts[k];
    const auto ops = Pattern(n, slots);
    tsl::BFCAllocator::Options o;
    o.allow_growth = true;
    o.garbage_collection = false;
    tsl::BFCAllocator tf(std::make_unique<MmapSubAllocator>(), size_t{64} << 30, "tf_bfc", o);
    MmapRegions regions;
    antman::BfcOptions bo;
    bo.limit = uint64_t{64} << 30;
    antman::Bfc core(&regions, bo);
    antman_mem_config c{};
    c.backend = ANTMAN_BACKEND_EMULATED;
    c.device_capacity = uint64_t{64} << 30;
    antman_mem* mem = nullptr;
    char err[256];
    if (antman_mem_create(&c, &mem, err, sizeof(err)) != 0) return 1;
    double best_tf = 1e18, best_core = 1e18, best_universal = 1e18;
    for (int r = 0; r < reps; ++r) {  // interleaved, so drifts in machine load hit all three
      best_tf = std::min(best_tf, NsPerOp(ops, slots, [&](size_t s) { return tf.AllocateRaw(64, s); },
                                          [&](void* p) { tf.DeallocateRaw(p); }));
      best_core = std::min(best_core, NsPerOp(ops, slots, [&](size_t s) { return core.Allocate(64, s); },
                                              [&](void* p) { core.Free(p); }));
      best_universal = std::min(best_universal,
                                NsPerOp(ops, slots, [&](size_t s) { return antman_mem_alloc(mem, 64, s); },
                                        [&](void* p) { antman_mem_free(mem, p); }));
    }
    antman_mem_destroy(mem);
    std::printf("%s{\"slots\": %d, \"tf_bfc_ns\": %.1f, \"antman_bfc_ns\": %.1f, \"antman_universal_ns\": %.1f}",
                k ? ", " : "", slots, best_tf, best_core, best_universal);
  }
  std::printf("], \"shrink_1gib_ms\": %.3f}\n", ShrinkMs(uint64_t{1} << 30));
  return 0;
}
