// tf-antman GpuOpManager: limits the share of time a job keeps its device busy
// (paper §3.1.2, §4.1) by delaying operator launches. No TensorFlow types:
// the framework glue hands over closures.
//
// Units: nanoseconds on the manager's Clock; shares are fractions in [0, 1].
// Thread safety: every public method may be called from any thread.
// docs/op-manager.md explains the algorithm and why it keeps FIFO order,
// cannot deadlock on async ops, and pauses without losing ops.
#ifndef TF_ANTMAN_CC_CORE_OP_MANAGER_H_
#define TF_ANTMAN_CC_CORE_OP_MANAGER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
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
};

// Monotonic wall clock (std::chrono::steady_clock). Never deleted.
Clock* SystemClock();

class OpManager {
 public:
  struct Options {
    // Target busy share at start; 1.0 launches every op without delay.
    double initial_share = 1.0;
    // Span over which Stats::achieved_share_window is measured.
    int64_t window_ns = 1'000'000'000;
    // Most busy time a job may bank while idle or under its share and then
    // spend at full speed. It also absorbs oversleeping of real clocks.
    int64_t max_credit_ns = 5'000'000;
    Clock* clock = nullptr;  // nullptr: SystemClock()
  };

  struct Stats {
    int64_t busy_ns;           // union of the time any op of this job ran
    int64_t idle_inserted_ns;  // time ready ops were held back, 0 < share < 1
    int64_t ops_total;         // ops that ran (or were recorded), all paths
    int64_t ops_delayed;       // ops whose launch waited for a slot or a resume
    int64_t ops_queued_now;    // ops waiting in the queue
    int64_t ops_in_flight;     // launched async ops whose done is pending
    double share;              // target share now
    double achieved_share_window;  // busy / wall over the last window_ns
    int64_t window_ns;
    bool paused;               // share == 0
    int64_t op_ns_ewma;        // profiled op execution time (EWMA)
    int64_t credit_ns;         // banked busy time; negative = idle owed
  };

  // "" when valid, else a message naming the bad field and its accepted range.
  static std::string Validate(const Options& options);
  static std::string ValidateShare(double share);

  // Throws std::invalid_argument with Validate()'s message on bad options.
  // Starts one thread that owns the FIFO operator queue.
  explicit OpManager(Options options);
  // Launches every queued op without throttling (even while paused), waits for
  // the done of every launched async op, then joins the thread.
  ~OpManager();

  OpManager(const OpManager&) = delete;
  OpManager& operator=(const OpManager&) = delete;

  // Returns false and keeps the old share when `share` is outside [0, 1].
  // Takes effect for the next launch; 0 pauses at the next op boundary.
  bool SetShare(double share);
  double share() const;

  // The hot path: while true, callers run ops themselves and skip the queue.
  bool unthrottled() const {
    return unthrottled_.load(std::memory_order_relaxed);
  }

  // Queues `op`; the manager thread runs it at its slot and this call returns
  // after it ran (rethrowing what it threw). Called from inside an op that the
  // manager is running, `op` runs inline: queueing it would deadlock.
  void Run(std::function<void()> op);

  // Queues `launch`; at its slot the manager thread calls launch(done) and goes
  // on without waiting for done, which must be called once, from any thread
  // (extra calls are ignored). launch->done counts as busy time, charged to
  // the share when done is called. `launch` must not throw.
  void RunAsync(std::function<void(std::function<void()> done)> launch);

  // Accounts an op that the caller ran on the unthrottled path and timed with
  // NowNs(): it counts as busy time and uses up banked credit.
  void RecordBusy(int64_t start_ns, int64_t end_ns);
  int64_t NowNs() const { return clock_->NowNs(); }

  Stats stats() const;

 private:
  struct Item {
    std::function<void()> op;                                    // sync
    std::function<void(std::function<void()>)> launch;           // async
    std::promise<void>* ran = nullptr;                           // sync only
  };

  void Loop();
  // Nanoseconds the head op must still wait: 0 = launch now.
  int64_t SlotWaitNsLocked() const;
  void LaunchLocked(std::unique_lock<std::mutex>& lock, Item item);
  void OnAsyncDone(int64_t launch_ns);
  // Brings the token bucket up to `now` under the share in force since the
  // last update.
  void AccrueLocked(int64_t now);
  bool BusyLocked() const { return sync_running_ || async_in_flight_ > 0; }
  // Wraps a change of sync_running_/async_in_flight_ to keep the busy union.
  void BusyChangedLocked(bool was_busy, int64_t now);
  // Adds [start, end) to the busy union; returns the ns it added. Intervals
  // must come roughly in time order: one ending before the last is dropped.
  int64_t AddBusyIntervalLocked(int64_t start, int64_t end);
  void ProfileLocked(int64_t op_ns);

  const Options options_;
  Clock* const clock_;
  const int64_t created_ns_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // the manager thread waits here
  std::deque<Item> queue_;
  double share_;
  std::atomic<bool> unthrottled_;
  bool stopping_ = false;

  bool sync_running_ = false;
  int64_t async_in_flight_ = 0;
  int64_t busy_since_ = 0;

  // Token bucket in busy-ns: +share per wall ns, -1 per busy ns, <= max credit.
  double tokens_ = 0.0;
  int64_t tokens_at_ns_;
  // Busy time while only async ops were in flight, charged at their done so a
  // long-waiting async op never holds back the ops it waits for.
  int64_t async_pending_ns_ = 0;

  int64_t busy_ns_ = 0;
  std::deque<std::pair<int64_t, int64_t>> recent_busy_;  // disjoint, sorted
  int64_t idle_inserted_ns_ = 0;
  int64_t ops_total_ = 0;
  int64_t ops_delayed_ = 0;
  bool head_delayed_ = false;
  double op_ns_ewma_ = 0.0;
  bool have_profile_ = false;

  std::thread thread_;
  std::thread::id thread_id_;
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_OP_MANAGER_H_
