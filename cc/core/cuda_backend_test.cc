// The CUDA backend over a fake driver (testdata/fake_cuda_driver.cc, path in argv[1]): start-up
// refuses a device whose kernels could not use host-fallback memory (no unified addressing or no
// mapped host memory) with one clear error, and otherwise serves device and host regions from
// the driver inside the primary context.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cc/core/backend.h"
#include "cc/core/test_check.h"
#include "cc/core/testdata/fake_cuda_driver.h"
#include "cc/core/universal.h"

namespace {

constexpr uint64_t MiB = 1024 * 1024;
const char* g_driver = nullptr;
void (*g_set)(const char*, int) = nullptr;
int (*g_get)(const char*) = nullptr;

antman_mem_config Config(uint64_t host_capacity) {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_CUDA;
  c.host_capacity = host_capacity;
  return c;
}

// The start-up error; empty when the backend came up.
std::string StartUp(const antman_mem_config& c) {
  antman::Backend backend;
  std::string err;
  if (antman::MakeCudaBackendFrom(g_driver, c, &backend, &err)) return "";
  return err.empty() ? "failed without a message" : err;
}

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(RefusesADeviceWithoutUnifiedAddressing) {
  g_set("unified", 0);
  g_set("can_map", 1);
  const std::string why = StartUp(Config(64 * MiB));
  g_set("unified", 1);
  EXPECT(Contains(why, "CUDA device 0 supports no unified addressing"));
  EXPECT(Contains(why, "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING=0"));
  EXPECT(Contains(why, "ANTMAN_HOST_MEMORY=0"));
}

TEST(RefusesADeviceThatCannotMapHostMemory) {
  g_set("can_map", 0);
  const std::string why = StartUp(Config(64 * MiB));
  g_set("unified", 0);
  const std::string both = StartUp(Config(64 * MiB));
  g_set("unified", 1);
  g_set("can_map", 1);
  EXPECT(Contains(why, "supports no mapping of host memory"));
  EXPECT(Contains(why, "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY=0"));
  EXPECT(Contains(both, "unified addressing nor mapping of host memory"));
}

TEST(WithoutHostFallbackTheAttributesDoNotMatter) {
  g_set("unified", 0);
  g_set("can_map", 0);
  const std::string why = StartUp(Config(0));
  g_set("unified", 1);
  g_set("can_map", 1);
  EXPECT(why.empty());
}

TEST(RefusesAnOrdinalThatIsNotVisible) {
  antman_mem_config c = Config(0);
  c.device_ordinal = 1;
  EXPECT(Contains(StartUp(c), "device_ordinal: 1 is not in [0, 1)"));
}

TEST(ServesDeviceAndHostRegionsInThePrimaryContext) {
  antman::Backend backend;
  std::string err;
  REQUIRE(antman::MakeCudaBackendFrom(g_driver, Config(64 * MiB), &backend, &err));
  EXPECT_EQ(backend.device_capacity, uint64_t{1} << 30);  // free memory at creation
  {
    antman::UniversalOptions o;
    o.device_capacity = backend.device_capacity;
    o.limit = 4 * MiB;
    o.host_capacity = 64 * MiB;
    antman::UniversalAllocator u(backend.device.get(), backend.host.get(), o);
    void* d = u.Allocate(0, 3 * MiB);
    void* h = u.Allocate(0, 3 * MiB);
    REQUIRE(d && h);
    EXPECT_EQ(u.IsHost(d), 0);
    EXPECT_EQ(u.IsHost(h), 1);
    EXPECT(g_get("live_device") >= 1);
    EXPECT(g_get("live_host") >= 1);
    EXPECT(u.Free(d) && u.Free(h));
  }
  EXPECT_EQ(g_get("live_device"), 0);  // every region went back to the driver
  EXPECT_EQ(g_get("live_host"), 0);
  EXPECT_EQ(g_get("ctx_depth"), 0);    // every push popped
  EXPECT_EQ(g_get("alloc_outside_ctx"), 0);
}

TEST(AMissingDriverIsOneClearError) {
  const std::string why = [] {
    antman::Backend backend;
    std::string err;
    antman::MakeCudaBackendFrom("/nonexistent/libcuda.so.1", Config(0), &backend, &err);
    return err;
  }();
  EXPECT(Contains(why, "CUDA driver not available: dlopen(/nonexistent/libcuda.so.1) failed"));
}

antman_test::FakeCuda fake;

// Issues 29/30 against the asynchronous fake driver: a region whose last block is freed while a
// kernel still uses it (the framework frees when the kernel is enqueued) is not given back inside
// the free; the step boundary synchronises (cuCtxSynchronize) and then frees, so cuMemFree never
// has to wait for in-flight work (`free_syncs`), and no kernel was running on the memory.
TEST(RegionsGoBackAtTheStepBoundaryAfterTheDeviceDrained) {
  antman::Backend backend;
  std::string err;
  REQUIRE(antman::MakeCudaBackendFrom(g_driver, Config(0), &backend, &err));
  fake.reset_counters();
  antman::UniversalOptions o;
  o.device_capacity = backend.device_capacity;
  o.limit = 64 * MiB;
  o.min_region = 2 * MiB;
  o.max_region = 2 * MiB;
  antman::UniversalAllocator u(backend.device.get(), backend.host.get(), o);
  void* a = u.Allocate(0, 2 * MiB);
  void* b = u.Allocate(0, 2 * MiB);
  REQUIRE(a && b);
  u.SetLimit(2 * MiB);  // both regions hold live blocks: nothing can go now
  void* s = nullptr;
  fake.cuStreamCreate(&s, 0);
  fake.block_stream(s, 1);
  fake.launch(s, a, 2 * MiB, 1000, 1);  // a kernel still writes `a` ...
  const long long frees_before = fake.get64("free_calls");  // NOLINT(runtime/int)
  EXPECT(u.Free(a));                    // ... when the framework frees it
  EXPECT_EQ(fake.get64("free_calls"), frees_before);  // no driver call inside the free
  antman_mem_ext_stats e;
  u.GetExtStats(&e);
  EXPECT_EQ(e.deferred_release_bytes, 2 * MiB);
  antman_mem_stats st;
  u.GetStats(&st);
  EXPECT_EQ(st.reserved, 4 * MiB);  // still held from the driver: reported as reserved
  fake.block_stream(s, 0);
  u.StepBoundary();
  EXPECT_EQ(fake.get64("free_calls"), frees_before + 1);
  EXPECT_EQ(fake.get64("free_syncs"), 0);  // the device had drained before cuMemFree
  EXPECT_EQ(fake.get64("in_flight"), 0);
  u.GetExtStats(&e);
  EXPECT_EQ(e.deferred_release_bytes, 0u);
  EXPECT_EQ(e.release_syncs, 1u);
  u.GetStats(&st);
  EXPECT_EQ(st.reserved, 2 * MiB);
  EXPECT(u.Free(b));
  u.StepBoundary();
  fake.cuStreamDestroy(s);
}

// Another process holds most of the device: after the first refusal the allocator caps growth at
// what cuMemGetInfo says is free and stops asking the driver on every miss.
TEST(DriverRefusalsAreCappedByMemGetInfo) {
  antman::Backend backend;
  std::string err;
  REQUIRE(antman::MakeCudaBackendFrom(g_driver, Config(64 * MiB), &backend, &err));
  fake.set64("total", 64 * MiB);
  fake.set64("other_process", 56 * MiB);  // 8 MiB free for this job
  fake.reset_counters();
  {
    antman::UniversalOptions o;
    o.device_capacity = 64 * MiB;
    o.limit = 32 * MiB;  // the job's limit would allow more than the device has free
    o.host_capacity = 64 * MiB;
    o.min_region = 2 * MiB;
    o.max_region = 2 * MiB;
    antman::UniversalAllocator u(backend.device.get(), backend.host.get(), o);
    std::vector<void*> blocks;
    for (int i = 0; i < 20; ++i) {
      void* p = u.Allocate(0, 2 * MiB);
      REQUIRE(p != nullptr);
      blocks.push_back(p);
    }
    antman_mem_ext_stats e;
    u.GetExtStats(&e);
    EXPECT_EQ(e.driver_cap, 8 * MiB);
    EXPECT(e.driver_refusals >= 1u && e.driver_refusals <= 2u);
    EXPECT(fake.get64("alloc_refusals") <= 2);  // before: one per miss (16)
    antman_mem_stats st;
    u.GetStats(&st);
    EXPECT_EQ(st.in_use, 8 * MiB);
    EXPECT_EQ(st.host_in_use, 32 * MiB);
    for (void* p : blocks) EXPECT(u.Free(p));
  }
  fake.set64("total", 2LL << 30);
  fake.set64("other_process", 1LL << 30);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PATH_TO_FAKE_DRIVER.so\n", argv[0]);
    return 2;
  }
  g_driver = argv[1];
  void* lib = dlopen(g_driver, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", g_driver, dlerror());
    return 1;
  }
  g_set = reinterpret_cast<void (*)(const char*, int)>(dlsym(lib, "fake_cuda_set"));
  g_get = reinterpret_cast<int (*)(const char*)>(dlsym(lib, "fake_cuda_get"));
  if (g_set == nullptr || g_get == nullptr || !fake.Load(g_driver)) return 1;
  return antman_test::RunAll();
}
