// The fake CUDA driver's own model (testdata/fake_cuda_driver.cc): work completes asynchronously
// and in stream order, events complete with their stream's prior work, cross-stream reuse without
// an event wait is seen as a race, capacity refusals, cuMemFree's synchronisation, and the stream
// capture rules. The allocator and gate tests build on these behaviours, so they are pinned here.
// Blocked streams (fake_cuda_block_stream) keep work in flight without timing assumptions.
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "cc/core/test_check.h"
#include "cc/core/testdata/fake_cuda_driver.h"

namespace {

antman_test::FakeCuda f;
using antman_test::kCuCaptureModeGlobal;
using antman_test::kCuCaptureModeRelaxed;
using antman_test::kCuCaptureModeThreadLocal;
using antman_test::kCuCaptureStatusActive;
using antman_test::kCuCaptureStatusInvalidated;
using antman_test::kCuCaptureStatusNone;
using antman_test::kCuErrorCaptureInvalidated;
using antman_test::kCuErrorCaptureUnsupported;
using antman_test::kCuErrorNotReady;
using antman_test::kCuErrorOutOfMemory;

void* NewStream() {
  void* s = nullptr;
  f.cuStreamCreate(&s, 0);
  return s;
}

void* NewEvent() {
  void* e = nullptr;
  f.cuEventCreate(&e, 0);
  return e;
}

}  // namespace

TEST(EventsCompleteWithTheirStreamsPriorWork) {
  f.reset_counters();
  void* s = NewStream();
  void* e = NewEvent();
  char buf[64] = {};
  f.block_stream(s, 1);
  EXPECT_EQ(f.launch(s, buf, sizeof(buf), 100, 7), 0);
  EXPECT_EQ(f.cuEventRecord(e, s), 0);
  EXPECT_EQ(f.cuEventQuery(e), kCuErrorNotReady);  // the kernel has not run
  EXPECT_EQ(f.cuStreamQuery(s), kCuErrorNotReady);
  EXPECT_EQ(f.in_flight_on(buf + 10, 1), 1);
  EXPECT_EQ(f.in_flight_on(buf + 64, 1), 0);
  EXPECT_EQ(buf[0], 0);
  f.block_stream(s, 0);
  EXPECT_EQ(f.cuEventSynchronize(e), 0);
  EXPECT_EQ(f.cuEventQuery(e), 0);
  EXPECT_EQ(buf[0], 7);  // the kernel wrote its buffer
  EXPECT_EQ(f.in_flight_on(buf, sizeof(buf)), 0);
  EXPECT_EQ(f.get64("kernels_completed"), 1);
  long long iv[2] = {0, 0};
  EXPECT_EQ(f.kernel_intervals(iv, 1), 1);
  EXPECT(iv[1] - iv[0] >= 100 * 1000);  // it slept its delay
  // An event recorded after the kernel is stamped no earlier than the kernel's end.
  void* a = NewEvent();
  void* b = NewEvent();
  f.cuEventRecord(a, s);
  f.launch(s, nullptr, 0, 200, 0);
  f.cuEventRecord(b, s);
  EXPECT_EQ(f.cuStreamSynchronize(s), 0);
  float ms = 0;
  EXPECT_EQ(f.cuEventElapsedTime(&ms, a, b), 0);
  EXPECT(ms >= 0.2f);
  // A never-recorded event is complete (cuda.h: cuEventQuery).
  void* fresh = NewEvent();
  EXPECT_EQ(f.cuEventQuery(fresh), 0);
  for (void* ev : {e, a, b, fresh}) f.cuEventDestroy(ev);
  f.cuStreamDestroy(s);
}

