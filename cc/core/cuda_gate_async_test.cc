// The CUDA event gate against the asynchronous fake driver (testdata/fake_cuda_driver.cc, path in
// argv[1]): streams run their work on host threads, events complete with their stream's prior
// work, on the real clock. Judged independently by the fake's own record of kernel execution
// intervals, not by the gate's arithmetic:
//  - host work between begin and the launch is not charged (red before the gate clipped at end);
//  - ops on a capturing stream pass uncharged and nothing the gate does invalidates a capture,
//    its own or another thread's (red before the capture check and the relaxed capture mode).
// The bounds below compare sums of intervals with each other, with tens of ms between them;
// they do not depend on how fast this machine is.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "cc/core/cuda_gate.h"
#include "cc/core/cuda_gate_internal.h"
#include "cc/core/op_manager.h"
#include "cc/core/test_check.h"
#include "cc/core/testdata/fake_cuda_driver.h"

namespace {

using antman::CudaGate;
using antman::OpManager;

constexpr int64_t kMs = 1000 * 1000;
antman_test::FakeCuda f;
const char* g_path = nullptr;

struct Rig {
  std::unique_ptr<OpManager> manager;
  std::unique_ptr<CudaGate> gate;
  explicit Rig(int64_t anchor_interval_ns = 1000 * kMs) {
    OpManager::Options o;
    o.initial_share = 0.5;             // throttled: begin records events
    o.max_credit_ns = 1000 * 1000 * kMs;  // admission never waits: only timing is judged
    manager = std::make_unique<OpManager>(o);
    std::string err;
    const antman::GateDriver* d = antman::LoadGateDriverFrom(g_path, &err);
    if (d == nullptr) {
      std::fprintf(stderr, "driver: %s\n", err.c_str());
      return;
    }
    CudaGate::Options g;
    g.poll_interval_ns = 50 * 1000;
    g.anchor_interval_ns = anchor_interval_ns;
    int code = 0;
    gate = CudaGate::Create(manager.get(), g, d, &err, &code);
    if (gate == nullptr) std::fprintf(stderr, "gate: %s\n", err.c_str());
  }
  ~Rig() {
    gate.reset();
    manager.reset();
  }
};

void* NewStream() {
  void* s = nullptr;
  f.cuStreamCreate(&s, 0);
  return s;
}

}  // namespace

TEST(HostWorkBetweenLaunchesIsNotCharged) {
  Rig rig;
  REQUIRE(rig.gate != nullptr);
  void* s = NewStream();
  f.reset_counters();
  constexpr int kOps = 4;
  constexpr int kHostMs = 40;
  constexpr int kKernelUs = 5000;
  for (int i = 0; i < kOps; ++i) {
    CudaGate::Op* op = nullptr;
    std::string err;
    EXPECT_EQ(rig.gate->Begin(s, &op, &err), ANTMAN_OK);
    REQUIRE(op != nullptr);
    // The op's host work: the stream is idle meanwhile.
    std::this_thread::sleep_for(std::chrono::milliseconds(kHostMs));
    // Held until end has been called, so the kernel runs after it (no undercount to allow for).
    f.block_stream(s, 1);
    EXPECT_EQ(f.launch(s, nullptr, 0, kKernelUs, 0), 0);
    EXPECT_EQ(rig.gate->End(op, &err), ANTMAN_OK);
    f.block_stream(s, 0);
  }
  rig.gate->Drain();
  const int64_t kernel_ns = f.get64("kernel_busy_ns");
  const int64_t charged = rig.gate->stats().device_busy_ns;
  std::printf("  kernels ran %lld ns, gate charged %lld ns, host gap %lld ns\n",
              static_cast<long long>(kernel_ns), static_cast<long long>(charged),
              static_cast<long long>(rig.gate->ext_stats().host_gap_ns));
  EXPECT_EQ(f.get64("kernels_completed"), kOps);
  EXPECT_EQ(rig.gate->stats().ops_completed, kOps);
  // Each charged interval contains its kernel's run (end event after it, start at the end call
  // before it): up to the anchor's placement error, never less.
  EXPECT(charged >= kernel_ns - kOps * 1 * kMs);
  // And the host work (kOps x 40 ms) is not in it: before the fix charged ~ kernels + 160 ms.
  EXPECT(charged < kernel_ns + kOps * kHostMs * kMs / 2);
  EXPECT(rig.gate->ext_stats().host_gap_ns >= kOps * kHostMs * kMs / 2);
  f.cuStreamDestroy(s);
}

