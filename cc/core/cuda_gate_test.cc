// The CUDA event gate against a fake driver: events get device timestamps
// when the test says their work completed, elapsed times come back as float
// milliseconds like the real driver's, and the manager runs on a fake clock.
// What needs a real GPU runs in bench/gpu (compute_bench).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/cuda_gate.h"
#include "cc/core/cuda_gate_internal.h"
#include "cc/core/op_manager.h"
#include "cc/core/test_check.h"

namespace {

using antman::CudaGate;
using antman::OpManager;

constexpr int64_t kUs = 1000;
constexpr int64_t kMs = 1000 * kUs;
constexpr int64_t kS = 1000 * kMs;

// Virtual time; a timed wait jumps to its deadline.
class FakeClock final : public antman::Clock {
 public:
  int64_t NowNs() const override { return now_.load(); }
  void Advance(int64_t ns) { now_.fetch_add(ns); }
  void WaitUntil(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                 int64_t deadline_ns) override {
    if (deadline_ns == kForever) {
      cv.wait(lock);
      return;
    }
    int64_t now = now_.load();
    while (now < deadline_ns && !now_.compare_exchange_weak(now, deadline_ns)) {
    }
  }

 private:
  std::atomic<int64_t> now_{1000 * kS};
};

struct FakeEvent {
  bool recorded = false;
  bool complete = false;
  int64_t device_ns = 0;
  void* stream = nullptr;
};

// One fake device per test (the driver table is plain function pointers).
struct FakeDevice {
  std::mutex mu;
  FakeClock* clock = nullptr;
  // The device's clock has its own epoch: only differences are meaningful.
  int64_t device_offset_ns = 7'000 * kS + 123;
  std::vector<std::unique_ptr<FakeEvent>> events;
  std::deque<FakeEvent*> pending;  // recorded on user streams, not complete
  int created = 0;
  int destroyed = 0;
  int streams_alive = 0;
  int ctx_retained = 0;
  int fail_next_records = 0;
  int query_error = 0;  // returned by cuEventQuery instead of success when set
  int user_records = 0;
  // The gate's idle anchor stream: the device stamps an event this long after
  // its record call (submission), and a sync returns this long after the stamp
  // (the host noticing). 0 and 0: at once, as before these were modelled.
  int64_t anchor_submit_ns = 0;
  int64_t anchor_notify_ns = 0;
  // If not empty, the submission latency of the next anchor-stream records, one each (then
  // anchor_submit_ns): an event that waited for its context's time slice.
  std::deque<int64_t> anchor_submit_then;
};
FakeDevice* g_dev = nullptr;
char g_anchor_stream_tag;
void* const kAnchorStream = &g_anchor_stream_tag;
thread_local std::vector<void*> tl_ctx_stack;

FakeEvent* Ev(void* e) { return static_cast<FakeEvent*>(e); }

const antman::GateDriver* FakeDriver() {
  static antman::GateDriver d;
  d.cuInit = [](unsigned) { return 0; };
  d.cuDeviceGetCount = [](int* n) {
    *n = 1;
    return 0;
  };
  d.cuDeviceGet = [](int* dev, int ordinal) {
    *dev = ordinal;
    return 0;
  };
  d.cuDevicePrimaryCtxRetain = [](void** ctx, int) {
    ++g_dev->ctx_retained;
    *ctx = reinterpret_cast<void*>(0xC0);
    return 0;
  };
  d.cuDevicePrimaryCtxRelease = [](int) {
    --g_dev->ctx_retained;
    return 0;
  };
  d.cuCtxGetCurrent = [](void** ctx) {
    *ctx = tl_ctx_stack.empty() ? nullptr : tl_ctx_stack.back();
    return 0;
  };
  d.cuCtxPushCurrent = [](void* ctx) {
    tl_ctx_stack.push_back(ctx);
    return 0;
  };
  d.cuCtxPopCurrent = [](void** ctx) {
    *ctx = tl_ctx_stack.back();
    tl_ctx_stack.pop_back();
    return 0;
  };
  d.cuEventCreate = [](void** e, unsigned) {
    std::lock_guard<std::mutex> lock(g_dev->mu);
    g_dev->events.push_back(std::make_unique<FakeEvent>());
    *e = g_dev->events.back().get();
    ++g_dev->created;
    return 0;
  };
  d.cuEventDestroy = [](void*) {
    std::lock_guard<std::mutex> lock(g_dev->mu);
    ++g_dev->destroyed;
    return 0;
  };
  d.cuEventRecord = [](void* e, void* stream) {
    std::lock_guard<std::mutex> lock(g_dev->mu);
    if (tl_ctx_stack.empty() || tl_ctx_stack.back() != reinterpret_cast<void*>(0xC0)) {
      return 201;  // CUDA_ERROR_INVALID_CONTEXT: the gate must make its context current
    }
    if (stream != kAnchorStream && g_dev->fail_next_records > 0) {
      --g_dev->fail_next_records;
      return 1;
    }
    FakeEvent* ev = Ev(e);
    ev->recorded = true;
    ev->stream = stream;
    if (stream == kAnchorStream) {  // the gate's idle private stream: done once submitted
      ev->complete = true;
      int64_t submit = g_dev->anchor_submit_ns;
      if (!g_dev->anchor_submit_then.empty()) {
        submit = g_dev->anchor_submit_then.front();
        g_dev->anchor_submit_then.pop_front();
      }
      ev->device_ns = g_dev->clock->NowNs() + submit + g_dev->device_offset_ns;
    } else {
      ev->complete = false;
      ++g_dev->user_records;
      g_dev->pending.push_back(ev);
    }
    return 0;
  };
  d.cuEventQuery = [](void* e) {
    std::lock_guard<std::mutex> lock(g_dev->mu);
    if (!Ev(e)->complete) return antman::kCuErrorNotReady;
    return g_dev->query_error;
  };
  d.cuEventSynchronize = [](void* e) {
    std::lock_guard<std::mutex> lock(g_dev->mu);
    if (!Ev(e)->complete) return 999;
    // The host learns of the stamp anchor_notify_ns after it (the fake clock moves on).
    const int64_t noticed = Ev(e)->device_ns - g_dev->device_offset_ns + g_dev->anchor_notify_ns;
    const int64_t now = g_dev->clock->NowNs();
    if (Ev(e)->stream == kAnchorStream && noticed > now) g_dev->clock->Advance(noticed - now);
    return 0;
  };
  d.cuEventElapsedTime = [](float* ms, void* a, void* b) {
    std::lock_guard<std::mutex> lock(g_dev->mu);
    if (!Ev(a)->complete || !Ev(b)->complete) return antman::kCuErrorNotReady;
    // The driver's answer is a float in ms: 24 bits of mantissa.
    *ms = static_cast<float>(static_cast<double>(Ev(b)->device_ns - Ev(a)->device_ns) / 1e6);
    return 0;
  };
  d.cuStreamCreate = [](void** s, unsigned) {
    ++g_dev->streams_alive;
    *s = kAnchorStream;
    return 0;
  };
  d.cuStreamDestroy = [](void*) {
    --g_dev->streams_alive;
    return 0;
  };
  d.cuGetErrorString = nullptr;
  return &d;
}

// Completes the oldest pending user-stream event at host time host_ns.
void CompleteNext(int64_t host_ns) {
  std::lock_guard<std::mutex> lock(g_dev->mu);
  REQUIRE(!g_dev->pending.empty());
  FakeEvent* ev = g_dev->pending.front();
  g_dev->pending.pop_front();
  ev->device_ns = host_ns + g_dev->device_offset_ns;
  ev->complete = true;
}

size_t PendingEvents() {
  std::lock_guard<std::mutex> lock(g_dev->mu);
  return g_dev->pending.size();
}

template <typename Pred>
bool Eventually(Pred done) {
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

struct Charged {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> intervals;
};

// A fake device, a manager on a fake clock and a gate over both.
struct Rig {
  FakeClock clock;
  FakeDevice dev;
  Charged charged;
  std::unique_ptr<OpManager> manager;
  std::unique_ptr<CudaGate> gate;

  explicit Rig(double share, int64_t anchor_interval_ns = 1 * kS, int64_t anchor_submit_ns = 0,
               int64_t anchor_notify_ns = 0, std::deque<int64_t> anchor_submit_then = {}) {
    g_dev = &dev;
    dev.clock = &clock;
    dev.anchor_submit_ns = anchor_submit_ns;
    dev.anchor_notify_ns = anchor_notify_ns;
    dev.anchor_submit_then = std::move(anchor_submit_then);
    OpManager::Options o;
    o.initial_share = share;
    o.max_credit_ns = 1000 * kS;  // admission never waits for tokens here
    o.clock = &clock;
    manager = std::make_unique<OpManager>(o);
    clock.Advance(10 * kS);  // bank credit
    CudaGate::Options g;
    g.poll_interval_ns = 1 * kUs;
    g.anchor_interval_ns = anchor_interval_ns;
    g.on_charged = [this](int64_t s, int64_t e) {
      std::lock_guard<std::mutex> lock(charged.mu);
      charged.intervals.emplace_back(s, e);
    };
    std::string err;
    int code = 0;
    gate = CudaGate::Create(manager.get(), g, FakeDriver(), &err, &code);
    if (gate == nullptr) std::fprintf(stderr, "gate: %s\n", err.c_str());
  }
  ~Rig() {
    gate.reset();
    manager.reset();
    g_dev = nullptr;
  }
  CudaGate::Op* Begin(void* stream) {
    CudaGate::Op* op = nullptr;
    std::string err;
    EXPECT_EQ(gate->Begin(stream, &op, &err), ANTMAN_OK);
    return op;
  }
  void End(CudaGate::Op* op) {
    std::string err;
    EXPECT_EQ(gate->End(op, &err), ANTMAN_OK);
  }
  // One op on `stream` the device runs as told: `host_ns` of host work and launches between begin
  // and end; its start event stamped `start_at` and its end event `end_at` after begin (host
  // clock). Returns the begin time, once the op is charged.
  int64_t RunOp(void* stream, int64_t host_ns, int64_t start_at, int64_t end_at) {
    const int64_t t = clock.NowNs();
    CudaGate::Op* op = Begin(stream);
    clock.Advance(host_ns);
    End(op);
    // Observed a while after the end: a placement a little late is not slid back to "now".
    clock.Advance(std::max(end_at - host_ns, int64_t{0}) + 1 * kMs);
    CompleteNext(t + start_at);
    CompleteNext(t + end_at);
    gate->Drain();
    return t;
  }
  std::vector<std::pair<int64_t, int64_t>> Intervals() {
    std::lock_guard<std::mutex> lock(charged.mu);
    return charged.intervals;
  }
};

int64_t Abs(int64_t v) { return v < 0 ? -v : v; }

void* Stream(int n) { return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 + n)); }

}  // namespace

