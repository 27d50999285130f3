// Unit tests of the GpuOpManager on a fake clock: time moves only when an op
// advances it or a caller waits for its slot, so every figure below is exact
// and no test depends on how fast this machine is. Ops run on the test's own
// threads: the manager only admits them.
#include "cc/core/op_manager.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace antman {
namespace {

int g_checks_failed = 0;
bool g_test_failed = false;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__,      \
                   __LINE__, #cond);                                     \
      ++g_checks_failed;                                                 \
      g_test_failed = true;                                              \
    }                                                                    \
  } while (0)

#define CHECK_EQ(a, b)                                                   \
  do {                                                                   \
    long long va = static_cast<long long>(a);                            \
    long long vb = static_cast<long long>(b);                            \
    if (va != vb) {                                                      \
      std::fprintf(stderr, "  %s:%d: %s == %s failed: %lld vs %lld\n",   \
                   __FILE__, __LINE__, #a, #b, va, vb);                  \
      ++g_checks_failed;                                                 \
      g_test_failed = true;                                              \
    }                                                                    \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                            \
  do {                                                                   \
    double va = (a), vb = (b);                                           \
    if (!(std::fabs(va - vb) <= (tol))) {                                \
      std::fprintf(stderr, "  %s:%d: %s ~= %s failed: %.6f vs %.6f\n",   \
                   __FILE__, __LINE__, #a, #b, va, vb);                  \
      ++g_checks_failed;                                                 \
      g_test_failed = true;                                              \
    }                                                                    \
  } while (0)

constexpr int64_t kUs = 1000;
constexpr int64_t kMs = 1000 * kUs;

// Virtual time. A timed wait jumps straight to its deadline, which is what a
// sleep looks like from inside the timeline; an untimed wait really blocks.
class FakeClock final : public Clock {
 public:
  // A ticking clock moves 1 ns at every reading, so readings taken under the
  // manager's lock are unique and ordered (admission order is observable).
  explicit FakeClock(bool ticking = false) : ticking_(ticking) {}
  int64_t NowNs() const override {
    return ticking_ ? now_.fetch_add(1) + 1 : now_.load();
  }
  void Advance(int64_t ns) { now_.fetch_add(ns); }
  void WaitUntil(std::unique_lock<std::mutex>& lock,
                 std::condition_variable& cv, int64_t deadline_ns) override {
    if (deadline_ns == kForever) {
      ++untimed_waiters_;
      cv.wait(lock);
      --untimed_waiters_;
      return;
    }
    int64_t now = now_.load();
    while (now < deadline_ns && !now_.compare_exchange_weak(now, deadline_ns)) {
    }
    thread_cpu_.fetch_add(cpu_per_wait_.load());
  }
  int untimed_waiters() const { return untimed_waiters_.load(); }
  // CPU a timed wait costs the waiting thread (going to sleep, waking up).
  void SetCpuPerWait(int64_t ns) { cpu_per_wait_.store(ns); }
  int64_t ThreadCpuNs() const override { return thread_cpu_.load(); }

 private:
  std::atomic<int64_t> cpu_per_wait_{0};
  std::atomic<int64_t> thread_cpu_{0};
  const bool ticking_;
  mutable std::atomic<int64_t> now_{1'000'000'000};
  std::atomic<int> untimed_waiters_{0};
};

OpManager::Options FakeOptions(FakeClock* clock, double share,
                               int64_t max_credit_ns = 0) {
  OpManager::Options options;
  options.initial_share = share;
  options.max_credit_ns = max_credit_ns;
  options.clock = clock;
  return options;
}

// Polls `done` for at most 10 s of real time, so a broken manager fails the
// test instead of hanging it.
template <typename Pred>
bool Eventually(Pred done) {
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

// Joins `thread` once `finished` is set, or ends the test binary: a broken
// manager must fail the run, not hang it.
void JoinOrDie(std::thread& thread, const std::atomic<bool>& finished) {
  if (!Eventually([&] { return finished.load(); })) {
    std::fprintf(stderr, "  a blocked caller never returned\n");
    std::printf("0 passed, 1 failed\n");
    std::_Exit(1);
  }
  thread.join();
}


// Ops of known durations back to back: busy / wall from the first launch to
// One host-timed op of `ns` on the calling thread.
void HostOp(OpManager& manager, FakeClock& clock, int64_t ns) {
  int64_t admitted = manager.Admit();
  clock.Advance(ns);
  manager.Finish(admitted);
}

// Ops of known durations back to back: busy / wall from the first admission
// to a zero-length marker op equals the share, and all the gap was inserted.
void TestShareHeldForHostOps() {
  for (double share : {0.25, 0.5, 0.75}) {
    FakeClock clock;
    OpManager manager(FakeOptions(&clock, share));
    const int64_t durations[] = {300 * kUs, 1 * kMs, 2500 * kUs};
    int64_t first = -1, busy = 0;
    for (int i = 0; i < 300; ++i) {
      int64_t ns = durations[i % 3];
      int64_t admitted = manager.Admit();
      if (first < 0) first = admitted;
      clock.Advance(ns);
      manager.Finish(admitted);
      busy += ns;
    }
    int64_t marker = manager.Admit();
    manager.Finish(marker);
    double achieved = static_cast<double>(busy) / static_cast<double>(marker - first);
    CHECK_NEAR(achieved, share, 1e-6);
    OpManager::Stats s = manager.stats();
    CHECK_EQ(s.busy_ns, busy);
    CHECK_NEAR(static_cast<double>(s.idle_inserted_ns), static_cast<double>(marker - first - busy),
               300.0);  // ceil() of each wait: < 1 ns per op
    CHECK_EQ(s.ops_total, 301);
    CHECK_EQ(s.ops_in_flight, 0);
  }
}

// A gap the job leaves by itself (input, host work) is idle like inserted
// idle is: no extra idle goes on top of it.
void TestNaturalGapsCountAsIdle() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  HostOp(manager, clock, 1 * kMs);  // owes 1 ms of idle
  clock.Advance(5 * kMs);           // natural gap, longer than owed
  int64_t t0 = clock.NowNs();
  HostOp(manager, clock, 1 * kMs);
  CHECK_EQ(manager.stats().ops_delayed, 0);
  clock.Advance(400 * kUs);  // natural gap, shorter than the 1 ms owed
  int64_t before = clock.NowNs();
  int64_t admitted = manager.Admit();
  CHECK_EQ(admitted - before, 600 * kUs);  // only the rest of the debt
  manager.Finish(admitted);
  CHECK_EQ(manager.stats().ops_delayed, 1);
  (void)t0;
}

// A gap shorter than bridge_gap_ns between the job's ops is the job's (the
// executor's work between kernels), also when the op after it then waits for
// its slot; a longer one is idle; and time the manager itself inserted is
// never bridged, however short.
void TestShortGapsAreTheJobs() {
  FakeClock clock;
  OpManager::Options options = FakeOptions(&clock, 0.5, /*max_credit_ns=*/100 * kMs);
  options.bridge_gap_ns = 50 * kUs;
  {
    OpManager manager(options);
    clock.Advance(1'000 * kMs);  // bank the credit: nothing below waits
    HostOp(manager, clock, 1 * kMs);
    clock.Advance(20 * kUs);  // executor between kernels: bridged
    HostOp(manager, clock, 1 * kMs);
    CHECK_EQ(manager.stats().busy_ns, 2 * kMs + 20 * kUs);
    clock.Advance(200 * kUs);  // input, Python: idle
    HostOp(manager, clock, 1 * kMs);
    CHECK_EQ(manager.stats().busy_ns, 3 * kMs + 20 * kUs);
    CHECK_EQ(manager.stats().ops_delayed, 0);
  }
  {
    options.max_credit_ns = 0;
    OpManager manager(options);
    HostOp(manager, clock, 20 * kUs);  // owes 20 us at share 0.5
    HostOp(manager, clock, 20 * kUs);  // waits those 20 us first: not bridged
    CHECK_EQ(manager.stats().ops_delayed, 1);
    CHECK_EQ(manager.stats().busy_ns, 40 * kUs);
  }
  {
    // A delayed op: the executor's work between the last op and the request
    // (20 us) came before the wait and is the job's; the wait itself is not.
    options.max_credit_ns = 0;
    OpManager manager(options);
    HostOp(manager, clock, 100 * kUs);  // owes 50 us at share 0.5
    clock.Advance(20 * kUs);            // the executor: pays back 10 of them
    int64_t requested = clock.NowNs();
    HostOp(manager, clock, 100 * kUs);  // waits 80 us, then runs 100 us
    CHECK_EQ(manager.stats().ops_delayed, 1);
    CHECK_EQ(manager.stats().busy_ns, 220 * kUs);
    CHECK_EQ(clock.NowNs() - requested, 180 * kUs);
    clock.Advance(200 * kUs);  // a long gap before a delayed op stays idle
    HostOp(manager, clock, 100 * kUs);
    CHECK_EQ(manager.stats().busy_ns, 320 * kUs);
  }
  options.bridge_gap_ns = -1;
  CHECK(!OpManager::Validate(options).empty());
}

// What a delayed op's thread spends in its wait (sleeping and waking: CPU on
// the emulated device) is the job's busy time: the share holds with it. A
// device-timed op's waiting thread is not the device's, and is not charged.
void TestWaitCpuIsCharged() {
  for (double share : {0.25, 0.5, 0.75}) {
    FakeClock clock;
    clock.SetCpuPerWait(100 * kUs);
    OpManager manager(FakeOptions(&clock, share));
    int64_t first = -1;
    for (int i = 0; i < 100; ++i) {
      int64_t admitted = manager.Admit();
      if (first < 0) first = admitted;
      clock.Advance(1 * kMs);
      manager.Finish(admitted);
    }
    int64_t marker = manager.Admit();
    manager.Finish(marker);
    int64_t waits = manager.stats().ops_delayed;
    CHECK_EQ(waits, 100);  // every op after the first, and the marker
    // Busy: the ops and each wait's CPU; the share holds over both.
    int64_t busy = 100 * kMs + waits * 100 * kUs;
    CHECK_EQ(manager.stats().busy_ns, busy);
    double achieved = static_cast<double>(busy) / static_cast<double>(marker - first);
    CHECK_NEAR(achieved, share, 0.002);
  }
  {
    FakeClock clock;
    clock.SetCpuPerWait(100 * kUs);
    OpManager manager(FakeOptions(&clock, 0.5));
    for (int i = 0; i < 3; ++i) {
      manager.Admit(OpManager::Timing::kDevice);
      int64_t provisional = manager.Launched();
      int64_t start = clock.NowNs();
      clock.Advance(1 * kMs);
      manager.DeviceDone(provisional, start, clock.NowNs());
    }
    CHECK_EQ(manager.stats().busy_ns, 3 * kMs);
  }
}

// After a long idle time the job banks at most max_credit_ns.
void TestCreditIsCapped() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5, /*max_credit_ns=*/5 * kMs));
  clock.Advance(1'000 * kMs);
  for (int i = 0; i < 20; ++i) HostOp(manager, clock, 1 * kMs);
  // Each 1 ms op earns 0.5 ms and spends 1 ms: 5 ms of credit carries 10 ops,
  // the 11th starts at exactly 0, the last 9 wait.
  CHECK_EQ(manager.stats().ops_delayed, 9);
}

// max_credit_ns at its largest accepted value ("no cap") while an op runs:
// the cap plus the uncharged time must not wrap into a debt that no admission
// outlives (it did: the second op waited for ever).
void TestLargestCreditCapDoesNotWrap() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5, /*max_credit_ns=*/INT64_MAX));
  clock.Advance(10 * kMs);
  int64_t first = manager.Admit();
  clock.Advance(1 * kMs);
  std::atomic<bool> admitted{false};
  std::thread second([&] {
    manager.Finish(manager.Admit());
    admitted = true;
  });
  JoinOrDie(second, admitted);
  manager.Finish(first);
  CHECK(manager.stats().credit_ns > 0);
}

