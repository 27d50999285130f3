// The op manager's and the gate's C API (libantman_core.so) as a binding sees
// them: ABI versions, every bad argument refused with its field named, host-
// and device-timed ops, pause and release. Real clock, no timing thresholds.
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

#include "cc/core/antman_memory.h"
#include "cc/core/antman_ops.h"
#include "cc/core/cuda_gate.h"
#include "cc/core/test_check.h"

namespace {

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

std::string LastError() { return antman_core_last_error(); }

// The error text for a config that must be refused ("" if it was accepted).
std::string Refusal(const antman_opm_config* c) {
  char err[256] = "untouched";
  antman_opm* opm = reinterpret_cast<antman_opm*>(&err);  // must be reset to NULL
  const int rc = antman_opm_create(c, &opm, err, sizeof(err));
  if (rc == ANTMAN_OK) {
    antman_opm_destroy(opm);
    return "";
  }
  if (opm != nullptr) return "out not reset to NULL";
  if (LastError() != err) return "last error differs from err";
  return err;
}

antman_opm* Make(double share) {
  antman_opm_config c;
  antman_opm_default_config(&c);
  c.initial_share = share;
  antman_opm* opm = nullptr;
  char err[256];
  if (antman_opm_create(&c, &opm, err, sizeof(err)) != ANTMAN_OK) return nullptr;
  return opm;
}

antman_opm_stats Stats(const antman_opm* opm) {
  antman_opm_stats s;
  std::memset(&s, 0xff, sizeof(s));
  EXPECT_EQ(antman_opm_get_stats(opm, &s), ANTMAN_OK);
  return s;
}

template <typename Pred>
bool Eventually(Pred done) {
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

TEST(AbiVersions) {
  antman_core_abi abi{-1, -1, -1};
  antman_core_get_abi(&abi);
  EXPECT_EQ(abi.mem, ANTMAN_MEM_ABI_VERSION);
  EXPECT_EQ(abi.ops, ANTMAN_OPS_ABI_VERSION);
  EXPECT_EQ(abi.gate, ANTMAN_GATE_ABI_VERSION);
  antman_core_get_abi(nullptr);  // ignored, no crash
}

TEST(DefaultsAreOpManagerDefaults) {
  antman_opm_config c;
  std::memset(&c, 0xff, sizeof(c));
  antman_opm_default_config(&c);
  EXPECT(c.initial_share == 1.0);
  EXPECT_EQ(c.window_ns, 1'000'000'000);
  EXPECT_EQ(c.max_credit_ns, 5'000'000);
  EXPECT_EQ(c.max_pending_device_ops, 256);
  EXPECT_EQ(c.device_burst_ns, 2'000'000);
  EXPECT(Refusal(&c).empty());
}

TEST(CreateRefusesBadConfigsNamingTheField) {
  antman_opm_config good;
  antman_opm_default_config(&good);
  antman_opm_config c = good;
  c.initial_share = 1.5;
  EXPECT(Contains(Refusal(&c), "initial_share: 1.5 is outside the accepted range [0, 1]"));
  c.initial_share = NAN;
  EXPECT(Contains(Refusal(&c), "initial_share"));
  c = good;
  c.window_ns = 0;
  EXPECT(Contains(Refusal(&c), "window_ns: 0"));
  c = good;
  c.max_credit_ns = -1;
  EXPECT(Contains(Refusal(&c), "max_credit_ns: -1"));
  c = good;
  c.max_pending_device_ops = 0;
  EXPECT(Contains(Refusal(&c), "max_pending_device_ops: 0 is outside the accepted range [1"));
  c = good;
  c.device_burst_ns = -5;
  EXPECT(Contains(Refusal(&c), "device_burst_ns: -5 is outside the accepted range [0, 1e9]"));
  EXPECT(Contains(Refusal(nullptr), "config: must not be NULL"));
  char err[8];
  EXPECT_EQ(antman_opm_create(&good, nullptr, err, sizeof(err)), ANTMAN_ERR_INVALID);
  EXPECT_EQ(std::strlen(err), 7u);  // truncated, still terminated
  EXPECT(Contains(LastError(), "out: must not be NULL"));
}

TEST(NullHandlesAndBadArgumentsAreErrors) {
  int64_t t = 0;
  antman_opm_stats s;
  EXPECT_EQ(antman_opm_set_share(nullptr, 0.5), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "opm: must not be NULL"));
  EXPECT_EQ(antman_opm_admit(nullptr, ANTMAN_TIMING_HOST, &t), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_finish(nullptr, 0), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_launched(nullptr, &t), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_device_done(nullptr, 0, 0, 0), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_get_stats(nullptr, &s), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_unthrottled(nullptr), 0);
  EXPECT_EQ(antman_opm_now_ns(nullptr), -1);
  antman_opm_destroy(nullptr);

  antman_opm* opm = Make(0.5);
  REQUIRE(opm != nullptr);
  EXPECT_EQ(antman_opm_set_share(opm, 1.5), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "share: 1.5 is outside the accepted range [0, 1]"));
  EXPECT_EQ(antman_opm_set_share(opm, -0.1), ANTMAN_ERR_INVALID);
  EXPECT(Stats(opm).share == 0.5);  // kept
  EXPECT_EQ(antman_opm_admit(opm, 7, &t), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "timing: 7 is not one of 0 (ANTMAN_TIMING_HOST)"));
  EXPECT_EQ(antman_opm_admit(opm, ANTMAN_TIMING_HOST, nullptr), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "admitted_ns: must not be NULL"));
  EXPECT_EQ(antman_opm_finish(opm, -5), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "admitted_ns: -5"));
  EXPECT_EQ(antman_opm_launched(opm, nullptr), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_device_done(opm, -1, 0, 0), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "provisional_ns: -1"));
  EXPECT_EQ(antman_opm_device_done(opm, 0, -3, 0), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "start_ns: -3"));
  EXPECT_EQ(antman_opm_device_done(opm, 0, 10, 5), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "end_ns: 5 is outside the accepted range [start_ns = 10"));
  // A time the clock has not reached: no device ran then (as a profile sample,
  // near 2^63, it used to leave the op's pending slot taken for good).
  const int64_t future = antman_opm_now_ns(opm) + 1'000'000'000;
  EXPECT_EQ(antman_opm_device_done(opm, 0, 0, future), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "is later than the manager's clock now"));
  EXPECT_EQ(antman_opm_device_done(opm, 0, 0, INT64_MAX), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_opm_get_stats(opm, nullptr), ANTMAN_ERR_INVALID);
  // None of the refused calls reached the manager.
  antman_opm_stats st = Stats(opm);
  EXPECT_EQ(st.ops_total, 0);
  EXPECT_EQ(st.ops_in_flight, 0);
  antman_opm_destroy(opm);
}

