#include "cc/core/op_manager.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace antman {
namespace {

class SteadyClock final : public Clock {
 public:
  int64_t NowNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void WaitUntil(std::unique_lock<std::mutex>& lock,
                 std::condition_variable& cv, int64_t deadline_ns) override {
    if (deadline_ns == kForever) {
      cv.wait(lock);
      return;
    }
    cv.wait_until(lock, std::chrono::steady_clock::time_point(
                            std::chrono::nanoseconds(deadline_ns)));
  }
  int64_t ThreadCpuNs() const override {
    timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
    return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
  }
};

// Weight of the newest sample in the op-time profile: about the last 8 ops.
constexpr double kProfileWeight = 0.125;
// Debt below one nanosecond is rounding, not a reason to sleep.
constexpr double kTokenSlackNs = 1.0;

// The manager whose host-timed op this thread is running (ScopedOp), if any.
thread_local const OpManager* tl_current_op_manager = nullptr;

}  // namespace

Clock* SystemClock() {
  static SteadyClock* clock = new SteadyClock();
  return clock;
}

std::string OpManager::ValidateShare(double share) {
  if (std::isnan(share) || share < 0.0 || share > 1.0) {
    std::ostringstream msg;
    msg << "share: " << share << " is outside the accepted range [0, 1]";
    return msg.str();
  }
  return "";
}

std::string OpManager::Validate(const Options& options) {
  std::string share_error = ValidateShare(options.initial_share);
  if (!share_error.empty()) return "initial_" + share_error;
  if (options.window_ns <= 0) {
    return "window_ns: " + std::to_string(options.window_ns) +
           " is outside the accepted range (0, 2^63)";
  }
  if (options.max_credit_ns < 0) {
    return "max_credit_ns: " + std::to_string(options.max_credit_ns) +
           " is outside the accepted range [0, 2^63)";
  }
  if (options.max_pending_device_ops < 1) {
    return "max_pending_device_ops: " +
           std::to_string(options.max_pending_device_ops) +
           " is outside the accepted range [1, 2^63)";
  }
  if (options.device_burst_ns < 0 || options.device_burst_ns > 1'000'000'000) {
    return "device_burst_ns: " + std::to_string(options.device_burst_ns) +
           " is outside the accepted range [0, 1e9]";
  }
  if (options.bridge_gap_ns < 0 || options.bridge_gap_ns > 1'000'000'000) {
    return "bridge_gap_ns: " + std::to_string(options.bridge_gap_ns) +
           " is outside the accepted range [0, 1e9]";
  }
  return "";
}

static const OpManager::Options& Checked(const OpManager::Options& options) {
  std::string error = OpManager::Validate(options);
  if (!error.empty()) throw std::invalid_argument("OpManager: " + error);
  return options;
}

OpManager::OpManager(Options options)
    : options_(Checked(options)),
      clock_(options.clock != nullptr ? options.clock : SystemClock()),
      created_ns_(clock_->NowNs()),
      share_(options.initial_share),
      unthrottled_(options.initial_share >= 1.0),
      throttled_since_(created_ns_),
      tokens_at_ns_(created_ns_),
      last_busy_end_ns_(created_ns_),
      last_release_ns_(created_ns_) {}

OpManager::~OpManager() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  cv_.notify_all();
  // Waiters reference this object until they leave Admit().
  while (waiting_ > 0) clock_->WaitUntil(lock, cv_, Clock::kForever);
}

