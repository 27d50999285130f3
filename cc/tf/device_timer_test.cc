// Unit tests of the GPU device's charging logic without a GPU or TensorFlow:
// the order of admission, launch and device-time charge (DeviceOpGate) against
// the real operator manager on a fake clock, the bound on launches pending on
// the device, and the stream-occupancy estimate used with TF's event manager.
#include "cc/tf/device_timer.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace antman {
namespace {

int g_failed = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++g_failed;                                                                    \
    }                                                                                \
  } while (0)

class FakeClock final : public Clock {
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
  std::atomic<int64_t> now_{1'000'000'000};
};

// Records what the device would ask of a real timer; the test completes ops.
class FakeTimer final : public DeviceTimer {
 public:
  struct Call {
    int64_t token;
    void* stream;
    Done done;
  };
  int64_t Before(void* stream) override {
    before_streams.push_back(stream);
    return next_token++;
  }
  void After(int64_t token, void* stream, Done done) override {
    std::lock_guard<std::mutex> lock(mu);
    pending.push_back({token, stream, std::move(done)});
  }
  void Complete(size_t i, int64_t start, int64_t end) {
    Done done;
    {
      std::lock_guard<std::mutex> lock(mu);
      done = pending[i].done;
    }
    done(start, end);
  }
  std::mutex mu;
  std::vector<void*> before_streams;
  std::vector<Call> pending;
  int64_t next_token = 7;
};

OpManager::Options Throttled(FakeClock* clock, double share, int64_t max_pending) {
  OpManager::Options o;
  o.initial_share = share;
  o.max_credit_ns = 0;
  o.max_pending_device_ops = max_pending;
  o.clock = clock;
  return o;
}

// Busy time is what the device reports, not the time the launch took.
void TestChargesDeviceTimeNotLaunchTime() {
  FakeClock clock;
  OpManager manager(Throttled(&clock, 0.5, 16));
  FakeTimer timer;
  DeviceOpGate gate(&manager, &timer);
  int stream_object = 0;
  void* stream = &stream_object;
  bool launched = false;
  gate.Run(stream, [&] {
    launched = true;
    clock.Advance(10'000);  // the launch call itself: 10 us of host time
  });
  CHECK(launched);
  CHECK(timer.before_streams.size() == 1 && timer.before_streams[0] == stream);
  CHECK(timer.pending.size() == 1 && timer.pending[0].token == 7 &&
        timer.pending[0].stream == stream);
  OpManager::Stats s = manager.stats();
  CHECK(s.ops_in_flight == 1);  // launched, not complete
  CHECK(s.ops_total == 0);
  CHECK(s.busy_ns == 0);  // nothing charged as busy before the device reports

  int64_t t = clock.NowNs();
  timer.Complete(0, t, t + 3'000'000);  // the kernels ran for 3 ms
  s = manager.stats();
  CHECK(s.ops_in_flight == 0);
  CHECK(s.ops_total == 1);
  CHECK(s.busy_ns == 3'000'000);
  CHECK(s.op_ns_ewma == 3'000'000);
}

// The manager bounds how far a job runs ahead of its device: with
// max_pending_device_ops launches outstanding, the next admission waits for a
// completion, whatever its tokens.
void TestPendingLaunchesAreBounded() {
  FakeClock clock;
  OpManager manager(Throttled(&clock, 0.5, 2));
  FakeTimer timer;
  DeviceOpGate gate(&manager, &timer);
  int s0 = 0;
  for (int i = 0; i < 2; ++i) gate.Run(&s0, [] {});
  CHECK(timer.pending.size() == 2);

  std::atomic<bool> third_admitted{false};
  std::thread third([&] {
    gate.Run(&s0, [] {});
    third_admitted = true;
  });
  // Wait (real time, bounded) until the third caller is inside Admit().
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (manager.stats().ops_waiting_now < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(manager.stats().ops_waiting_now == 1);
  CHECK(!third_admitted.load());

  int64_t t = clock.NowNs();
  timer.Complete(0, t - 1000, t);  // one launch completes: room for the third
  third.join();
  CHECK(third_admitted.load());
  CHECK(manager.stats().ops_in_flight == 2);
}

void TestOccupancyIdleStream() {
  StreamOccupancy occ;
  StreamOccupancy::Interval a = occ.Complete(100, 250);
  CHECK(a.start_ns == 100 && a.end_ns == 250);
  // Launched after the stream went idle: the idle gap is not charged.
  StreamOccupancy::Interval b = occ.Complete(400, 450);
  CHECK(b.start_ns == 400 && b.end_ns == 450);
}

void TestOccupancyQueuedBehindEarlierWork() {
  StreamOccupancy occ;
  occ.Complete(100, 1000);
  // Launched at 200 while the stream was busy until 1000: it ran from 1000.
  StreamOccupancy::Interval b = occ.Complete(200, 1300);
  CHECK(b.start_ns == 1000 && b.end_ns == 1300);
}

void TestOccupancyOutOfOrderCompletionIsClamped() {
  StreamOccupancy occ;
  occ.Complete(300, 900);  // seen first though launched second
  StreamOccupancy::Interval late = occ.Complete(100, 500);
  CHECK(late.start_ns == 900 && late.end_ns == 900);  // nothing counted twice
  CHECK(late.end_ns >= late.start_ns);
}

}  // namespace
}  // namespace antman

int main() {
  using Test = std::pair<const char*, void (*)()>;
  const Test tests[] = {
      {"ChargesDeviceTimeNotLaunchTime", antman::TestChargesDeviceTimeNotLaunchTime},
      {"PendingLaunchesAreBounded", antman::TestPendingLaunchesAreBounded},
      {"OccupancyIdleStream", antman::TestOccupancyIdleStream},
      {"OccupancyQueuedBehindEarlierWork", antman::TestOccupancyQueuedBehindEarlierWork},
      {"OccupancyOutOfOrderCompletionIsClamped", antman::TestOccupancyOutOfOrderCompletionIsClamped},
  };
  for (const Test& t : tests) {
    int before = antman::g_failed;
    t.second();
    std::printf("%s %s\n", antman::g_failed == before ? "PASS" : "FAIL", t.first);
  }
  return antman::g_failed == 0 ? 0 : 1;
}