// Share 0 holds every caller at its admission (nothing runs, nothing is
// lost); a share > 0 releases them in the order they arrived.
void TestPauseHoldsAndResumeReleasesInOrder() {
  FakeClock clock(/*ticking=*/true);
  OpManager manager(FakeOptions(&clock, 0.0));
  constexpr int kCallers = 12;
  std::vector<std::thread> threads;
  std::vector<int64_t> admitted(kCallers, 0);
  std::atomic<int> returned{0};
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      admitted[i] = manager.Admit();
      manager.Finish(admitted[i]);
      returned.fetch_add(1);
    });
    // Caller i is in line before caller i+1 arrives.
    CHECK(Eventually([&] { return manager.stats().ops_waiting_now == i + 1; }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a broken pause would admit now
  CHECK_EQ(returned.load(), 0);
  CHECK(manager.stats().paused);
  manager.SetShare(1.0);
  std::atomic<bool> all{false};
  std::thread watcher([&] {
    Eventually([&] { return returned.load() == kCallers; });
    all = true;
  });
  JoinOrDie(watcher, all);
  for (auto& t : threads) t.join();
  for (int i = 1; i < kCallers; ++i) CHECK(admitted[i - 1] < admitted[i]);
  CHECK_EQ(manager.stats().ops_waiting_now, 0);
}

// Shares change at the next admission; the time before a change is settled
// at the old share.
void TestShareChangeMidStream() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.25));
  auto phase = [&](int ops) {
    int64_t first = -1, busy = 0;
    for (int i = 0; i < ops; ++i) {
      int64_t admitted = manager.Admit();
      if (first < 0) first = admitted;
      clock.Advance(1 * kMs);
      manager.Finish(admitted);
      busy += 1 * kMs;
    }
    int64_t marker = manager.Admit();
    manager.Finish(marker);
    return static_cast<double>(busy) / static_cast<double>(marker - first);
  };
  CHECK_NEAR(phase(50), 0.25, 1e-6);
  manager.SetShare(0.75);
  CHECK_NEAR(phase(50), 0.75, 1e-6);
  manager.SetShare(1.0);
  int64_t delayed = manager.stats().ops_delayed;
  int64_t idle = manager.stats().idle_inserted_ns;
  for (int i = 0; i < 50; ++i) {  // share 1: callers take the direct path
    CHECK(manager.unthrottled());
    clock.Advance(1 * kMs);
  }
  CHECK_EQ(manager.stats().ops_delayed, delayed);
  CHECK_EQ(manager.stats().idle_inserted_ns, idle);
}

