// The memory core on a real GPU through the C API (ANTMAN_BACKEND_CUDA): the limit sends
// allocations to pinned host memory, a kernel reads and writes that host-backed buffer, and a
// shrink returns cached device memory to the driver (timed, for comparison with the paper's
// 16.3 GB in 17 ms). Exit 0 on pass, 1 on failure, 77 when there is no GPU or driver.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cc/core/antman_memory.h"

namespace {

constexpr uint64_t MiB = 1024 * 1024;
constexpr uint64_t GiB = 1024 * MiB;
constexpr int kSkip = 77;

int failures = 0;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
      ++failures;                                               \
    }                                                           \
  } while (0)

__global__ void AddOne(int* data, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    data[i] += 1;
  }
}

antman_mem_stats Stats(antman_mem* mem) {
  antman_mem_stats s;
  antman_mem_get_stats(mem, &s);
  return s;
}

cudaMemoryType MemoryType(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return cudaMemoryTypeUnregistered;
  return a.type;
}

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// Fills `bytes` of cached device memory in 64 MiB blocks, frees them, then shrinks to `limit`.
void TimedShrink(antman_mem* mem, uint64_t bytes, const char* label) {
  const uint64_t block = bytes >= 8 * GiB ? GiB : 64 * MiB;
  antman_mem_set_limit(mem, bytes + 2 * GiB, nullptr);
  std::vector<void*> blocks;
  for (uint64_t got = 0; got < bytes; got += block) {
    void* p = antman_mem_alloc(mem, 256, block);
    CHECK(p != nullptr && antman_mem_is_host(mem, p) == 0, "%s: block %zu not on device", label,
          blocks.size());
    if (p == nullptr) break;
    blocks.push_back(p);
  }
  for (void* p : blocks) antman_mem_free(mem, p);
  const antman_mem_stats before = Stats(mem);
  size_t free_before = 0, total = 0;
  cudaMemGetInfo(&free_before, &total);
  uint64_t unfreed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t freed = antman_mem_set_limit(mem, 0, &unfreed);
  const auto t1 = std::chrono::steady_clock::now();
  size_t free_after = 0;
  cudaMemGetInfo(&free_after, &total);
  const antman_mem_stats after = Stats(mem);
  std::printf("shrink %-8s: freed %8.1f MiB in %d regions, %.3f ms (last_shrink_ns %.3f ms), "
              "driver free +%.1f MiB\n",
              label, freed / double(MiB), int(after.shrink_regions_freed - before.shrink_regions_freed),
              Ms(t1 - t0), after.last_shrink_ns / 1e6, (double(free_after) - free_before) / MiB);
  CHECK(freed == before.reserved, "%s: freed %llu of %llu reserved", label,
        (unsigned long long)freed, (unsigned long long)before.reserved);
  CHECK(after.reserved == 0 && unfreed == 0, "%s: reserved %llu unfreed %llu", label,
        (unsigned long long)after.reserved, (unsigned long long)unfreed);
  // The memory really went back to the driver (other processes may move this a little).
  CHECK(free_after + 256 * MiB >= free_before + freed, "%s: driver free grew by %lld only", label,
        (long long)free_after - (long long)free_before);
}

}  // namespace