TEST(PlacementMath) {
  using antman::PlaceOnHostClock;
  // anchor at 1'000'000 ns; start 2 us after it, 1 us long.
  auto iv = PlaceOnHostClock(1'000'000, 0.002f, 0.001f, 0, 10'000'000);
  EXPECT_EQ(iv.start_ns, 1'002'000);
  EXPECT_EQ(iv.end_ns, 1'003'000);
  // Rounding must not overlap the previous op of the stream.
  iv = PlaceOnHostClock(1'000'000, 0.002f, 0.001f, 1'002'500, 10'000'000);
  EXPECT_EQ(iv.start_ns, 1'002'500);
  EXPECT_EQ(iv.end_ns, 1'003'500);
  // Nor end after the completion was seen: slide back, keep the duration.
  iv = PlaceOnHostClock(1'000'000, 0.002f, 0.001f, 0, 1'002'400);
  EXPECT_EQ(iv.start_ns, 1'001'400);
  EXPECT_EQ(iv.end_ns, 1'002'400);
  // Both bounds at once: the floor wins, the interval shrinks, never inverts.
  iv = PlaceOnHostClock(1'000'000, 0.002f, 0.001f, 1'002'200, 1'002'400);
  EXPECT_EQ(iv.start_ns, 1'002'200);
  EXPECT_EQ(iv.end_ns, 1'002'400);
  // Negative duration noise is an empty interval.
  iv = PlaceOnHostClock(1'000'000, 0.0f, -0.0005f, 0, 10'000'000);
  EXPECT_EQ(iv.end_ns - iv.start_ns, 0);
}

