// tf-antman GpuOpManager: limits the share of time a job keeps its device busy
// (paper §3.1.2, §4.1) by delaying the *start* of operators. No framework types.
//
// The manager decides when an op may start; it never runs an op. The op runs
// where the framework would have run it (the caller's thread for a synchronous
// kernel, the framework's callbacks for an asynchronous one), so the
// framework's threading, floating-point environment and inter-op parallelism
// are kept, and an op that waits for another op can never deadlock on the
// manager: admission waits for time and for a share > 0, never for another op.
//
// Two ways an op's busy time is known:
//   host-timed   (emulated device): from admission until Finish(), on the
//                manager's clock; overlapping ops count once (busy union);
//   device-timed (GPU): the kernel's own start/end from device events, which
//                arrive after the launch; the op is charged a provisional
//                estimate at launch and the true time when the event completes.
// docs/op-manager.md explains the algorithm and why it is deadlock-free.
//
// Units: nanoseconds on the manager's Clock; shares are fractions in [0, 1].
// Thread safety: every public method may be called from any thread.
#ifndef TF_ANTMAN_CC_CORE_OP_MANAGER_H_
#define TF_ANTMAN_CC_CORE_OP_MANAGER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <utility>

namespace antman {

// Time source of the manager. Injected so tests drive time instead of sleeping.
class Clock {
 public:
  static constexpr int64_t kForever = std::numeric_limits<int64_t>::max();

  virtual ~Clock() = default;
  virtual int64_t NowNs() const = 0;
  // Blocks on `cv` (its mutex held through `lock`) until this clock reaches
  // `deadline_ns`, `cv` is notified, or a spurious wake-up; kForever waits for a
  // notification only. Callers re-check their condition after it returns.
  virtual void WaitUntil(std::unique_lock<std::mutex>& lock,
                         std::condition_variable& cv, int64_t deadline_ns) = 0;
  // CPU time the calling thread has used, in ns; 0 where not measured. A
  // host-timed op that waited charges what its thread spent going to sleep and
  // waking up (see OpManager::Admit): on the emulated device that CPU is the
  // device's.
  virtual int64_t ThreadCpuNs() const { return 0; }
};

// Monotonic wall clock (std::chrono::steady_clock). Never deleted.
Clock* SystemClock();

// Called around a wait in Admit(), outside the manager's lock: the framework
// glue lends what the waiting thread holds (Python's GIL: a TF eager op runs
// with it held, and a pause that kept it would stop every Python thread,
// among them the one that would lift the pause).
class BlockingHooks {
 public:
  virtual ~BlockingHooks() = default;
  // Returns what AfterBlock needs to take it back (nullptr: nothing lent).
  virtual void* BeforeBlock() = 0;
  virtual void AfterBlock(void* token) = 0;
};

class OpManager {
 public:
  struct Options {
    // Target busy share at start; 1.0 admits every op without delay.
    double initial_share = 1.0;
    // Span over which Stats::achieved_share_window is measured.
    int64_t window_ns = 1'000'000'000;
    // Most busy time a job may bank while idle or under its share and then
    // spend at full speed. It also absorbs oversleeping of real clocks.
    int64_t max_credit_ns = 5'000'000;
    // Device-timed ops launched but not yet completed, at most: bounds how
    // far a job may run ahead of its share while its charges are provisional.
    int64_t max_pending_device_ops = 256;
    // Device-timed ops only: a job that had to wait for its share waits until
    // it has banked this much busy time, then runs its ops back to back until
    // the bank is spent. Without MPS a GPU time-slices between processes, and
    // every switch to a job's context and back costs the job it interrupts:
    // on an H200 an opportunist at 5% that ran one 0.15 ms kernel per turn
    // slowed the job beside it by 16% (bench/gpu/check.py, step
    // interference). Fewer, longer turns switch less at the same share.
    // [0, 1e9], at most max_credit_ns in effect (the most a job may bank);
    // 0 runs each op as soon as its share allows.
    int64_t device_burst_ns = 2'000'000;
    // A host-timed op that starts at most this long after the job's busy time
    // last ended (and after the manager last released a delayed admission) is
    // charged from that end. Between back-to-back kernels the executor works
    // on the same threads as the kernels (the emulated device runs them
    // synchronously), and a gap this short could not serve another job: it is
    // the job's, not idle. Longer gaps (input, Python, held ops) stay idle.
    // 0 charges kernels only.
    int64_t bridge_gap_ns = 50'000;
    Clock* clock = nullptr;  // nullptr: SystemClock()
    BlockingHooks* blocking_hooks = nullptr;  // not owned; must outlive the manager
  };

  enum class Timing { kHost, kDevice };

  struct Stats {
    int64_t busy_ns;           // union of the busy time of finished ops
    int64_t idle_inserted_ns;  // time the head of the line waited for a slot
    int64_t ops_total;         // ops finished (host) or completed (device)
    int64_t ops_delayed;       // admissions that had to wait
    int64_t ops_waiting_now;   // callers blocked in Admit()
    int64_t ops_in_flight;     // admitted host ops not finished + device ops not completed
    double share;              // target share now
    double achieved_share_window;  // busy / wall over the last window_ns (throttled time only)
    int64_t window_ns;
    bool paused;               // share == 0
    int64_t op_ns_ewma;        // profiled op busy time (EWMA)
    int64_t credit_ns;         // banked busy time; negative = idle owed
  };

