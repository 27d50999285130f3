// Unit tests of the GpuOpManager on a fake clock: time moves only when an op
// advances it or the manager sleeps, so every figure below is exact and no
// test depends on how fast this machine is.
#include "cc/core/op_manager.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
  int64_t NowNs() const override { return now_.load(); }
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
  }
  int untimed_waiters() const { return untimed_waiters_.load(); }

 private:
  std::atomic<int64_t> now_{1'000'000'000};
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
// a zero-length marker op equals the share, and all the gap was inserted.
void TestShareHeldForSyncOps() {
  for (double share : {0.25, 0.5, 0.75}) {
    FakeClock clock;
    OpManager manager(FakeOptions(&clock, share));
    const int64_t durations[] = {300 * kUs, 1 * kMs, 2500 * kUs};
    int64_t first_start = -1;
    int64_t busy = 0;
    const int kOps = 300;
    for (int i = 0; i < kOps; ++i) {
      int64_t d = durations[i % 3];
      busy += d;
      manager.Run([&clock, &first_start, d] {
        if (first_start < 0) first_start = clock.NowNs();
        clock.Advance(d);
      });
    }
    int64_t marker = 0;
    manager.Run([&] { marker = clock.NowNs(); });
    double achieved = static_cast<double>(busy) /
                      static_cast<double>(marker - first_start);
    CHECK_NEAR(achieved, share, 1e-6);
    OpManager::Stats stats = manager.stats();
    CHECK_EQ(stats.busy_ns, busy);
    CHECK_EQ(stats.idle_inserted_ns, marker - first_start - busy);
    CHECK_EQ(stats.ops_total, kOps + 1);
    CHECK_EQ(stats.ops_delayed, kOps);  // every op after the first, and marker
  }
}

// A gap the job left by itself counts as idle: no idle is added on top.
void TestNaturalGapsCountAsIdle() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  auto op_of = [&clock](int64_t d, int64_t* start) {
    return [&clock, d, start] {
      *start = clock.NowNs();
      clock.Advance(d);
    };
  };
  int64_t start1 = 0, start2 = 0, start3 = 0;
  manager.Run(op_of(1 * kMs, &start1));
  clock.Advance(5 * kMs);  // more than the 1 ms of idle the share needs
  int64_t submit2 = clock.NowNs();
  manager.Run(op_of(1 * kMs, &start2));
  CHECK_EQ(start2, submit2);
  clock.Advance(400 * kUs);  // 600 us short of the idle owed
  int64_t submit3 = clock.NowNs();
  manager.Run(op_of(1 * kMs, &start3));
  CHECK_EQ(start3 - submit3, 600 * kUs);
  OpManager::Stats stats = manager.stats();
  CHECK_EQ(stats.idle_inserted_ns, 600 * kUs);
  CHECK_EQ(stats.ops_delayed, 1);
}

// After a long idle spell the job may only burst max_credit_ns worth.
void TestCreditIsCapped() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5, /*max_credit_ns=*/4 * kMs));
  clock.Advance(1000 * kMs);  // uncapped, this would bank 500 ms
  std::vector<int64_t> starts;
  for (int i = 0; i < 20; ++i) {
    manager.Run([&] {
      starts.push_back(clock.NowNs());
      clock.Advance(1 * kMs);
    });
  }
  // 4 ms of credit pays 0.5 ms of idle for each of 8 ops; the 9th starts at
  // zero credit; the 11 after it each wait 1 ms.
  OpManager::Stats stats = manager.stats();
  CHECK_EQ(stats.ops_delayed, 11);
  CHECK_EQ(starts[8] - starts[0], 8 * kMs);
  CHECK_EQ(starts[19] - starts[9], 10 * 2 * kMs);
}