TEST(ChargesKernelIntervalsInOrderAndRecyclesEvents) {
  Rig rig(0.5);
  REQUIRE(rig.gate != nullptr);
  const int64_t t = rig.clock.NowNs();
  CudaGate::Op* a = rig.Begin(Stream(1));
  rig.End(a);
  CudaGate::Op* b = rig.Begin(Stream(1));
  rig.End(b);
  EXPECT_EQ(rig.manager->stats().ops_in_flight, 2);
  rig.clock.Advance(5 * kMs);
  // The poller must wait for the first op even when it cannot see the second:
  // complete nothing yet and check nothing was charged.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(rig.gate->stats().ops_completed, 0);
  CompleteNext(t + 1 * kMs);  // a.start: the stream's earlier work ends here
  CompleteNext(t + 3 * kMs);  // a.end
  CompleteNext(t + 3 * kMs);  // b.start
  CompleteNext(t + 4 * kMs);  // b.end
  rig.gate->Drain();
  antman_gate_stats s = rig.gate->stats();
  EXPECT_EQ(s.ops_begun, 2);
  EXPECT_EQ(s.ops_completed, 2);
  EXPECT_EQ(s.ops_pending, 0);
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(s.device_busy_ns, 3 * kMs);
  OpManager::Stats m = rig.manager->stats();
  EXPECT_EQ(m.busy_ns, 3 * kMs);  // kernel time, not launch->completion time (5 ms)
  EXPECT_EQ(m.ops_total, 2);
  EXPECT_EQ(m.ops_in_flight, 0);
  auto iv = rig.Intervals();
  REQUIRE(iv.size() == 2u);
  EXPECT_EQ(iv[0].first, t + 1 * kMs);
  EXPECT_EQ(iv[0].second, t + 3 * kMs);
  EXPECT_EQ(iv[1].first, t + 3 * kMs);
  EXPECT_EQ(iv[1].second, t + 4 * kMs);
  // The pool: 1 anchor + 2 ops x 2 events; later ops reuse them.
  EXPECT_EQ(s.events_created, 5);
  for (int i = 0; i < 10; ++i) {
    rig.End(rig.Begin(Stream(1)));
    rig.clock.Advance(1 * kMs);
    CompleteNext(rig.clock.NowNs() - 1 * kMs);
    CompleteNext(rig.clock.NowNs());
    rig.gate->Drain();
  }
  EXPECT_EQ(rig.gate->stats().events_created, 5);
  EXPECT_EQ(rig.gate->stats().ops_completed, 12);
}