// Ops that overlap (on several threads, or finishing out of order) count
// once: the charge is the busy union, whatever order they finish in.
void TestOverlappingOpsCountOnce() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  int64_t a = manager.Admit();
  int64_t b = manager.Admit();  // nothing charged yet: admitted at once
  CHECK_EQ(a, b);
  clock.Advance(2 * kMs);
  manager.Finish(b);  // the inner op ends first
  CHECK_EQ(manager.stats().busy_ns, 2 * kMs);
  clock.Advance(3 * kMs);
  manager.Finish(a);
  OpManager::Stats s = manager.stats();
  CHECK_EQ(s.busy_ns, 5 * kMs);
  CHECK_EQ(s.ops_in_flight, 0);
  // 5 ms busy in 5 ms wall at share 0.5: 2.5 ms owed, 5 ms of idle to pay it.
  int64_t before = clock.NowNs();
  int64_t next = manager.Admit();
  CHECK_EQ(next - before, 5 * kMs);
  manager.Finish(next);
}

// The deadlock of the old design: an admitted op that waits for another op
// (an iterator waiting for its pipeline, a queue dequeue, a py_function) must
// not keep that op from being admitted. Real clock, real threads.
void TestBlockedOpDoesNotBlockOthers() {
  OpManager::Options options;
  options.initial_share = 0.3;
  OpManager manager(options);
  std::promise<void> produced;
  std::atomic<bool> consumer_done{false}, producer_done{false};
  std::thread consumer([&] {
    OpManager::ScopedOp op(manager);  // e.g. a dequeue, busy while it waits
    produced.get_future().wait();
    consumer_done = true;
  });
  CHECK(Eventually([&] { return manager.stats().ops_in_flight == 1; }));
  std::thread producer([&] {
    for (int i = 0; i < 20; ++i) {
      OpManager::ScopedOp op(manager);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    produced.set_value();
    producer_done = true;
  });
  JoinOrDie(producer, producer_done);
  JoinOrDie(consumer, consumer_done);
  CHECK_EQ(manager.stats().ops_total, 21);
}

// A kernel that runs kernels inline on its own thread: the inner ones are
// covered by the outer op and admitted at once, even deep in debt.
void TestNestedOpsAreAdmittedInline() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.01));
  HostOp(manager, clock, 10 * kMs);  // ~1 s of idle owed
  int64_t before = clock.NowNs();
  {
    OpManager::ScopedOp outer(manager);
    int64_t outer_start = clock.NowNs();
    CHECK(outer_start - before > 900 * kMs);  // the outer op waited its slot
    int64_t inner = manager.Admit();
    CHECK_EQ(inner, OpManager::kNested);
    CHECK_EQ(clock.NowNs(), outer_start);  // no wait
    clock.Advance(1 * kMs);
    manager.Finish(inner);  // no-op
  }
  OpManager::Stats s = manager.stats();
  CHECK_EQ(s.ops_total, 2);
  CHECK_EQ(s.busy_ns, 11 * kMs);
  CHECK_EQ(s.ops_in_flight, 0);
}

