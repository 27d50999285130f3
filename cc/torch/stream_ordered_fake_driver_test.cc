// The stream-ordered cache with its real CUDA events (cuda_events.cc) against cc/core's
// asynchronous fake CUDA driver (cc/core/testdata/fake_cuda_driver.cc: streams run their work on
// host threads; fake kernels sleep, then write their buffer). Called the way PyTorch calls it:
// malloc on a stream, a kernel queued there, record_stream and a kernel on another stream, free
// while the kernels are still queued. Fails on a block handed out while a kernel of another
// stream still uses it (fake_cuda_in_flight_on), and on the fake's own `races` count (a kernel
// launched on a buffer another stream's kernel, not ordered before it, still uses). The same calls
// against the old shim (every free straight back to the core) are seen to fail. Streams are held
// with fake_cuda_block_stream, so no test depends on timing.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cc/core/antman_memory.h"
#include "cc/torch/core_source.h"
#include "cc/torch/cuda_events.h"
#include "cc/torch/stream_ordered.h"

namespace {

constexpr uint64_t MiB = 1024 * 1024;
int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

struct Fake {
  int (*cuInit)(unsigned) = nullptr;
  int (*cuStreamCreate)(void**, unsigned) = nullptr;
  int (*cuStreamSynchronize)(void*) = nullptr;
  int (*launch)(void*, void*, size_t, int, int) = nullptr;
  long long (*in_flight_on)(const void*, size_t) = nullptr;  // NOLINT(runtime/int)
  long long (*get64)(const char*) = nullptr;                   // NOLINT(runtime/int)
  int (*get)(const char*) = nullptr;
  int (*cuDevicePrimaryCtxRetain)(void**, int) = nullptr;
  int (*cuCtxPushCurrent)(void*) = nullptr;
  int (*cuCtxPopCurrent)(void**) = nullptr;
  void (*block)(void*, int) = nullptr;
  void (*reset)() = nullptr;
};

Fake g;
const char* g_path = nullptr;

template <typename F>
void Sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) std::fprintf(stderr, "fake driver lacks %s\n", name);
}

antman_mem* MakeCore() {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_EMULATED;
  c.device_capacity = 256 * MiB;
  c.limit = 64 * MiB;
  c.host_capacity = 64 * MiB;
  antman_mem* mem = nullptr;
  char err[256] = {0};
  if (antman_mem_create(&c, &mem, err, sizeof(err)) != 0) std::fprintf(stderr, "core: %s\n", err);
  return mem;
}

void* NewStream() {
  void* s = nullptr;
  g.cuStreamCreate(&s, 0);
  return s;
}

// The old shim: streams ignored.
struct ShimLike {
  antman_torch::BlockSource* src;
  void* Malloc(size_t n, void*) { return src->Alloc(n, false); }
  void Free(void* p) { src->Free(p); }
  void RecordStream(void*, void*) {}
};
struct Cache {
  antman_torch::StreamOrderedCache* c;
  void* Malloc(size_t n, void* s) { return c->Malloc(n, s); }
  void Free(void* p) { c->Free(p); }
  void RecordStream(void* p, void* s) { c->RecordStream(p, s); }
};

// A block freed while its stream's kernel is held is asked for on another stream. Returns the
// kernels of other streams still in flight on what the second stream got.
template <typename A>
long long FreedThenAskedForOnAnotherStream(A alloc, void* a, void* b) {  // NOLINT(runtime/int)
  void* p = alloc.Malloc(MiB, a);
  g.block(a, 1);
  g.launch(a, p, MiB, 0, 1);  // queued behind the held worker
  alloc.Free(p);
  void* q = alloc.Malloc(MiB, b);
  const long long busy = g.in_flight_on(q, MiB);  // NOLINT(runtime/int)
  g.launch(b, q, MiB, 0, 2);
  g.block(a, 0);
  g.cuStreamSynchronize(a);
  g.cuStreamSynchronize(b);
  alloc.Free(q);
  return busy;
}