TEST(HostWorkBeforeTheLaunchIsNotCharged) {
  // Issue 29/30: the start event is recorded at begin; on an idle stream the
  // device stamps it at once, so the op's host work would count as busy.
  Rig rig(0.5);
  REQUIRE(rig.gate != nullptr);
  // 10 ms of host work, then the launch, then end; the idle stream stamps the start at begin; a
  // 1 ms kernel launched at t + 10 ms.
  const int64_t t = rig.RunOp(Stream(1), 10 * kMs, 0, 11 * kMs);
  EXPECT_EQ(rig.gate->stats().device_busy_ns, 1 * kMs);
  EXPECT_EQ(rig.manager->stats().busy_ns, 1 * kMs);
  EXPECT_EQ(rig.gate->ext_stats().host_gap_ns, 10 * kMs);
  // A stream behind the host: the start event completes after end was called,
  // and the whole interval is the op's (nothing clipped).
  const int64_t u = rig.RunOp(Stream(1), 1 * kMs, 5 * kMs, 8 * kMs);
  EXPECT_EQ(rig.gate->stats().device_busy_ns, 4 * kMs);
  EXPECT_EQ(rig.gate->ext_stats().host_gap_ns, 10 * kMs);
  auto iv = rig.Intervals();
  REQUIRE(iv.size() == 2u);
  EXPECT_EQ(iv[0].first, t + 10 * kMs);
  EXPECT_EQ(iv[1].first, u + 5 * kMs);
}

