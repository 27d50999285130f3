#include "cc/core/op_manager.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
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
};

// Weight of the newest sample in the op-time profile: about the last 8 ops.
constexpr double kProfileWeight = 0.125;
// Debt below one nanosecond is rounding, not a reason to sleep.
constexpr double kTokenSlackNs = 1.0;

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
      tokens_at_ns_(created_ns_) {
  thread_ = std::thread([this] { Loop(); });
  thread_id_ = thread_.get_id();
}

OpManager::~OpManager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

bool OpManager::SetShare(double share) {
  if (!ValidateShare(share).empty()) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Time so far accrued under the old share.
    AccrueLocked(clock_->NowNs());
    share_ = share;
    unthrottled_.store(share >= 1.0, std::memory_order_relaxed);
    cv_.notify_all();
  }
  return true;
}

double OpManager::share() const {
  std::lock_guard<std::mutex> lock(mu_);
  return share_;
}

void OpManager::Run(std::function<void()> op) {
  if (std::this_thread::get_id() == thread_id_) {
    op();
    return;
  }
  std::promise<void> ran;
  std::future<void> ran_future = ran.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Item item;
    item.op = std::move(op);
    item.ran = &ran;
    queue_.push_back(std::move(item));
    cv_.notify_all();
  }
  ran_future.get();  // rethrows the op's exception
}

void OpManager::RunAsync(std::function<void(std::function<void()>)> launch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Item item;
    item.launch = std::move(launch);
    queue_.push_back(std::move(item));
    cv_.notify_all();
  }
}

void OpManager::RecordBusy(int64_t start_ns, int64_t end_ns) {
  if (end_ns < start_ns) return;
  std::lock_guard<std::mutex> lock(mu_);
  AccrueLocked(clock_->NowNs());
  // The accrual above counted this span as idle; take back what it added to
  // the busy union (ops run in parallel on the caller's threads overlap).
  tokens_ -= static_cast<double>(AddBusyIntervalLocked(start_ns, end_ns));
  ProfileLocked(end_ns - start_ns);
  ++ops_total_;
}

void OpManager::AccrueLocked(int64_t now) {
  int64_t dt = now - tokens_at_ns_;
  if (dt <= 0) return;
  tokens_at_ns_ = now;
  double wall = static_cast<double>(dt);
  if (sync_running_) {
    tokens_ += wall * (share_ - 1.0);
  } else {
    tokens_ += wall * share_;
    if (async_in_flight_ > 0) async_pending_ns_ += dt;
  }
  // The cap bounds the balance as if the pending charge were already paid.
  tokens_ = std::min(tokens_, static_cast<double>(options_.max_credit_ns +
                                                  async_pending_ns_));
}

int64_t OpManager::SlotWaitNsLocked() const {
  if (stopping_ || share_ >= 1.0) return 0;
  if (share_ <= 0.0) return Clock::kForever;
  if (tokens_ > -kTokenSlackNs) return 0;
  // Idle accrues `share` tokens per ns; only idle time is known to follow.
  // Tiny shares give huge waits: past ~3 years, wait for a share change.
  double wait = std::ceil(-tokens_ / share_);
  return wait < 1e17 ? static_cast<int64_t>(wait) : Clock::kForever;
}

void OpManager::BusyChangedLocked(bool was_busy, int64_t now) {
  bool busy = BusyLocked();
  if (!was_busy && busy) busy_since_ = now;
  if (was_busy && !busy) AddBusyIntervalLocked(busy_since_, now);
}

int64_t OpManager::AddBusyIntervalLocked(int64_t start, int64_t end) {
  if (!recent_busy_.empty()) start = std::max(start, recent_busy_.back().second);
  if (end <= start) return 0;
  busy_ns_ += end - start;
  if (!recent_busy_.empty() && recent_busy_.back().second == start) {
    recent_busy_.back().second = end;
  } else {
    recent_busy_.emplace_back(start, end);
  }
  while (!recent_busy_.empty() &&
         recent_busy_.front().second <= end - options_.window_ns) {
    recent_busy_.pop_front();
  }
  return end - start;
}

void OpManager::ProfileLocked(int64_t op_ns) {
  double sample = static_cast<double>(op_ns);
  op_ns_ewma_ = have_profile_
                    ? op_ns_ewma_ + kProfileWeight * (sample - op_ns_ewma_)
                    : sample;
  have_profile_ = true;
}