// Share 0 holds every op (sync callers block), resuming launches them in
// submission order.
void TestPauseBlocksAndResumeReleasesInOrder() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  CHECK(manager.SetShare(0.0));
  std::mutex order_mu;
  std::vector<int> order;
  for (int i = 0; i < 50; ++i) {
    manager.RunAsync([&, i](std::function<void()> done) {
      {
        std::lock_guard<std::mutex> lock(order_mu);
        order.push_back(i);
      }
      clock.Advance(100 * kUs);
      done();
    });
  }
  std::atomic<bool> sync_returned{false};
  std::thread sync_caller([&] {
    manager.Run([&] {
      std::lock_guard<std::mutex> lock(order_mu);
      order.push_back(50);
    });
    sync_returned = true;
  });
  CHECK(Eventually([&] {
    return manager.stats().ops_queued_now == 51 && clock.untimed_waiters() == 1;
  }));
  // Not a timing threshold: a manager that ignores the pause gets time to
  // show it.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard<std::mutex> lock(order_mu);
    CHECK(order.empty());
  }
  CHECK(!sync_returned.load());
  OpManager::Stats paused = manager.stats();
  CHECK(paused.paused);
  CHECK_EQ(paused.ops_queued_now, 51);
  CHECK_EQ(paused.ops_total, 0);

  CHECK(manager.SetShare(0.5));
  JoinOrDie(sync_caller, sync_returned);
  std::lock_guard<std::mutex> lock(order_mu);
  CHECK_EQ(order.size(), 51);
  for (int i = 0; i < static_cast<int>(order.size()); ++i) CHECK_EQ(order[i], i);
  CHECK_EQ(manager.stats().ops_total, 51);
}

// A new share applies from the next launch; going to 1 drains the queue
// without inserting idle.
void TestShareChangeMidStream() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.25));
  std::vector<int64_t> starts;
  auto op = [&] {
    starts.push_back(clock.NowNs());
    clock.Advance(1 * kMs);
  };
  for (int i = 0; i < 100; ++i) manager.Run(op);
  CHECK(manager.SetShare(0.75));
  for (int i = 0; i < 100; ++i) manager.Run(op);
  CHECK_EQ(starts.size(), 200);
  CHECK_NEAR(99.0 * kMs / static_cast<double>(starts[99] - starts[0]), 0.25,
             1e-6);
  CHECK_NEAR(99.0 * kMs / static_cast<double>(starts[199] - starts[100]), 0.75,
             1e-5);
  // 0.75 ms of idle owed after op 99, paid back at the new share: 1 ms, not 3.
  CHECK_EQ(starts[100] - starts[99], 2 * kMs);

  CHECK(manager.SetShare(0.0));
  for (int i = 0; i < 20; ++i) {
    manager.RunAsync([&](std::function<void()> done) {
      clock.Advance(1 * kMs);
      done();
    });
  }
  CHECK(Eventually([&] { return manager.stats().ops_queued_now == 20; }));
  int64_t idle_before = manager.stats().idle_inserted_ns;
  int64_t t0 = clock.NowNs();
  CHECK(manager.SetShare(1.0));
  CHECK(manager.unthrottled());
  manager.Run([] {});
  CHECK_EQ(clock.NowNs() - t0, 20 * kMs);
  CHECK_EQ(manager.stats().idle_inserted_ns, idle_before);
}

// Idle time before a share change accrues at the share then in force.
void TestShareChangeKeepsEarlierAccrual() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  manager.Run([&] { clock.Advance(1 * kMs); });  // owes 1 ms idle at 0.5
  clock.Advance(1 * kMs);                          // paid in full
  CHECK(manager.SetShare(0.25));
  int64_t submit = clock.NowNs();
  int64_t start = 0;
  manager.Run([&] { start = clock.NowNs(); });
  CHECK_EQ(start, submit);  // at 0.25 the same idle would still owe 1 ms
}