int main() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device or driver (%s)\n", cudaGetErrorString(e));
    return kSkip;
  }
  cudaSetDevice(0);
  cudaFree(nullptr);  // brings up the primary context the core also uses

  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_CUDA;
  c.device_ordinal = 0;
  c.limit = 256 * MiB;
  c.host_capacity = 512 * MiB;
  antman_mem* mem = nullptr;
  char err[512];
  if (antman_mem_create(&c, &mem, err, sizeof(err)) != 0) {
    std::fprintf(stderr, "FAIL: antman_mem_create with a visible GPU: %s\n", err);
    return 1;
  }
  const antman_mem_stats s0 = Stats(mem);
  std::printf("device capacity (free at create) %.1f GiB, limit %.0f MiB\n",
              s0.device_capacity / double(GiB), s0.limit / double(MiB));

  // Over the limit: the 5th and 6th 64 MiB blocks come from pinned host memory.
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(antman_mem_alloc(mem, 256, 64 * MiB));
  for (int i = 0; i < 6; ++i) {
    CHECK(blocks[i] != nullptr, "block %d", i);
    if (blocks[i] == nullptr) return 1;
    const int want_host = i >= 4;
    CHECK(antman_mem_is_host(mem, blocks[i]) == want_host, "block %d is_host", i);
    const cudaMemoryType t = MemoryType(blocks[i]);
    CHECK(t == (want_host ? cudaMemoryTypeHost : cudaMemoryTypeDevice), "block %d type %d", i, t);
  }
  antman_mem_stats s = Stats(mem);
  CHECK(s.in_use == 256 * MiB && s.host_in_use == 128 * MiB && s.host_fallbacks == 2,
        "in_use %llu host_in_use %llu fallbacks %llu", (unsigned long long)s.in_use,
        (unsigned long long)s.host_in_use, (unsigned long long)s.host_fallbacks);

  // A kernel reads and writes the host-backed buffer in place (mapped pinned memory, UVA).
  const size_t n = 64 * MiB / sizeof(int);
  int* host_ints = static_cast<int*>(blocks[4]);
  for (size_t i = 0; i < n; ++i) host_ints[i] = static_cast<int>(i);
  AddOne<<<1024, 256>>>(host_ints, n);
  CHECK(cudaDeviceSynchronize() == cudaSuccess, "kernel on host-backed buffer");
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += host_ints[i] != static_cast<int>(i) + 1;
  CHECK(bad == 0, "%zu wrong values in host-backed buffer", bad);

  // And a device block works as ordinary device memory.
  int* dev_ints = static_cast<int*>(blocks[0]);
  cudaMemset(dev_ints, 0, 64 * MiB);
  AddOne<<<1024, 256>>>(dev_ints, n);
  std::vector<int> back(n);
  CHECK(cudaMemcpy(back.data(), dev_ints, 64 * MiB, cudaMemcpyDeviceToHost) == cudaSuccess,
        "copy back");
  bad = 0;
  for (int v : back) bad += v != 1;
  CHECK(bad == 0, "%zu wrong values in device buffer", bad);
  for (void* p : blocks) antman_mem_free(mem, p);
  char why[512];
  CHECK(antman_mem_check_invariants(mem, why, sizeof(why)) == 0, "%s", why);

  // A limit requested now applies at the step boundary.
  antman_mem_request_limit(mem, 0);
  CHECK(Stats(mem).limit == 256 * MiB, "limit changed before the boundary");
  antman_mem_step_boundary(mem);
  s = Stats(mem);
  CHECK(s.limit == 0 && s.reserved == 0, "after boundary: limit %llu reserved %llu",
        (unsigned long long)s.limit, (unsigned long long)s.reserved);
  void* h = antman_mem_alloc(mem, 256, MiB);
  CHECK(h != nullptr && antman_mem_is_host(mem, h) == 1, "limit 0 sends work to the host");
  antman_mem_free(mem, h);

  TimedShrink(mem, GiB, "1 GiB");
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  if (free_bytes > 20 * GiB) TimedShrink(mem, 16 * GiB, "16 GiB");

  // Safe points (issues 29/30): a region whose last block is freed above the limit, while a kernel
  // may still use it, is queued (no cuMemFree inside the free); the step boundary synchronises the
  // device and gives it back. And a device-only request never lands in host memory.
  antman_mem_set_limit(mem, 256 * MiB, nullptr);
  void* q = antman_mem_alloc(mem, 256, 128 * MiB);
  CHECK(q != nullptr && antman_mem_is_host(mem, q) == 0, "128 MiB device block");
  if (q != nullptr) {
    antman_mem_set_limit(mem, 0, nullptr);  // q's region holds a live block: it stays
    size_t free_before = 0, free_mid = 0, free_after = 0;
    cudaMemGetInfo(&free_before, &total);
    AddOne<<<1024, 256>>>(static_cast<int*>(q), 128 * MiB / sizeof(int));  // still running...
    antman_mem_free(mem, q);                                               // ... when freed
    cudaMemGetInfo(&free_mid, &total);
    antman_mem_ext_stats e0{};
    antman_mem_get_ext_stats(mem, &e0, sizeof(e0));
    CHECK(e0.deferred_release_bytes >= 128 * MiB, "queued %llu",
          (unsigned long long)e0.deferred_release_bytes);
    CHECK(free_mid < free_before + 128 * MiB, "memory went back inside the free");
    antman_mem_step_boundary(mem);
    cudaMemGetInfo(&free_after, &total);
    antman_mem_ext_stats e1{};
    antman_mem_get_ext_stats(mem, &e1, sizeof(e1));
    CHECK(e1.deferred_release_bytes == 0 && e1.release_syncs > e0.release_syncs,
          "step boundary: queued %llu syncs %llu", (unsigned long long)e1.deferred_release_bytes,
          (unsigned long long)e1.release_syncs);
    CHECK(free_after >= free_mid + 120 * MiB, "driver free memory grew by %.1f MiB only",
          (double(free_after) - double(free_mid)) / MiB);
    std::printf("safe point: %.1f MiB given back at the step boundary, sync %.3f ms\n",
                (double(free_after) - double(free_mid)) / MiB, e1.last_release_sync_ns / 1e6);
    CHECK(antman_mem_alloc_device_only(mem, 256, MiB) == nullptr, "device-only at limit 0");
  }

  CHECK(antman_mem_check_invariants(mem, why, sizeof(why)) == 0, "%s", why);
  antman_mem_destroy(mem);
  std::printf("%s (%d failures)\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