void TestTheOldShimIsCaught() {
  antman_mem* mem = MakeCore();
  antman_torch::CoreSource src(mem);
  void* a = NewStream();
  void* b = NewStream();
  g.reset();
  CHECK(FreedThenAskedForOnAnotherStream(ShimLike{&src}, a, b) > 0);
  CHECK(g.get64("races") > 0);
  antman_mem_destroy(mem);
}

void TestAnotherStreamWaitsForTheEvent() {
  antman_mem* mem = MakeCore();
  {
    antman_torch::CoreSource src(mem);
    antman_torch::CudaEvents events(0, g_path);
    antman_torch::StreamOrderedCache cache(&src, &events);
    void* a = NewStream();
    void* b = NewStream();
    void* warm = cache.Malloc(4096, b);  // two allocating streams from the start
    g.reset();
    CHECK(FreedThenAskedForOnAnotherStream(Cache{&cache}, a, b) == 0);
    CHECK(g.get64("races") == 0);
    CHECK(events.Error().empty());
    cache.Free(warm);
  }
  antman_mem_destroy(mem);
}

void TestRecordStreamHoldsTheBlockFromItsOwnStream() {
  antman_mem* mem = MakeCore();
  {
    antman_torch::CoreSource src(mem);
    antman_torch::CudaEvents events(0, g_path);
    antman_torch::StreamOrderedCache cache(&src, &events);
    void* a = NewStream();
    void* comm = NewStream();  // e.g. DDP's communication stream
    g.reset();
    void* p = cache.Malloc(MiB, a);
    cache.RecordStream(p, comm);
    g.block(comm, 1);
    g.launch(comm, p, MiB, 0, 3);
    cache.Free(p);
    void* q = cache.Malloc(MiB, a);
    CHECK(g.in_flight_on(q, MiB) == 0);
    g.launch(a, q, MiB, 0, 4);
    g.block(comm, 0);
    g.cuStreamSynchronize(comm);
    g.cuStreamSynchronize(a);
    cache.Free(q);
    CHECK(g.get64("races") == 0);
    cache.Poll();
    CHECK(cache.Stats().kept_blocks == 0);  // the events completed: everything back in the core
  }
  antman_mem_destroy(mem);
}

void TestRandomWorkOverThreeStreams() {
  antman_mem* mem = MakeCore();
  {
    antman_torch::CoreSource src(mem);
    antman_torch::CudaEvents events(0, g_path);
    antman_torch::StreamOrderedCache cache(&src, &events);
    void* streams[3] = {NewStream(), NewStream(), NewStream()};
    g.reset();
    std::mt19937 rng(5);
    struct Live {
      void* p;
      size_t n;
      void* s;
      void* last;  // the stream of its latest kernel
    };
    std::vector<Live> live;
    const size_t sizes[] = {4096, 64 * 1024, MiB};
    long long busy = 0;  // NOLINT(runtime/int)
    for (int i = 0; i < 600; ++i) {
      const unsigned r = rng() % 100;
      if ((r < 45 && live.size() < 24) || live.empty()) {
        void* s = streams[rng() % 3];
        const size_t n = sizes[rng() % 3];
        void* p = cache.Malloc(n, s);
        busy += g.in_flight_on(p, n);  // nothing of another stream may still be on it...
        g.launch(s, p, n, static_cast<int>(rng() % 200), 5);  // ...its own stream's is ordered
        live.push_back({p, n, s, s});
      } else if (r < 65) {
        Live& b = live[rng() % live.size()];
        void* t = streams[rng() % 3];
        cache.RecordStream(b.p, t);
        // The program's own ordering, as code does with wait_stream: a kernel of another stream
        // runs after the block's previous one (else the fake counts the program's race).
        if (t != b.last) g.cuStreamSynchronize(b.last);
        g.launch(t, b.p, b.n, static_cast<int>(rng() % 200), 6);
        b.last = t;
      } else {
        const size_t k = rng() % live.size();
        cache.Free(live[k].p);
        live[k] = live.back();
        live.pop_back();
      }
    }
    for (const Live& b : live) cache.Free(b.p);
    for (void* s : streams) g.cuStreamSynchronize(s);
    // in_flight_on counts the allocating stream's own queued kernels too: only races, which the
    // fake counts for unordered kernels of other streams, decide.
    std::printf("  random: %lld kernels, %lld in flight at allocation (any stream), races %lld\n",
                g.get64("kernels_launched"), busy, g.get64("races"));
    CHECK(g.get64("races") == 0);
  }
  antman_mem_destroy(mem);
}