TEST(LaunchLagIsNotCharged) {
  // Issue found on an H200 (step compute_short): on an idle stream the device starts the op's
  // last kernel a few us after the launch returns, and the anchor that places the end event
  // is itself off by up to half its round trip. Modelled: the device stamps anchor-stream
  // events 3 us after the record call, a sync returns 1 us after the stamp, so the anchor's
  // midpoint places device work 1 us early and the launch lag is 3 - 1 = 2 us.
  Rig rig(0.5, 1 * kS, /*anchor_submit_ns=*/3 * kUs, /*anchor_notify_ns=*/1 * kUs);
  REQUIRE(rig.gate != nullptr);
  EXPECT_EQ(rig.gate->ext_stats().launch_lag_ns, 2 * kUs);
  EXPECT_EQ(rig.gate->ext_stats().launch_lag_untrusted, 0);
  // Host work and the launch until the end call at t + 10 us; the idle stream stamps the start
  // once submitted (t + 3 us); the 20 us kernel starts at t + 13 us (submitted).
  rig.RunOp(Stream(1), 10 * kUs, 3 * kUs, 33 * kUs);
  EXPECT_EQ(rig.gate->stats().device_busy_ns, 20 * kUs);  // without the lag: 22 us
  EXPECT_EQ(rig.manager->stats().busy_ns, 20 * kUs);
  // Behind the host, the op's own events bound it: the lag changes nothing.
  rig.RunOp(Stream(1), 1 * kUs, 500 * kUs, 800 * kUs);
  EXPECT_EQ(rig.gate->stats().device_busy_ns, 320 * kUs);
}

TEST(LaunchLagIsNotTakenFromAnAnchorThatWaited) {
  // Next to another process's work the GPU time-slices and the anchor's events wait for their
  // context's turn: modelled by a 30 us notify latency (round trip 33 us, past the 12 us a lag
  // is trusted from). The lag is then 0, the floor the end call, as before the lag existed.
  Rig rig(0.5, 1 * kS, /*anchor_submit_ns=*/3 * kUs, /*anchor_notify_ns=*/30 * kUs);
  REQUIRE(rig.gate != nullptr);
  EXPECT_EQ(rig.gate->ext_stats().launch_lag_ns, 0);
  EXPECT_EQ(rig.gate->ext_stats().launch_lag_untrusted, 1);
  EXPECT_EQ(rig.gate->stats().anchor_uncertainty_ns, 33 * kUs);
  rig.RunOp(Stream(1), 10 * kUs, 3 * kUs, 33 * kUs);
  // The anchor's midpoint places device times 13.5 us late ((3 + 30) / 2 - 3): the start event
  // lands at t + 16.5 us, after the end call, and the op is charged its own two events' span,
  // 30 us (placement bias cancels in a difference). A lag from such probes (16.5 us) would have
  // moved the floor past the start to t + 26.5 us and charged 20 us: right in this model, whose
  // every wait is the same 30 us, not on a GPU, where each waits for a time slice of its own
  // (0 to ms) and the charges then moved by the difference (the H200's interference step).
  EXPECT_EQ(rig.gate->stats().device_busy_ns, 30 * kUs);
}

TEST(LaunchLagIsNotTakenFromProbesThatWaited) {
  // A tight anchor (3 us submission, 1 us notify: 4 us round trip), then three probes whose
  // records each waited 40 us for the context's turn: no probe is a launch's lag, so none is
  // taken (without the probes' own check: 39 us, clamped to 2 us, counted as trusted).
  Rig rig(0.5, 1 * kS, /*anchor_submit_ns=*/3 * kUs, /*anchor_notify_ns=*/1 * kUs,
          /*anchor_submit_then=*/{3 * kUs, 40 * kUs, 40 * kUs, 40 * kUs});
  REQUIRE(rig.gate != nullptr);
  EXPECT_EQ(rig.gate->stats().anchor_uncertainty_ns, 4 * kUs);
  EXPECT_EQ(rig.gate->ext_stats().launch_lag_untrusted, 1);
  EXPECT_EQ(rig.gate->ext_stats().launch_lag_ns, 0);
}