// Device-timed ops: the launch is charged the profiled kernel time, the
// completion replaces it by the kernel's own interval.
void TestDeviceTimedOps() {
  FakeClock clock;
  OpManager::Options options = FakeOptions(&clock, 0.5, /*max_credit_ns=*/5 * kMs);
  options.device_burst_ns = 0;  // each op paced on its own (bursts: the next test)
  OpManager manager(options);
  int64_t t0 = manager.Admit(OpManager::Timing::kDevice);
  CHECK_EQ(manager.Launched(), 0);  // no profile yet
  CHECK_EQ(manager.stats().ops_in_flight, 1);
  clock.Advance(4 * kMs);
  manager.DeviceDone(0, t0 + 1 * kMs, t0 + 3 * kMs);  // a 2 ms kernel
  OpManager::Stats s = manager.stats();
  CHECK_EQ(s.busy_ns, 2 * kMs);
  CHECK_EQ(s.credit_ns, 0);  // 4 ms wall at 0.5 paid for it exactly
  CHECK_EQ(s.ops_in_flight, 0);
  // Next launch: provisionally charged 2 ms, so the one after waits 4 ms.
  int64_t t1 = manager.Admit(OpManager::Timing::kDevice);
  CHECK_EQ(t1, clock.NowNs());
  int64_t provisional = manager.Launched();
  CHECK_EQ(provisional, 2 * kMs);
  int64_t t2 = manager.Admit(OpManager::Timing::kDevice);
  CHECK_EQ(t2 - t1, 4 * kMs);
  int64_t provisional2 = manager.Launched();
  // The first kernel really took 1 ms: 1 ms of the provisional charge returns.
  manager.DeviceDone(provisional, t1 + 1 * kMs, t1 + 2 * kMs);
  manager.DeviceDone(provisional2, t2, t2 + 2 * kMs);
  s = manager.stats();
  CHECK_EQ(s.busy_ns, 5 * kMs);
  CHECK_EQ(s.ops_total, 3);
}