// Async ops: the queue goes on while one is in flight, its launch->done time
// is charged when done comes, and one waiting on a later op cannot deadlock.
void TestAsyncOps() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  int64_t t0 = clock.NowNs();
  std::function<void()> done_a;
  manager.RunAsync([&](std::function<void()> done) { done_a = std::move(done); });
  manager.Run([&] { clock.Advance(1 * kMs); });  // runs while A is in flight
  CHECK_EQ(manager.stats().ops_in_flight, 1);
  clock.Advance(2 * kMs);
  done_a();  // A was busy from t0 to t0 + 3 ms
  int64_t start_c = 0;
  manager.Run([&] { start_c = clock.NowNs(); });
  // 3 ms busy at share 0.5 needs 3 ms idle: C launches at t0 + 6 ms.
  CHECK_EQ(start_c - t0, 6 * kMs);
  OpManager::Stats stats = manager.stats();
  CHECK_EQ(stats.busy_ns, 3 * kMs);  // the overlap with B counts once
  CHECK_EQ(stats.ops_total, 3);
  CHECK_EQ(stats.ops_in_flight, 0);
  done_a();  // a second call is ignored
  CHECK_EQ(manager.stats().ops_total, 3);

  // Like a Recv waiting for a Send queued behind it.
  std::atomic<bool> send_ran{false};
  std::thread waiter;
  manager.RunAsync([&](std::function<void()> done) {
    waiter = std::thread([&send_ran, done] {
      while (!send_ran.load()) std::this_thread::yield();
      done();
    });
  });
  manager.Run([&] {
    clock.Advance(1 * kMs);
    send_ran = true;
  });
  waiter.join();
  CHECK(send_ran.load());
  CHECK(Eventually([&] { return manager.stats().ops_in_flight == 0; }));
}

// The destructor runs what is queued, even while paused, and waits for the
// done of async ops it launched.
void TestDestructorRunsQueuedOps() {
  FakeClock clock;
  auto manager = std::make_unique<OpManager>(FakeOptions(&clock, 0.0));
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) {
    manager->RunAsync([&](std::function<void()> done) {
      ++ran;
      done();
    });
  }
  std::atomic<bool> late_done{false};
  std::thread late;
  manager->RunAsync([&](std::function<void()> done) {
    late = std::thread([&late_done, done] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      late_done = true;
      done();
    });
  });
  std::atomic<bool> sync_returned{false};
  std::thread sync_caller([&] {
    manager->Run([&] { ++ran; });
    sync_returned = true;
  });
  CHECK(Eventually([&] { return manager->stats().ops_queued_now == 12; }));
  CHECK_EQ(ran.load(), 0);
  manager.reset();
  CHECK(late_done.load());
  JoinOrDie(sync_caller, sync_returned);
  late.join();
  CHECK_EQ(ran.load(), 11);
  CHECK(sync_returned.load());
}

// Many submitters at once: every op runs exactly once, each thread's ops in
// its own order, and the busy time adds up.
void TestConcurrentSubmitters() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  constexpr int kThreads = 8;
  constexpr int kPerThread = 200;
  std::vector<std::atomic<int>> runs(kThreads * kPerThread);
  std::vector<std::vector<int>> seen(kThreads);  // appended on the manager
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        int id = t * kPerThread + i;
        auto body = [&, t, i, id] {
          ++runs[id];
          seen[t].push_back(i);
          clock.Advance(10 * kUs);
        };
        // The last op is sync, so it returns after all of this thread's ops.
        if (i % 2 == 0 && i != kPerThread - 1) {
          manager.RunAsync([body](std::function<void()> done) {
            body();
            done();
          });
        } else {
          manager.Run(body);
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int id = 0; id < kThreads * kPerThread; ++id) CHECK_EQ(runs[id].load(), 1);
  for (int t = 0; t < kThreads; ++t) {
    CHECK_EQ(seen[t].size(), kPerThread);
    for (int i = 0; i < static_cast<int>(seen[t].size()); ++i) {
      CHECK_EQ(seen[t][i], i);
    }
  }
  OpManager::Stats stats = manager.stats();
  CHECK_EQ(stats.ops_total, kThreads * kPerThread);
  CHECK_EQ(stats.busy_ns, kThreads * kPerThread * 10 * kUs);
}

void TestWindowShare() {
  FakeClock clock;
  OpManager::Options options = FakeOptions(&clock, 0.5);
  options.window_ns = 100 * kMs;
  OpManager manager(options);
  for (int i = 0; i < 200; ++i) manager.Run([&] { clock.Advance(1 * kMs); });
  OpManager::Stats stats = manager.stats();
  // The window ends on a busy ms: it holds 50 busy and 50 idle ms.
  CHECK_NEAR(stats.achieved_share_window, 0.5, 1e-6);
  CHECK_EQ(stats.window_ns, 100 * kMs);
  CHECK_EQ(stats.op_ns_ewma, 1 * kMs);
  CHECK_EQ(stats.credit_ns, -500 * kUs);
}