// PyTorch calls the allocator from threads that have the primary context current: there each
// event call makes no push; a thread with no context current still gets it pushed and popped.
void TestTheContextIsPushedOnlyWhenNotCurrent() {
  antman_torch::CudaEvents events(0, g_path);
  void* s = NewStream();
  const int depth = g.get("ctx_depth");
  auto every_call = [&] {
    antman_torch::Event e = events.Record(s);
    CHECK(e != nullptr);
    events.Done(e);
    events.Wait(e);
    events.Synchronize(s);
    events.Release(e);
  };
  g.reset();
  every_call();
  CHECK(g.get64("ctx_pushes") == 4);  // Record, Done, Wait, Synchronize
  CHECK(g.get("ctx_depth") == depth);

  void* ctx = nullptr;
  CHECK(g.cuDevicePrimaryCtxRetain(&ctx, 0) == 0);
  CHECK(g.cuCtxPushCurrent(ctx) == 0);
  g.reset();
  every_call();
  CHECK(g.get64("ctx_pushes") == 0);
  CHECK(g.get("ctx_depth") == depth + 1);
  void* popped = nullptr;
  g.cuCtxPopCurrent(&popped);
  CHECK(events.Error().empty());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s path/to/libfake_cuda_driver.so\n", argv[0]);
    return 2;
  }
  g_path = argv[1];
  void* lib = dlopen(g_path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen(%s): %s\n", g_path, dlerror());
    return 2;
  }
  Sym(lib, "cuInit", &g.cuInit);
  Sym(lib, "cuStreamCreate", &g.cuStreamCreate);
  Sym(lib, "cuStreamSynchronize", &g.cuStreamSynchronize);
  Sym(lib, "fake_cuda_launch", &g.launch);
  Sym(lib, "fake_cuda_in_flight_on", &g.in_flight_on);
  Sym(lib, "fake_cuda_get64", &g.get64);
  Sym(lib, "fake_cuda_get", &g.get);
  Sym(lib, "cuDevicePrimaryCtxRetain", &g.cuDevicePrimaryCtxRetain);
  Sym(lib, "cuCtxPushCurrent_v2", &g.cuCtxPushCurrent);
  Sym(lib, "cuCtxPopCurrent_v2", &g.cuCtxPopCurrent);
  Sym(lib, "fake_cuda_block_stream", &g.block);
  Sym(lib, "fake_cuda_reset_counters", &g.reset);
  g.cuInit(0);
  const struct {
    const char* name;
    void (*fn)();
  } cases[] = {
      {"TheOldShimIsCaught", TestTheOldShimIsCaught},
      {"AnotherStreamWaitsForTheEvent", TestAnotherStreamWaitsForTheEvent},
      {"RecordStreamHoldsTheBlockFromItsOwnStream", TestRecordStreamHoldsTheBlockFromItsOwnStream},
      {"RandomWorkOverThreeStreams", TestRandomWorkOverThreeStreams},
      {"TheContextIsPushedOnlyWhenNotCurrent", TestTheContextIsPushedOnlyWhenNotCurrent},
  };
  int failed = 0;
  for (const auto& c : cases) {
    const int before = g_failures;
    c.fn();
    failed += g_failures != before;
    std::printf("[ %s ] %s\n", g_failures == before ? " OK " : "FAIL", c.name);
  }
  std::printf("%zu cases, %d failed\n", sizeof(cases) / sizeof(cases[0]), failed);
  return failed == 0 ? 0 : 1;
}