// Device-timed ops that ran out of tokens wait until a whole burst is banked,
// then run back to back: fewer, longer turns on the device at the same share
// (each turn is a GPU context switch and back when another process runs).
void TestDeviceBurstsBankAWholeTurn() {
  struct Run {
    int turns = 0;         // admissions that had to wait
    int longest_turn = 0;  // most ops admitted back to back after a wait
    double share = 0.0;    // busy / elapsed over the run
  };
  auto run = [](int64_t burst_ns) {
    FakeClock clock;
    OpManager::Options options = FakeOptions(&clock, 0.25, /*max_credit_ns=*/5 * kMs);
    options.device_burst_ns = burst_ns;
    OpManager manager(options);
    const int64_t kernel = 500 * kUs;
    const int64_t start = clock.NowNs();
    int64_t last_end = start;
    Run r;
    int streak = 0;
    for (int i = 0; i < 200; ++i) {
      const int64_t t = manager.Admit(OpManager::Timing::kDevice);
      if (t > last_end) {  // waited: a new turn
        ++r.turns;
        streak = 0;
      }
      r.longest_turn = std::max(r.longest_turn, ++streak);
      const int64_t provisional = manager.Launched();
      clock.Advance(kernel);  // the kernel runs, the host waits for it
      manager.DeviceDone(provisional, t, t + kernel);
      last_end = t + kernel;
    }
    r.share = static_cast<double>(manager.stats().busy_ns) /
              static_cast<double>(clock.NowNs() - start);
    return r;
  };
  const Run each = run(0);
  const Run burst = run(2 * kMs);
  const Run capped = run(50 * kMs);  // more than the bank holds: 5 ms turns
  std::printf("  turns: %d each op, %d with 2 ms bursts, %d capped at 5 ms\n", each.turns,
              burst.turns, capped.turns);
  CHECK(each.turns >= 190);            // every op its own turn once credit is spent
  CHECK_EQ(each.longest_turn, 1);
  CHECK(burst.turns <= 200 / 4 + 2);    // 2 ms banked: at least 4 kernels of 0.5 ms a turn
  CHECK(burst.longest_turn >= 4);
  CHECK(capped.longest_turn >= 10);     // 5 ms banked: 10 kernels
  CHECK(capped.turns < burst.turns);
  // The share is the same: bursts move the turns, not the amount.
  CHECK_NEAR(each.share, 0.25, 0.01);
  CHECK_NEAR(burst.share, 0.25, 0.01);
  CHECK_NEAR(capped.share, 0.25, 0.02);
}