TEST(AnchorKeepsPlacementPreciseOverHours) {
  Rig rig(0.5);
  REQUIRE(rig.gate != nullptr);
  int64_t worst = 0;
  std::vector<int64_t> truth;
  // 200 ops 0.7 s apart (re-anchored every other op), then one after 3 hours:
  // float ms from a 3-hour-old anchor would be off by up to ~0.5 ms.
  for (int i = 0; i <= 200; ++i) {
    rig.clock.Advance(i < 200 ? 700 * kMs : 3 * 3600 * kS);
    rig.End(rig.Begin(Stream(2)));
    const int64_t start = rig.clock.NowNs() + 137 * kUs + 11;  // odd values: no exact floats
    rig.clock.Advance(1 * kMs);
    CompleteNext(start);
    CompleteNext(start + 333 * kUs + 7);
    truth.push_back(start);
    rig.gate->Drain();
  }
  auto iv = rig.Intervals();
  REQUIRE(iv.size() == truth.size());
  for (size_t i = 0; i < iv.size(); ++i) {
    worst = std::max(worst, Abs(iv[i].first - truth[i]));
    const int64_t duration_error = Abs((iv[i].second - iv[i].first) - (333 * kUs + 7));
    EXPECT(duration_error <= 10);
  }
  std::printf("  worst placement error: %lld ns, anchors: %lld\n", static_cast<long long>(worst),
              static_cast<long long>(rig.gate->stats().anchors));
  EXPECT(worst <= 100);  // float ms read < 1 s after the anchor: <= 61 ns per reading
  EXPECT(rig.gate->stats().anchors >= 100);
}

TEST(DeviceErrorReturnsTheProvisionalCharge) {
  Rig rig(0.5);
  REQUIRE(rig.gate != nullptr);
  // Profile one 2 ms op so the next launch is charged provisionally.
  rig.End(rig.Begin(Stream(1)));
  rig.clock.Advance(3 * kMs);
  CompleteNext(rig.clock.NowNs() - 3 * kMs);
  CompleteNext(rig.clock.NowNs() - 1 * kMs);
  rig.gate->Drain();
  const int64_t credit_before = rig.manager->stats().credit_ns;
  rig.dev.query_error = 700;  // CUDA_ERROR_ILLEGAL_ADDRESS
  rig.End(rig.Begin(Stream(1)));
  CompleteNext(rig.clock.NowNs());
  CompleteNext(rig.clock.NowNs());
  rig.gate->Drain();
  antman_gate_stats s = rig.gate->stats();
  EXPECT_EQ(s.errors, 1);
  EXPECT_EQ(s.ops_completed, 1);
  OpManager::Stats m = rig.manager->stats();
  EXPECT_EQ(m.ops_in_flight, 0);
  EXPECT_EQ(m.busy_ns, 2 * kMs);
  EXPECT_EQ(m.credit_ns, credit_before);  // provisional 2 ms charged and returned
  rig.dev.query_error = 0;
}

TEST(FailedRecordIsAnErrorAndChargesNothing) {
  Rig rig(0.5);
  REQUIRE(rig.gate != nullptr);
  rig.dev.fail_next_records = 1;
  CudaGate::Op* op = reinterpret_cast<CudaGate::Op*>(0x1);
  std::string err;
  EXPECT_EQ(rig.gate->Begin(Stream(1), &op, &err), ANTMAN_ERR_DEVICE);
  EXPECT(op == nullptr);
  EXPECT(err.find("cuEventRecord (start)") != std::string::npos);
  EXPECT_EQ(rig.manager->stats().ops_in_flight, 0);
  // A failing end record: the op is still retired, as an error, in order.
  CudaGate::Op* ok = rig.Begin(Stream(1));
  rig.dev.fail_next_records = 1;
  EXPECT_EQ(rig.gate->End(ok, &err), ANTMAN_ERR_DEVICE);
  CompleteNext(rig.clock.NowNs());  // its start event
  rig.gate->Drain();
  EXPECT_EQ(rig.gate->stats().errors, 1);
  EXPECT_EQ(rig.manager->stats().ops_in_flight, 0);
}