void TestValidation() {
  FakeClock clock;
  OpManager::Options bad = FakeOptions(&clock, 1.5);
  std::string message;
  try {
    OpManager manager(bad);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  CHECK(message.find("initial_share") != std::string::npos);
  CHECK(message.find("[0, 1]") != std::string::npos);
  bad = FakeOptions(&clock, 0.5);
  bad.window_ns = 0;
  CHECK(OpManager::Validate(bad).find("window_ns") != std::string::npos);
  bad = FakeOptions(&clock, 0.5, -1);
  CHECK(OpManager::Validate(bad).find("max_credit_ns") != std::string::npos);
  CHECK(OpManager::Validate(FakeOptions(&clock, 0.5)).empty());

  OpManager manager(FakeOptions(&clock, 0.5));
  CHECK(!manager.SetShare(1.5));
  CHECK(!manager.SetShare(-0.1));
  CHECK(!manager.SetShare(std::nan("")));
  CHECK_NEAR(manager.share(), 0.5, 0.0);
  CHECK(OpManager::ValidateShare(2.0).find("share") != std::string::npos);
}

void TestUnthrottledPathAndRecordBusy() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 1.0, 4 * kMs));
  CHECK(manager.unthrottled());
  int64_t start = manager.NowNs();
  clock.Advance(2 * kMs);
  manager.RecordBusy(start, manager.NowNs());
  OpManager::Stats stats = manager.stats();
  CHECK_EQ(stats.busy_ns, 2 * kMs);
  CHECK_EQ(stats.ops_total, 1);
  // Two ops that ran in parallel on caller threads: their union is busy.
  int64_t t = manager.NowNs();
  clock.Advance(3 * kMs);
  manager.RecordBusy(t, t + 2 * kMs);
  manager.RecordBusy(t + 1 * kMs, t + 3 * kMs);
  stats = manager.stats();
  CHECK_EQ(stats.busy_ns, 5 * kMs);
  CHECK_EQ(stats.ops_total, 3);
  CHECK(manager.SetShare(0.5));
  CHECK(!manager.unthrottled());
  // Busy recorded at share 1 used up the credit it accrued: none is left
  // to burst with after the switch.
  CHECK_EQ(manager.stats().credit_ns, 0);
}

void TestExceptionReachesCaller() {
  FakeClock clock;
  OpManager manager(FakeOptions(&clock, 0.5));
  std::string message;
  try {
    manager.Run([] { throw std::runtime_error("kernel failed"); });
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  CHECK(message == "kernel failed");
  bool ran = false;
  manager.Run([&] { ran = true; });
  CHECK(ran);
}

}  // namespace
}  // namespace antman

int main() {
  struct Case {
    const char* name;
    void (*fn)();
  };
  const Case cases[] = {
      {"ShareHeldForSyncOps", antman::TestShareHeldForSyncOps},
      {"NaturalGapsCountAsIdle", antman::TestNaturalGapsCountAsIdle},
      {"CreditIsCapped", antman::TestCreditIsCapped},
      {"PauseBlocksAndResumeReleasesInOrder",
       antman::TestPauseBlocksAndResumeReleasesInOrder},
      {"ShareChangeMidStream", antman::TestShareChangeMidStream},
      {"ShareChangeKeepsEarlierAccrual",
       antman::TestShareChangeKeepsEarlierAccrual},
      {"AsyncOps", antman::TestAsyncOps},
      {"DestructorRunsQueuedOps", antman::TestDestructorRunsQueuedOps},
      {"ConcurrentSubmitters", antman::TestConcurrentSubmitters},
      {"WindowShare", antman::TestWindowShare},
      {"Validation", antman::TestValidation},
      {"UnthrottledPathAndRecordBusy", antman::TestUnthrottledPathAndRecordBusy},
      {"ExceptionReachesCaller", antman::TestExceptionReachesCaller},
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