// A job cannot run ahead of its share by more than max_pending_device_ops
// launches whose kernels have not completed.
void TestPendingDeviceOpsAreBounded() {
  FakeClock clock;
  OpManager::Options options = FakeOptions(&clock, 0.5, /*max_credit_ns=*/1'000 * kMs);
  options.max_pending_device_ops = 2;
  OpManager manager(options);
  clock.Advance(1'000 * kMs);  // plenty of credit: only the bound can hold a launch
  int64_t p[3];
  for (int i = 0; i < 2; ++i) {
    manager.Admit(OpManager::Timing::kDevice);
    p[i] = manager.Launched();
  }
  std::atomic<bool> third{false};
  std::thread launcher([&] {
    manager.Admit(OpManager::Timing::kDevice);
    p[2] = manager.Launched();
    third = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!third.load());
  int64_t now = clock.NowNs();
  manager.DeviceDone(p[0], now - 2 * kMs, now - 1 * kMs);
  JoinOrDie(launcher, third);
  manager.DeviceDone(p[1], now - 1 * kMs, now);
  manager.DeviceDone(p[2], now, now + 1 * kMs);
  CHECK_EQ(manager.stats().ops_in_flight, 0);
}

// The pending slot is the admission's: callers admitted at once, before any
// of them has launched, are bounded too (a slot taken at Launched() let every
// thread between its admission and its launch past the bound).
void TestPendingSlotIsTakenAtAdmission() {
  FakeClock clock;
  OpManager::Options options = FakeOptions(&clock, 0.5, /*max_credit_ns=*/1'000 * kMs);
  options.max_pending_device_ops = 1;
  OpManager manager(options);
  clock.Advance(1'000 * kMs);
  manager.Admit(OpManager::Timing::kDevice);  // not launched yet
  std::atomic<bool> second{false};
  std::thread launcher([&] {
    manager.Admit(OpManager::Timing::kDevice);
    second = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!second.load());
  CHECK_EQ(manager.stats().ops_in_flight, 1);
  int64_t provisional = manager.Launched();
  int64_t now = clock.NowNs();
  manager.DeviceDone(provisional, now, now);  // nothing ran: the slot returns
  JoinOrDie(launcher, second);
  manager.DeviceDone(manager.Launched(), now, now);
  CHECK_EQ(manager.stats().ops_in_flight, 0);
}

// Destruction releases a caller held by a pause.
void TestDestructorReleasesWaiters() {
  auto manager = std::make_unique<OpManager>(OpManager::Options{0.0});
  OpManager* raw = manager.get();
  std::atomic<bool> returned{false};
  std::thread caller([&returned, raw] {
    raw->Admit();  // the manager is gone when this returns: no Finish
    returned = true;
  });
  CHECK(Eventually([&] { return manager->stats().ops_waiting_now == 1; }));
  manager.reset();
  JoinOrDie(caller, returned);
}

// Many threads, real clock: every op is admitted and counted exactly once.
void TestConcurrentCallers() {
  OpManager::Options options;
  options.initial_share = 0.5;
  OpManager manager(options);
  constexpr int kThreads = 8, kOps = 200;
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kOps; ++i) {
        OpManager::ScopedOp op(manager);
        ran.fetch_add(1);
      }
    });
  }
  std::atomic<bool> all{false};
  std::thread watcher([&] {
    Eventually([&] { return ran.load() == kThreads * kOps; });
    all = true;
  });
  JoinOrDie(watcher, all);
  for (auto& t : threads) t.join();
  OpManager::Stats s = manager.stats();
  CHECK_EQ(s.ops_total, kThreads * kOps);
  CHECK_EQ(s.ops_in_flight, 0);
  CHECK_EQ(s.ops_waiting_now, 0);
}

// The achieved-share window covers only time spent throttled: right after
// leaving share 1 (when ops were not timed) it does not read low.
void TestWindowCoversThrottledTimeOnly() {
  FakeClock clock;
  OpManager::Options options = FakeOptions(&clock, 1.0);
  options.window_ns = 1'000 * kMs;
  OpManager manager(options);
  clock.Advance(10'000 * kMs);  // untimed work at share 1
  manager.SetShare(0.5);
  for (int i = 0; i < 50; ++i) HostOp(manager, clock, 1 * kMs);
  int64_t marker = manager.Admit();
  manager.Finish(marker);
  OpManager::Stats s = manager.stats();
  CHECK_NEAR(s.achieved_share_window, 0.5, 1e-6);
  CHECK_EQ(s.op_ns_ewma, 875 * kUs);  // 1 ms ops, then the 0 ns marker at weight 1/8
}

void TestValidation() {
  OpManager::Options bad;
  bad.initial_share = 1.5;
  CHECK(OpManager::Validate(bad).find("initial_share") == 0);
  bad.initial_share = 0.5;
  bad.window_ns = 0;
  CHECK(OpManager::Validate(bad).find("window_ns") == 0);
  bad.window_ns = 1;
  bad.max_credit_ns = -1;
  CHECK(OpManager::Validate(bad).find("max_credit_ns") == 0);
  bad.max_credit_ns = 0;
  bad.device_burst_ns = -1;
  CHECK(OpManager::Validate(bad).find("device_burst_ns: -1 is outside the accepted range [0, 1e9]") == 0);
  bad.device_burst_ns = 1'000'000'001;
  CHECK(OpManager::Validate(bad).find("device_burst_ns") == 0);
  bad.device_burst_ns = 0;
  bad.max_pending_device_ops = 0;
  CHECK(OpManager::Validate(bad).find("max_pending_device_ops") == 0);
  bool threw = false;
  try {
    OpManager m(bad);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("[1, 2^63)") != std::string::npos;
  }
  CHECK(threw);
  OpManager ok(OpManager::Options{0.5});
  CHECK(!ok.SetShare(std::nan("")));
  CHECK(!ok.SetShare(-0.1));
  CHECK(!ok.SetShare(1.01));
  CHECK_NEAR(ok.share(), 0.5, 0.0);
  CHECK(ok.SetShare(0.0) && ok.stats().paused);
}

// An op that throws still finishes: nothing stays in flight.
void TestExceptionFinishesTheOp() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  try {
    OpManager::ScopedOp op(manager);
    clock.Advance(1 * kMs);
    throw std::runtime_error("kernel failed");
  } catch (const std::runtime_error&) {
  }
  OpManager::Stats s = manager.stats();
  CHECK_EQ(s.ops_in_flight, 0);
  CHECK_EQ(s.ops_total, 1);
  CHECK_EQ(s.busy_ns, 1 * kMs);
}


// The hooks lend what the waiting thread holds (the GIL) only when it must
// wait, once per admission, and never while the manager's lock is held (a
// hook that calls back into the manager would deadlock on it).
class CountingHooks final : public BlockingHooks {
 public:
  OpManager* manager = nullptr;
  int before = 0, after = 0;
  void* BeforeBlock() override {
    ++before;
    manager->stats();  // takes the manager's lock: must not be held here
    return this;
  }
  void AfterBlock(void* token) override {
    CHECK(token == this);
    ++after;
    manager->stats();
  }
};

void TestBlockingHooksOnlyAroundWaits() {
  FakeClock clock;
  CountingHooks hooks;
  OpManager::Options options = FakeOptions(&clock, 0.5);
  options.blocking_hooks = &hooks;
  OpManager manager(options);
  hooks.manager = &manager;
  HostOp(manager, clock, 1 * kMs);  // admitted at once: nothing lent
  CHECK_EQ(hooks.before, 0);
  int64_t before = clock.NowNs();
  int64_t admitted = manager.Admit();  // owes 1 ms of idle: waits, lends
  CHECK_EQ(admitted - before, 1 * kMs);
  manager.Finish(admitted);
  CHECK_EQ(hooks.before, 1);
  CHECK_EQ(hooks.after, 1);
  CHECK_EQ(manager.stats().ops_waiting_now, 0);
}

}  // namespace
}  // namespace antman