TEST(UnthrottledRecordsNothing) {
  Rig rig(1.0);
  REQUIRE(rig.gate != nullptr);
  CudaGate::Op* op = reinterpret_cast<CudaGate::Op*>(0x1);
  std::string err;
  EXPECT_EQ(rig.gate->Begin(Stream(1), &op, &err), ANTMAN_OK);
  EXPECT(op == nullptr);
  EXPECT_EQ(rig.gate->End(op, &err), ANTMAN_OK);
  EXPECT_EQ(rig.dev.user_records, 0);
  EXPECT_EQ(rig.gate->stats().ops_begun, 0);
  rig.manager->SetShare(0.5);
  rig.End(rig.Begin(Stream(1)));
  EXPECT_EQ(rig.dev.user_records, 2);
  CompleteNext(rig.clock.NowNs());
  CompleteNext(rig.clock.NowNs());
}

TEST(TimedOnlyReportsIntervalsWithoutCharging) {
  Rig rig(1.0);  // unthrottled: Begin would skip; BeginTimed always records
  REQUIRE(rig.gate != nullptr);
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> seen;
  auto done = [&](int64_t s, int64_t e) {
    std::lock_guard<std::mutex> lock(mu);
    seen.emplace_back(s, e);
  };
  const int64_t t = rig.clock.NowNs();
  std::string err;
  CudaGate::Op* a = nullptr;
  CudaGate::Op* b = nullptr;
  EXPECT_EQ(rig.gate->BeginTimed(Stream(1), &a, &err), ANTMAN_OK);
  REQUIRE(a != nullptr);
  EXPECT_EQ(rig.gate->EndTimed(a, done, &err), ANTMAN_OK);
  EXPECT_EQ(rig.gate->BeginTimed(Stream(1), &b, &err), ANTMAN_OK);
  EXPECT_EQ(rig.gate->EndTimed(b, done, &err), ANTMAN_OK);
  rig.clock.Advance(10 * kMs);
  CompleteNext(t + 2 * kMs);
  CompleteNext(t + 5 * kMs);
  EXPECT(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size() == 1;
  }));
  rig.dev.query_error = 700;  // the second op fails on the device: told (0, 0)
  CompleteNext(t + 5 * kMs);
  CompleteNext(t + 6 * kMs);
  rig.gate->Drain();
  rig.dev.query_error = 0;
  REQUIRE(seen.size() == 2u);
  EXPECT_EQ(seen[0].first, t + 2 * kMs);
  EXPECT_EQ(seen[0].second, t + 5 * kMs);
  EXPECT_EQ(seen[1].first, 0);
  EXPECT_EQ(seen[1].second, 0);
  // A start event that cannot be recorded: still an op, and `done(0, 0)`.
  rig.dev.fail_next_records = 1;
  CudaGate::Op* c = nullptr;
  EXPECT_EQ(rig.gate->BeginTimed(Stream(1), &c, &err), ANTMAN_ERR_DEVICE);
  REQUIRE(c != nullptr);
  EXPECT_EQ(rig.gate->EndTimed(c, done, &err), ANTMAN_OK);
  rig.gate->Drain();
  REQUIRE(seen.size() == 3u);
  EXPECT_EQ(seen[2].first, 0);
  EXPECT_EQ(seen[2].second, 0);
  OpManager::Stats m = rig.manager->stats();
  EXPECT_EQ(m.ops_total, 0);  // the caller charges, not the gate
  EXPECT_EQ(m.busy_ns, 0);
  EXPECT_EQ(rig.gate->stats().errors, 2);
  EXPECT_EQ(PendingEvents(), 0u);
}