  // Returned by Admit() to a thread that is already inside an op of this
  // manager (a kernel that runs other kernels inline): the outer op's busy
  // time covers the inner one, and waiting could never end (the outer op is
  // busy until the inner one returns). Finish(kNested) does nothing.
  static constexpr int64_t kNested = -1;

  // "" when valid, else a message naming the bad field and its accepted range.
  static std::string Validate(const Options& options);
  static std::string ValidateShare(double share);

  // Throws std::invalid_argument with Validate()'s message on bad options.
  explicit OpManager(Options options);
  // Releases every waiting caller (admitting it without throttling) and waits
  // until none is left inside Admit(). Device ops still pending must not call
  // DeviceDone() afterwards: their owner drains them first.
  ~OpManager();

  OpManager(const OpManager&) = delete;
  OpManager& operator=(const OpManager&) = delete;

  // Returns false and keeps the old share when `share` is outside [0, 1].
  // Applies to the next admission and wakes waiting callers; 0 holds every
  // new op at its admission until a share > 0 (pause at an op boundary).
  bool SetShare(double share);
  double share() const;

  // The hot path: while true, callers run ops directly and skip the manager.
  bool unthrottled() const {
    return unthrottled_.load(std::memory_order_relaxed);
  }

  // Blocks the calling thread until the op may start: callers are admitted in
  // the order they arrived, each when the token bucket allows it (or at once
  // at share 1, or when the manager is shutting down). Returns the admission
  // time, or kNested (see above). A host-timed op is busy from here until
  // Finish(); a device-timed op must be followed by Launched().
  int64_t Admit(Timing timing = Timing::kHost);

  // Ends a host-timed op admitted at `admitted_ns` (any thread); its busy time
  // (what of [admitted, now) is not in the busy union yet) is charged now.
  // Charging each op at its end, not while it runs, is what keeps a long or
  // blocked op from holding back the ops it may be waiting for.
  void Finish(int64_t admitted_ns);

  // A device-timed op was launched: charges the profiled device time of an op
  // now as a provisional estimate and returns it. Pass it to DeviceDone().
  int64_t Launched();
  // The device finished the op: [start_ns, end_ns) is its kernel time on this
  // manager's clock (from device events). Replaces the provisional charge.
  // Completions must arrive roughly in device order (one stream per device).
  void DeviceDone(int64_t provisional_ns, int64_t start_ns, int64_t end_ns);

  int64_t NowNs() const { return clock_->NowNs(); }
  Stats stats() const;

  // RAII for a synchronous host-timed op on the calling thread: admits in the
  // constructor, finishes in the destructor, and marks the thread so that ops
  // run inline inside it are admitted as kNested.
  class ScopedOp {
   public:
    explicit ScopedOp(OpManager& manager);
    ~ScopedOp();
    ScopedOp(const ScopedOp&) = delete;
    ScopedOp& operator=(const ScopedOp&) = delete;

   private:
    OpManager& manager_;
    int64_t admitted_ns_;
    const OpManager* outer_;
  };

 private:
  // Brings the token bucket up to `now` under the share in force since the
  // last update.
  void AccrueLocked(int64_t now);
  // Nanoseconds the head of the line must still wait: 0 = admit now.
  int64_t SlotWaitNsLocked(Timing timing) const;
  // Busy time of running host ops not charged yet, at most (for the cap).
  int64_t UnchargedLocked(int64_t now) const;
  // The most the bucket may hold now: max_credit_ns plus busy time not charged yet.
  double CreditCapLocked(int64_t now) const;
  // Adds the part of [start, end) not yet in the busy union; returns its ns.
  int64_t ChargeIntervalLocked(int64_t start, int64_t end);
  // Forgets busy intervals that neither the window nor a running op can
  // still overlap.
  void PruneLocked(int64_t now);
  void ProfileLocked(int64_t op_ns);
  int64_t EwmaNsLocked() const;  // op_ns_ewma_ as int64, saturated

  const Options options_;
  Clock* const clock_;
  const int64_t created_ns_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // waiting callers
  double share_;
  std::atomic<bool> unthrottled_;
  bool stopping_ = false;
  // Since when the share has been below 1 (the window only covers timed time).
  int64_t throttled_since_;

  // Line of waiting callers: tickets are taken in arrival order and admitted
  // in the same order.
  uint64_t next_ticket_ = 0;
  uint64_t serving_ticket_ = 0;
  int64_t waiting_ = 0;

  // Admission times of host-timed ops running now.
  std::multiset<int64_t> running_starts_;
  int64_t device_pending_ = 0;
  // A device-timed head of the line waited for tokens and has not yet banked
  // Options::device_burst_ns: admissions wait until it has.
  bool refilling_ = false;

  // Token bucket in busy-ns: +share per wall ns, minus each op's busy time
  // when it finishes (device ops: provisionally at launch, exactly when the
  // device reports completion).
  double tokens_ = 0.0;
  int64_t tokens_at_ns_;

  // Busy union of finished ops: disjoint intervals by start, recent ones only.
  int64_t busy_ns_ = 0;
  std::map<int64_t, int64_t> busy_intervals_;
  // End of the latest busy interval, and the last admission that had waited:
  // a gap is bridged from the later of the two (never across inserted idle).
  int64_t last_busy_end_ns_;
  int64_t last_release_ns_;
  int64_t idle_inserted_ns_ = 0;
  int64_t ops_total_ = 0;
  int64_t ops_delayed_ = 0;
  double op_ns_ewma_ = 0.0;
  bool have_profile_ = false;
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_OP_MANAGER_H_