TEST(HostAndDeviceTimedOps) {
  antman_opm* opm = Make(0.5);
  REQUIRE(opm != nullptr);
  EXPECT_EQ(antman_opm_unthrottled(opm), 0);
  int64_t t = -7;
  REQUIRE(antman_opm_admit(opm, ANTMAN_TIMING_HOST, &t) == ANTMAN_OK);
  EXPECT(t >= 0);
  EXPECT_EQ(Stats(opm).ops_in_flight, 1);
  EXPECT_EQ(antman_opm_finish(opm, t), ANTMAN_OK);
  antman_opm_stats s = Stats(opm);
  EXPECT_EQ(s.ops_total, 1);
  EXPECT_EQ(s.ops_in_flight, 0);
  const int64_t host_busy = s.busy_ns;

  // A device op: the interval given at completion is what is charged.
  REQUIRE(antman_opm_admit(opm, ANTMAN_TIMING_DEVICE, &t) == ANTMAN_OK);
  int64_t provisional = -1;
  REQUIRE(antman_opm_launched(opm, &provisional) == ANTMAN_OK);
  EXPECT(provisional >= 0);
  EXPECT_EQ(Stats(opm).ops_in_flight, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(4));  // the kernel ran after the host op
  const int64_t now = antman_opm_now_ns(opm);
  EXPECT(now >= t);
  EXPECT_EQ(antman_opm_device_done(opm, provisional, now - 3'000'000, now - 1'000'000), ANTMAN_OK);
  s = Stats(opm);
  EXPECT_EQ(s.ops_total, 2);
  EXPECT_EQ(s.ops_in_flight, 0);
  EXPECT_EQ(s.busy_ns - host_busy, 2'000'000);
  EXPECT_EQ(s.op_ns_ewma > 0, true);
  EXPECT(s.share == 0.5);
  EXPECT_EQ(s.paused, 0);
  EXPECT_EQ(s.window_ns, 1'000'000'000);
  antman_opm_destroy(opm);
}

TEST(PauseHoldsAnAdmissionUntilTheShareRises) {
  antman_opm* opm = Make(1.0);
  REQUIRE(opm != nullptr);
  EXPECT_EQ(antman_opm_unthrottled(opm), 1);
  EXPECT_EQ(antman_opm_set_share(opm, 0.0), ANTMAN_OK);
  EXPECT_EQ(antman_opm_unthrottled(opm), 0);
  EXPECT_EQ(Stats(opm).paused, 1);
  std::atomic<bool> admitted{false};
  std::thread caller([&] {
    int64_t t = 0;
    antman_opm_admit(opm, ANTMAN_TIMING_HOST, &t);
    admitted = true;
    antman_opm_finish(opm, t);
  });
  EXPECT(Eventually([&] { return Stats(opm).ops_waiting_now == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT(!admitted.load());
  EXPECT_EQ(antman_opm_set_share(opm, 1.0), ANTMAN_OK);
  caller.join();
  EXPECT(admitted.load());
  EXPECT_EQ(Stats(opm).ops_total, 1);
  antman_opm_destroy(opm);
}

TEST(GateRefusesBadArgumentsAndAMissingDriver) {
  antman_opm* opm = Make(0.5);
  REQUIRE(opm != nullptr);
  antman_gate_config c;
  antman_gate_default_config(&c);
  EXPECT_EQ(c.device_ordinal, 0);
  EXPECT_EQ(c.poll_interval_ns, 20'000);
  EXPECT_EQ(c.anchor_interval_ns, 1'000'000'000);
  char err[256];
  antman_gate* gate = reinterpret_cast<antman_gate*>(&err);
  antman_gate_config bad = c;
  bad.poll_interval_ns = 0;
  EXPECT_EQ(antman_gate_create(opm, &bad, &gate, err, sizeof(err)), ANTMAN_ERR_INVALID);
  EXPECT(gate == nullptr);
  EXPECT(Contains(err, "poll_interval_ns: 0 is outside the accepted range [1000, 100000000]"));
  bad = c;
  bad.device_ordinal = -2;
  EXPECT_EQ(antman_gate_create(opm, &bad, &gate, err, sizeof(err)), ANTMAN_ERR_INVALID);
  EXPECT(Contains(err, "device_ordinal: -2"));
  EXPECT_EQ(antman_gate_create(nullptr, &c, &gate, err, sizeof(err)), ANTMAN_ERR_INVALID);
  EXPECT(Contains(err, "opm: must not be NULL"));
  EXPECT_EQ(antman_gate_create(opm, nullptr, &gate, err, sizeof(err)), ANTMAN_ERR_INVALID);
  EXPECT(Contains(err, "config: must not be NULL"));
  antman_gate_op* op = nullptr;
  antman_gate_stats gs;
  EXPECT_EQ(antman_gate_begin(nullptr, nullptr, &op), ANTMAN_ERR_INVALID);
  EXPECT(Contains(LastError(), "gate: must not be NULL"));
  EXPECT_EQ(antman_gate_end(nullptr, op), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_gate_drain(nullptr), ANTMAN_ERR_INVALID);
  EXPECT_EQ(antman_gate_get_stats(nullptr, &gs), ANTMAN_ERR_INVALID);
  antman_gate_destroy(nullptr);

  // A valid config: without a driver (this machine, CI) a clear device error.
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  const int rc = antman_gate_create(opm, &c, &gate, err, sizeof(err));
  if (driver == nullptr) {
    EXPECT_EQ(rc, ANTMAN_ERR_DEVICE);
    EXPECT(gate == nullptr);
    EXPECT(Contains(err, "CUDA driver not available"));
  } else if (rc == ANTMAN_OK) {
    antman_gate_destroy(gate);
  } else {
    EXPECT(std::strlen(err) > 0);  // a driver without a usable device: still a message
  }
  antman_opm_destroy(opm);
}

TEST_MAIN()