TEST(DestroyWaitsForTheDeviceAndFreesEverything) {
  auto rig = std::make_unique<Rig>(0.5);
  REQUIRE(rig->gate != nullptr);
  for (int i = 0; i < 3; ++i) rig->End(rig->Begin(Stream(i)));
  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    rig->gate.reset();
    destroyed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT(!destroyed.load());  // 3 ops still running on the device
  EXPECT_EQ(rig->manager->stats().ops_in_flight, 3);
  const int64_t now = rig->clock.NowNs();
  while (PendingEvents() > 0) CompleteNext(now);
  destroyer.join();
  EXPECT(destroyed.load());
  EXPECT_EQ(rig->manager->stats().ops_in_flight, 0);
  EXPECT_EQ(rig->manager->stats().ops_total, 3);
  EXPECT_EQ(rig->dev.destroyed, rig->dev.created);  // pool and anchor events
  EXPECT_EQ(rig->dev.streams_alive, 0);
  EXPECT_EQ(rig->dev.ctx_retained, 0);
}

TEST(PendingBoundHoldsTheLaunchingThread) {
  FakeClock clock;
  FakeDevice dev;
  g_dev = &dev;
  dev.clock = &clock;
  OpManager::Options o;
  o.initial_share = 0.5;
  o.max_credit_ns = 1000 * kS;
  o.max_pending_device_ops = 2;
  o.clock = &clock;
  OpManager manager(o);
  clock.Advance(10 * kS);
  std::string err;
  int code = 0;
  auto gate = CudaGate::Create(&manager, CudaGate::Options{0, 1 * kUs, 1 * kS, {}}, FakeDriver(),
                               &err, &code);
  REQUIRE(gate != nullptr);
  for (int i = 0; i < 2; ++i) {
    CudaGate::Op* op = nullptr;
    gate->Begin(Stream(1), &op, &err);
    gate->End(op, &err);
  }
  std::atomic<bool> third{false};
  std::thread launcher([&] {
    CudaGate::Op* op = nullptr;
    std::string e;
    gate->Begin(Stream(1), &op, &e);
    gate->End(op, &e);
    third = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT(!third.load());
  CompleteNext(clock.NowNs());
  CompleteNext(clock.NowNs());  // the first op completes: one slot frees
  EXPECT(Eventually([&] { return third.load(); }));
  launcher.join();
  clock.Advance(1 * kMs);
  while (PendingEvents() > 0) CompleteNext(clock.NowNs());
  gate.reset();
  EXPECT_EQ(manager.stats().ops_in_flight, 0);
  g_dev = nullptr;
}

TEST(CreateValidatesNamingTheField) {
  FakeClock clock;
  FakeDevice dev;
  g_dev = &dev;
  dev.clock = &clock;
  OpManager::Options o;
  o.clock = &clock;
  OpManager manager(o);
  std::string err;
  int code = 0;
  CudaGate::Options g;
  g.poll_interval_ns = 10;
  EXPECT(CudaGate::Create(&manager, g, FakeDriver(), &err, &code) == nullptr);
  EXPECT(err.find("poll_interval_ns: 10 is outside the accepted range") != std::string::npos);
  EXPECT_EQ(code, ANTMAN_ERR_INVALID);
  g = CudaGate::Options{};
  g.anchor_interval_ns = 61 * kS;
  EXPECT(CudaGate::Create(&manager, g, FakeDriver(), &err, &code) == nullptr);
  EXPECT(err.find("anchor_interval_ns") != std::string::npos);
  g = CudaGate::Options{};
  g.device_ordinal = 3;  // the fake has one device
  EXPECT(CudaGate::Create(&manager, g, FakeDriver(), &err, &code) == nullptr);
  EXPECT(err.find("device_ordinal: 3 is outside the accepted range [0, 1)") != std::string::npos);
  EXPECT(CudaGate::Create(nullptr, CudaGate::Options{}, FakeDriver(), &err, &code) == nullptr);
  EXPECT(err.find("opm") != std::string::npos);
  EXPECT_EQ(dev.ctx_retained, 0);
  EXPECT_EQ(dev.streams_alive, 0);
  g_dev = nullptr;
}

TEST_MAIN()