int main() {
  struct Case {
    const char* name;
    void (*fn)();
  };
  const Case cases[] = {
      {"ShareHeldForHostOps", antman::TestShareHeldForHostOps},
      {"NaturalGapsCountAsIdle", antman::TestNaturalGapsCountAsIdle},
      {"ShortGapsAreTheJobs", antman::TestShortGapsAreTheJobs},
      {"WaitCpuIsCharged", antman::TestWaitCpuIsCharged},
      {"CreditIsCapped", antman::TestCreditIsCapped},
      {"LargestCreditCapDoesNotWrap", antman::TestLargestCreditCapDoesNotWrap},
      {"PauseHoldsAndResumeReleasesInOrder", antman::TestPauseHoldsAndResumeReleasesInOrder},
      {"ShareChangeMidStream", antman::TestShareChangeMidStream},
      {"OverlappingOpsCountOnce", antman::TestOverlappingOpsCountOnce},
      {"BlockedOpDoesNotBlockOthers", antman::TestBlockedOpDoesNotBlockOthers},
      {"NestedOpsAreAdmittedInline", antman::TestNestedOpsAreAdmittedInline},
      {"DeviceTimedOps", antman::TestDeviceTimedOps},
      {"DeviceBurstsBankAWholeTurn", antman::TestDeviceBurstsBankAWholeTurn},
      {"PendingDeviceOpsAreBounded", antman::TestPendingDeviceOpsAreBounded},
      {"PendingSlotIsTakenAtAdmission", antman::TestPendingSlotIsTakenAtAdmission},
      {"DestructorReleasesWaiters", antman::TestDestructorReleasesWaiters},
      {"ConcurrentCallers", antman::TestConcurrentCallers},
      {"WindowCoversThrottledTimeOnly", antman::TestWindowCoversThrottledTimeOnly},
      {"Validation", antman::TestValidation},
      {"ExceptionFinishesTheOp", antman::TestExceptionFinishesTheOp},
      {"BlockingHooksOnlyAroundWaits", antman::TestBlockingHooksOnlyAroundWaits},
  };
  int passed = 0, failed = 0;
  for (const Case& c : cases) {
    antman::g_test_failed = false;
    c.fn();
    std::printf("%s %s\n", antman::g_test_failed ? "FAIL" : "ok  ", c.name);
    antman::g_test_failed ? ++failed : ++passed;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