void OpManager::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (queue_.empty()) {
      if (stopping_) break;
      clock_->WaitUntil(lock, cv_, Clock::kForever);
      continue;
    }
    int64_t now = clock_->NowNs();
    AccrueLocked(now);
    int64_t wait = SlotWaitNsLocked();
    if (wait > 0) {
      head_delayed_ = true;
      bool throttling = share_ > 0.0;
      int64_t deadline = wait == Clock::kForever ? wait : now + wait;
      clock_->WaitUntil(lock, cv_, deadline);
      if (throttling) idle_inserted_ns_ += clock_->NowNs() - now;
      continue;
    }
    if (head_delayed_) {
      ++ops_delayed_;
      head_delayed_ = false;
    }
    Item item = std::move(queue_.front());
    queue_.pop_front();
    LaunchLocked(lock, std::move(item));
  }
  // Launched async ops still refer to this manager through their done.
  while (async_in_flight_ > 0) clock_->WaitUntil(lock, cv_, Clock::kForever);
}

void OpManager::LaunchLocked(std::unique_lock<std::mutex>& lock, Item item) {
  int64_t start = clock_->NowNs();
  AccrueLocked(start);
  bool was_busy = BusyLocked();
  if (item.launch) {
    ++async_in_flight_;
    BusyChangedLocked(was_busy, start);
    auto called = std::make_shared<std::atomic<bool>>(false);
    std::function<void()> done = [this, start, called] {
      if (!called->exchange(true)) OnAsyncDone(start);
    };
    lock.unlock();
    item.launch(std::move(done));
    lock.lock();
    return;
  }
  sync_running_ = true;
  BusyChangedLocked(was_busy, start);
  lock.unlock();
  std::exception_ptr error;
  try {
    item.op();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  int64_t end = clock_->NowNs();
  AccrueLocked(end);
  was_busy = BusyLocked();
  sync_running_ = false;
  BusyChangedLocked(was_busy, end);
  ProfileLocked(end - start);
  ++ops_total_;
  if (error) {
    item.ran->set_exception(error);
  } else {
    item.ran->set_value();
  }
}

void OpManager::OnAsyncDone(int64_t launch_ns) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t now = clock_->NowNs();
    AccrueLocked(now);
    bool was_busy = BusyLocked();
    --async_in_flight_;
    BusyChangedLocked(was_busy, now);
    // Async-only busy time so far is charged now; sync time that overlapped
    // it was charged as it ran, so the charge is the busy union.
    tokens_ -= static_cast<double>(async_pending_ns_);
    async_pending_ns_ = 0;
    ProfileLocked(now - launch_ns);
    ++ops_total_;
    // Under the lock: once it is released the destructor may finish.
    cv_.notify_all();
  }
}

OpManager::Stats OpManager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_->NowNs();
  int64_t window_start = now - options_.window_ns;
  int64_t open_busy = BusyLocked() ? now - busy_since_ : 0;
  int64_t in_window = 0;
  for (auto it = recent_busy_.rbegin(); it != recent_busy_.rend(); ++it) {
    if (it->second <= window_start) break;
    in_window += std::min(it->second, now) - std::max(it->first, window_start);
  }
  if (open_busy > 0) in_window += now - std::max(busy_since_, window_start);
  int64_t span = std::min(options_.window_ns, now - created_ns_);

  Stats s;
  s.busy_ns = busy_ns_ + open_busy;
  s.idle_inserted_ns = idle_inserted_ns_;
  s.ops_total = ops_total_;
  s.ops_delayed = ops_delayed_;
  s.ops_queued_now = static_cast<int64_t>(queue_.size());
  s.ops_in_flight = async_in_flight_;
  s.share = share_;
  s.achieved_share_window =
      span > 0 ? static_cast<double>(in_window) / static_cast<double>(span)
               : 0.0;
  s.window_ns = options_.window_ns;
  s.paused = share_ <= 0.0;
  s.op_ns_ewma = static_cast<int64_t>(op_ns_ewma_);
  // What the bucket holds as of now, without mutating it from a const method.
  // Async-only busy time not charged yet counts as already charged here.
  double tokens = tokens_;
  int64_t pending = async_pending_ns_;
  int64_t dt = now - tokens_at_ns_;
  if (dt > 0) {
    tokens += static_cast<double>(dt) * (sync_running_ ? share_ - 1.0 : share_);
    if (!sync_running_ && async_in_flight_ > 0) pending += dt;
    tokens = std::min(tokens,
                      static_cast<double>(options_.max_credit_ns + pending));
  }
  s.credit_ns = static_cast<int64_t>(tokens) - pending;
  return s;
}

}  // namespace antman