TEST(CrossStreamReuseWithoutAWaitIsARace) {
  f.reset_counters();
  void* s1 = NewStream();
  void* s2 = NewStream();
  char buf[256] = {};
  f.block_stream(s1, 1);
  f.launch(s1, buf, sizeof(buf), 0, 1);
  f.launch(s2, buf + 128, 16, 0, 2);  // s1's kernel may still use it: race
  EXPECT_EQ(f.get64("races"), 1);
  // Ordered through an event: s2 waits for s1's kernel first.
  void* e = NewEvent();
  f.cuEventRecord(e, s1);
  f.cuStreamWaitEvent(s2, e, 0);
  f.launch(s2, buf, 16, 0, 3);
  EXPECT_EQ(f.get64("races"), 1);
  f.launch(s1, buf + 200, 16, 0, 4);  // same stream as the kernel it overlaps: stream order
  EXPECT_EQ(f.get64("races"), 1);
  f.block_stream(s1, 0);
  EXPECT_EQ(f.cuCtxSynchronize(), 0);
  EXPECT_EQ(buf[0], 3);  // s2's kernel waited for s1's first one: its write comes last
  EXPECT_EQ(buf[200], 4);
  // Completed kernels are not in flight: reuse after completion is no race.
  f.launch(s2, buf, sizeof(buf), 0, 5);
  EXPECT_EQ(f.get64("races"), 1);
  f.cuCtxSynchronize();
  f.cuEventDestroy(e);
  f.cuStreamDestroy(s1);
  f.cuStreamDestroy(s2);
}

TEST(MemoryCapacityRefusalsAndFreeSynchronises) {
  f.reset_counters();
  const long long kMiB = 1 << 20;
  f.set64("total", 64 * kMiB);
  f.set64("other_process", 16 * kMiB);
  size_t free_bytes = 0;
  size_t total = 0;
  EXPECT_EQ(f.cuMemGetInfo(&free_bytes, &total), 0);
  EXPECT_EQ(free_bytes, size_t(48 * kMiB));
  EXPECT_EQ(total, size_t(64 * kMiB));
  unsigned long long a = 0, b = 0;  // NOLINT(runtime/int)
  EXPECT_EQ(f.cuMemAlloc(&a, 40 * kMiB), 0);
  EXPECT_EQ(f.cuMemAlloc(&b, 10 * kMiB), kCuErrorOutOfMemory);
  EXPECT_EQ(f.get64("alloc_refusals"), 1);
  f.cuMemGetInfo(&free_bytes, &total);
  EXPECT_EQ(free_bytes, size_t(8 * kMiB));
  // cuMemFree waits for the device when work is in flight.
  void* s = NewStream();
  f.launch(s, nullptr, 0, 1000, 0);
  EXPECT_EQ(f.cuMemFree(a), 0);
  EXPECT_EQ(f.get64("in_flight"), 0);
  EXPECT_EQ(f.get64("free_syncs"), 1);
  EXPECT_EQ(f.cuMemAlloc(&b, 10 * kMiB), 0);
  EXPECT_EQ(f.cuMemFree(b), 0);  // idle device: nothing to wait for
  EXPECT_EQ(f.get64("free_syncs"), 1);
  f.set64("total", 2LL << 30);
  f.set64("other_process", 1LL << 30);
  f.cuStreamDestroy(s);
}