bool OpManager::SetShare(double share) {
  if (!ValidateShare(share).empty()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_->NowNs();
  // Time so far accrued under the old share.
  AccrueLocked(now);
  if (share_ >= 1.0 && share < 1.0) throttled_since_ = now;
  share_ = share;
  unthrottled_.store(share >= 1.0, std::memory_order_relaxed);
  cv_.notify_all();
  return true;
}

double OpManager::share() const {
  std::lock_guard<std::mutex> lock(mu_);
  return share_;
}

int64_t OpManager::Admit(Timing timing) {
  if (timing == Timing::kHost && tl_current_op_manager == this) return kNested;
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  int64_t requested_ns = -1;  // the first reading of the clock below
  int64_t cpu_before_wait = -1;  // the thread's CPU time before its first wait
  ++waiting_;
  bool delayed = false;
  void* lent = nullptr;
  bool lending = false;
  for (;;) {
    int64_t now = clock_->NowNs();
    if (requested_ns < 0) requested_ns = now;
    int64_t wait = Clock::kForever;  // not at the head: woken when the line moves
    if (ticket == serving_ticket_) {
      AccrueLocked(now);
      wait = SlotWaitNsLocked(timing);
      if (wait == 0) {
        if (timing == Timing::kDevice) refilling_ = false;
        break;
      }
    }
    if (!lending && options_.blocking_hooks != nullptr) {
      // Lend what this thread holds before waiting, never while holding mu_:
      // taking the GIL back under mu_ could wait for a thread that waits for mu_.
      lock.unlock();
      lent = options_.blocking_hooks->BeforeBlock();
      lending = true;
      lock.lock();
      continue;  // the world may have moved while unlocked
    }
    delayed = true;
    // Only a wait for tokens at the head is inserted idle; a pause or a full
    // pending window is not throttling in that sense.
    bool for_tokens = ticket == serving_ticket_ && share_ > 0.0 &&
                      !(timing == Timing::kDevice &&
                        device_pending_ >= options_.max_pending_device_ops);
    if (for_tokens && timing == Timing::kDevice && options_.device_burst_ns > 0) {
      refilling_ = true;  // the next turn starts with a whole burst banked
    }
    if (timing == Timing::kHost && cpu_before_wait < 0) cpu_before_wait = clock_->ThreadCpuNs();
    clock_->WaitUntil(lock, cv_, wait == Clock::kForever ? wait : now + wait);
    if (for_tokens) idle_inserted_ns_ += clock_->NowNs() - now;
  }
  // What the thread itself spent in the waits (futex calls, timer, the
  // scheduler waking it: about 20 us a wait on the development VM, where a
  // throttled job waits hundreds of times a second). Not lending the GIL back,
  // which comes after. On the emulated device the thread's CPU is the device:
  // uncharged, it let a job use 1-3% of its share more than asked.
  int64_t wait_cpu_ns =
      cpu_before_wait < 0 ? 0 : std::max<int64_t>(0, clock_->ThreadCpuNs() - cpu_before_wait);
  ++serving_ticket_;
  if (delayed) ++ops_delayed_;
  cv_.notify_all();  // the next in line
  if (lending) {
    // The op starts once the thread has what it lent back: that wait is not
    // the op's busy time.
    lock.unlock();
    options_.blocking_hooks->AfterBlock(lent);
    lock.lock();
  }
  int64_t now = clock_->NowNs();
  if (delayed) {
    // The thread's work from the job's last busy time to this request (the
    // executor preparing this op) came before the wait: it is the job's, as a
    // bridged gap is. Without this, every delayed op left that work uncharged.
    int64_t gap_from = std::max(last_busy_end_ns_, last_release_ns_);
    if (timing == Timing::kHost && gap_from < requested_ns &&
        requested_ns - gap_from <= options_.bridge_gap_ns) {
      AccrueLocked(now);
      tokens_ -= static_cast<double>(ChargeIntervalLocked(gap_from, requested_ns));
    }
    if (wait_cpu_ns > 0) {
      // Charged as busy time just before the op starts, where the wake-up was.
      AccrueLocked(now);
      tokens_ -= static_cast<double>(ChargeIntervalLocked(now - wait_cpu_ns, now));
    }
    last_release_ns_ = std::max(last_release_ns_, now);
  }
  if (timing == Timing::kHost) running_starts_.insert(now);
  // A device op holds its pending slot from here, under the same lock as the
  // check above: taken at Launched(), every thread admitted before the first
  // launch got past the bound.
  if (timing == Timing::kDevice) ++device_pending_;
  --waiting_;
  if (stopping_) cv_.notify_all();  // a destructor waits for the last waiter
  return now;
}

void OpManager::Finish(int64_t admitted_ns) {
  if (admitted_ns == kNested) return;
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_->NowNs();
  AccrueLocked(now);
  auto it = running_starts_.find(admitted_ns);
  if (it == running_starts_.end()) return;  // unmatched Finish: a caller bug, ignored
  running_starts_.erase(it);
  int64_t from = admitted_ns;
  int64_t gap_from = std::max(last_busy_end_ns_, last_release_ns_);
  if (gap_from < from && from - gap_from <= options_.bridge_gap_ns) from = gap_from;
  tokens_ -= static_cast<double>(ChargeIntervalLocked(from, now));
  ProfileLocked(now - admitted_ns);
  ++ops_total_;
  PruneLocked(now);
}

int64_t OpManager::Launched() {
  std::lock_guard<std::mutex> lock(mu_);
  AccrueLocked(clock_->NowNs());
  int64_t estimate = have_profile_ ? EwmaNsLocked() : 0;
  tokens_ -= static_cast<double>(estimate);
  return estimate;  // the op's pending slot was taken at its admission
}

void OpManager::DeviceDone(int64_t provisional_ns, int64_t start_ns,
                           int64_t end_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  AccrueLocked(clock_->NowNs());
  tokens_ += static_cast<double>(provisional_ns);
  if (end_ns > start_ns) {
    tokens_ -= static_cast<double>(ChargeIntervalLocked(start_ns, end_ns));
    ProfileLocked(end_ns - start_ns);
  }
  if (device_pending_ > 0) --device_pending_;
  ++ops_total_;
  PruneLocked(end_ns);
  cv_.notify_all();  // a caller may wait for the pending window
}

void OpManager::AccrueLocked(int64_t now) {
  int64_t dt = now - tokens_at_ns_;
  if (dt <= 0) return;
  tokens_at_ns_ = now;
  tokens_ += static_cast<double>(dt) * share_;
  // The cap bounds the balance as if busy time not charged yet were paid.
  tokens_ = std::min(tokens_, CreditCapLocked(now));
}

int64_t OpManager::SlotWaitNsLocked(Timing timing) const {
  if (stopping_ || share_ >= 1.0) return 0;
  if (share_ <= 0.0) return Clock::kForever;
  if (timing == Timing::kDevice &&
      device_pending_ >= options_.max_pending_device_ops) {
    return Clock::kForever;  // woken by DeviceDone
  }
  // Out of tokens, a device-timed job refills a whole burst before its next turn.
  const bool refill = timing == Timing::kDevice && refilling_;
  // The bank holds at most max_credit_ns: a longer burst is that long.
  const double goal =
      refill ? static_cast<double>(std::min(options_.device_burst_ns, options_.max_credit_ns))
             : 0.0;
  if (refill ? tokens_ >= goal : tokens_ > -kTokenSlackNs) return 0;
  // Idle accrues `share` tokens per ns; only idle time is known to follow.
  // Tiny shares give huge waits: past ~3 years, wait for a share change.
  double wait = std::ceil((goal - tokens_) / share_);
  return wait < 1e17 ? static_cast<int64_t>(wait) : Clock::kForever;
}

double OpManager::CreditCapLocked(int64_t now) const {
  // In double: max_credit_ns may be up to 2^63 - 1 ("no cap"), and the int64
  // sum with the uncharged time would wrap to a debt no admission outlives.
  return static_cast<double>(options_.max_credit_ns) +
         static_cast<double>(UnchargedLocked(now));
}

int64_t OpManager::UnchargedLocked(int64_t now) const {
  return running_starts_.empty() ? 0 : now - *running_starts_.begin();
}

int64_t OpManager::ChargeIntervalLocked(int64_t start, int64_t end) {
  if (end <= start) return 0;
  // Merge [start, end) with every interval it touches: what it adds to the
  // union is the merged length minus the lengths merged into it.
  int64_t already = 0;
  auto it = busy_intervals_.upper_bound(start);
  if (it != busy_intervals_.begin() && std::prev(it)->second >= start) --it;
  while (it != busy_intervals_.end() && it->first <= end) {
    already += it->second - it->first;
    start = std::min(start, it->first);
    end = std::max(end, it->second);
    it = busy_intervals_.erase(it);
  }
  busy_intervals_.emplace(start, end);
  last_busy_end_ns_ = std::max(last_busy_end_ns_, end);
  int64_t added = (end - start) - already;
  busy_ns_ += added;
  return added;
}

void OpManager::PruneLocked(int64_t now) {
  int64_t horizon = now - options_.window_ns;
  if (!running_starts_.empty()) horizon = std::min(horizon, *running_starts_.begin());
  while (!busy_intervals_.empty() && busy_intervals_.begin()->second < horizon) {
    busy_intervals_.erase(busy_intervals_.begin());
  }
}

int64_t OpManager::EwmaNsLocked() const {
  // 2^63 itself is not an int64: a sample near it would convert to INT64_MIN.
  return static_cast<int64_t>(std::min(op_ns_ewma_, 9.0e18));
}

void OpManager::ProfileLocked(int64_t op_ns) {
  double sample = static_cast<double>(op_ns);
  op_ns_ewma_ = have_profile_
                    ? op_ns_ewma_ + kProfileWeight * (sample - op_ns_ewma_)
                    : sample;
  have_profile_ = true;
}

OpManager::Stats OpManager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_->NowNs();
  // The window covers only time spent throttled: at share 1 ops are not timed.
  int64_t window_start = std::max(now - options_.window_ns, throttled_since_);
  int64_t in_window = 0;
  for (auto it = busy_intervals_.rbegin(); it != busy_intervals_.rend(); ++it) {
    if (it->second <= window_start) break;
    in_window += std::min(it->second, now) - std::max(it->first, window_start);
  }
  int64_t span = now - window_start;

  Stats s;
  s.busy_ns = busy_ns_;
  s.idle_inserted_ns = idle_inserted_ns_;
  s.ops_total = ops_total_;
  s.ops_delayed = ops_delayed_;
  s.ops_waiting_now = waiting_;
  s.ops_in_flight = static_cast<int64_t>(running_starts_.size()) + device_pending_;
  s.share = share_;
  s.achieved_share_window =
      span > 0 ? static_cast<double>(in_window) / static_cast<double>(span)
               : 0.0;
  s.window_ns = options_.window_ns;
  s.paused = share_ <= 0.0;
  s.op_ns_ewma = EwmaNsLocked();
  // What the bucket holds as of now, without mutating it from a const method.
  double tokens = tokens_;
  int64_t uncharged = UnchargedLocked(now);
  int64_t dt = now - tokens_at_ns_;
  if (dt > 0) {
    tokens += static_cast<double>(dt) * share_;
    tokens = std::min(tokens, CreditCapLocked(now));
  }
  s.credit_ns = static_cast<int64_t>(tokens) - uncharged;
  return s;
}

OpManager::ScopedOp::ScopedOp(OpManager& manager)
    : manager_(manager),
      admitted_ns_(manager.Admit(Timing::kHost)),
      outer_(tl_current_op_manager) {
  tl_current_op_manager = &manager;
}

OpManager::ScopedOp::~ScopedOp() {
  tl_current_op_manager = outer_;
  manager_.Finish(admitted_ns_);
}

}  // namespace antman