TEST(CaptureIsLetThroughAndNeverInvalidated) {
  // Anchors go stale at once: begin re-anchors (a cuEventSynchronize) on the capturing thread.
  Rig rig(/*anchor_interval_ns=*/1 * kMs);
  REQUIRE(rig.gate != nullptr);
  void* capturing = NewStream();
  void* other = NewStream();
  f.reset_counters();
  REQUIRE(f.cuStreamBeginCapture(capturing, antman_test::kCuCaptureModeGlobal) == 0);
  std::string err;
  for (int i = 0; i < 3; ++i) {
    // An op on the capturing stream: let through, nothing recorded on it.
    CudaGate::Op* op = reinterpret_cast<CudaGate::Op*>(0x1);
    EXPECT_EQ(rig.gate->Begin(capturing, &op, &err), ANTMAN_OK);
    EXPECT(op == nullptr);
    f.launch(capturing, nullptr, 0, 100, 0);
    EXPECT_EQ(rig.gate->End(op, &err), ANTMAN_OK);
    // An op on another stream, from the capturing thread, while the capture runs: its events
    // are recorded and the poller queries them (another thread, GLOBAL mode by default).
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the anchor is stale now
    op = nullptr;
    EXPECT_EQ(rig.gate->Begin(other, &op, &err), ANTMAN_OK);
    EXPECT(op != nullptr);
    f.launch(other, nullptr, 0, 1000, 0);
    EXPECT_EQ(rig.gate->End(op, &err), ANTMAN_OK);
  }
  rig.gate->Drain();
  // The timing-only path too: an op whose `done` is told (0, 0), not an error.
  int done_calls = 0;
  int64_t done_start = -1;
  CudaGate::Op* timed = nullptr;
  EXPECT_EQ(rig.gate->BeginTimed(capturing, &timed, &err), ANTMAN_OK);
  REQUIRE(timed != nullptr);
  EXPECT_EQ(rig.gate->EndTimed(
                timed,
                [&](int64_t s, int64_t) {
                  ++done_calls;
                  done_start = s;
                },
                &err),
            ANTMAN_OK);
  rig.gate->Drain();
  EXPECT_EQ(done_calls, 1);
  EXPECT_EQ(done_start, 0);
  EXPECT_EQ(f.get64("capture_invalidations"), 0);
  if (f.get64("capture_invalidations") != 0) {
    std::fprintf(stderr, "  invalidated by %s\n", f.last_invalidation());
  }
  void* graph = nullptr;
  EXPECT_EQ(f.cuStreamEndCapture(capturing, &graph), 0);
  EXPECT(graph != nullptr);
  if (graph != nullptr) f.cuGraphDestroy(graph);
  antman_gate_stats s = rig.gate->stats();
  EXPECT_EQ(s.ops_completed, 3);
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(rig.gate->ext_stats().ops_captured, 4);
  EXPECT_EQ(rig.manager->stats().ops_total, 3);  // captured ops were not admitted
  f.cuStreamDestroy(capturing);
  f.cuStreamDestroy(other);
}

int main(int argc, char** argv) {
  if (argc < 2 || !f.Load(argv[1])) {
    std::fprintf(stderr, "usage: %s PATH_TO_FAKE_DRIVER.so\n", argv[0]);
    return 2;
  }
  g_path = argv[1];
  // The gate retains the primary context and pushes it where needed; the test thread launches
  // fake kernels and captures, which need no context in the fake.
  return antman_test::RunAll();
}