TEST(UnsafeCallsDuringAGlobalCaptureInvalidateIt) {
  f.reset_counters();
  void* ctx = nullptr;
  f.cuDevicePrimaryCtxRetain(&ctx, 0);
  f.cuCtxPushCurrent(ctx);
  void* s = NewStream();
  int status = -1;
  EXPECT_EQ(f.cuStreamIsCapturing(s, &status), 0);
  EXPECT_EQ(status, kCuCaptureStatusNone);
  EXPECT_EQ(f.cuStreamBeginCapture(s, kCuCaptureModeGlobal), 0);
  EXPECT_EQ(f.cuStreamIsCapturing(s, &status), 0);
  EXPECT_EQ(status, kCuCaptureStatusActive);
  EXPECT_EQ(f.cuStreamBeginCapture(nullptr, kCuCaptureModeGlobal), kCuErrorCaptureUnsupported);
  char buf[32] = {};
  f.launch(s, buf, sizeof(buf), 0, 9);  // captured, not run
  void* e = NewEvent();
  EXPECT_EQ(f.cuEventQuery(e), kCuErrorCaptureUnsupported);  // from a GLOBAL-mode thread
  EXPECT_EQ(f.get64("capture_invalidations"), 1);
  EXPECT(std::string(f.last_invalidation()) == "cuEventQuery");
  EXPECT_EQ(f.cuStreamIsCapturing(s, &status), 0);
  EXPECT_EQ(status, kCuCaptureStatusInvalidated);
  void* graph = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(f.cuStreamEndCapture(s, &graph), kCuErrorCaptureInvalidated);
  EXPECT(graph == nullptr);
  EXPECT_EQ(buf[0], 0);

  // Another thread in GLOBAL mode is prohibited too; one that switched to RELAXED is not.
  EXPECT_EQ(f.cuStreamBeginCapture(s, kCuCaptureModeGlobal), 0);
  int other_rc = -1;
  std::thread([&] {
    unsigned long long p = 0;  // NOLINT(runtime/int)
    f.cuCtxPushCurrent(ctx);
    int mode = kCuCaptureModeRelaxed;
    f.cuThreadExchangeStreamCaptureMode(&mode);
    other_rc = f.cuMemAlloc(&p, 4096);
    if (other_rc == 0) f.cuMemFree(p);
    f.cuThreadExchangeStreamCaptureMode(&mode);
    EXPECT_EQ(mode, kCuCaptureModeRelaxed);
    void* popped = nullptr;
    f.cuCtxPopCurrent(&popped);
  }).join();
  EXPECT_EQ(other_rc, 0);
  EXPECT_EQ(f.get64("capture_invalidations"), 1);
  std::thread([&] {
    unsigned long long p = 0;  // NOLINT(runtime/int)
    other_rc = f.cuMemAlloc(&p, 4096);  // GLOBAL mode (the default)
  }).join();
  EXPECT_EQ(other_rc, kCuErrorCaptureUnsupported);
  EXPECT(std::string(f.last_invalidation()) == "cuMemAlloc");
  EXPECT_EQ(f.cuStreamEndCapture(s, &graph), kCuErrorCaptureInvalidated);

  // THREAD_LOCAL mode elsewhere ignores this thread's capture; a clean capture replays.
  EXPECT_EQ(f.cuStreamBeginCapture(s, kCuCaptureModeGlobal), 0);
  std::thread([&] {
    int mode = kCuCaptureModeThreadLocal;
    f.cuThreadExchangeStreamCaptureMode(&mode);
    void* ev = NewEvent();
    other_rc = f.cuEventQuery(ev);
    f.cuEventDestroy(ev);
  }).join();
  EXPECT_EQ(other_rc, 0);
  f.launch(s, buf, sizeof(buf), 0, 9);
  EXPECT_EQ(f.cuStreamEndCapture(s, &graph), 0);
  REQUIRE(graph != nullptr);
  void* exec = nullptr;
  EXPECT_EQ(f.cuGraphInstantiateWithFlags(&exec, graph, 0), 0);
  EXPECT_EQ(buf[0], 0);
  EXPECT_EQ(f.cuGraphLaunch(exec, s), 0);
  f.cuStreamSynchronize(s);
  EXPECT_EQ(buf[0], 9);  // a replay writes what the capture recorded
  EXPECT_EQ(f.get64("capture_invalidations"), 2);
  f.cuGraphExecDestroy(exec);
  f.cuGraphDestroy(graph);
  f.cuEventDestroy(e);
  f.cuStreamDestroy(s);
  void* popped = nullptr;
  f.cuCtxPopCurrent(&popped);
}

int main(int argc, char** argv) {
  if (argc < 2 || !f.Load(argv[1])) {
    std::fprintf(stderr, "usage: %s PATH_TO_FAKE_DRIVER.so\n", argv[0]);
    return 2;
  }
  return antman_test::RunAll();
}
