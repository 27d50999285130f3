// CUDA event gate: behaviour in cc/core/cuda_gate.h, design in
// docs/op-manager.md ("GPUs: device-timed ops and the CUDA event gate").
// libcuda is opened with dlopen by the loader backend_cuda.cc uses
// (cuda_driver_loader.h), so this builds with g++ and loads on machines without
// a GPU.
#include "cc/core/cuda_gate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "cc/core/c_api_internal.h"
#include "cc/core/cuda_driver_loader.h"
#include "cc/core/cuda_gate_internal.h"

namespace antman {

struct CudaGate::Op {
  void* start = nullptr;
  void* end = nullptr;
  void* stream = nullptr;
  Anchor* anchor = nullptr;
  int64_t provisional_ns = 0;
  bool charge = true;   // Begin: the gate charges the manager; BeginTimed: `done` is told
  bool failed = false;  // an event could not be recorded: charge nothing
  bool captured = false;  // BeginTimed on a capturing stream: no events, done(0, 0)
  int64_t end_host_ns = 0;  // manager's clock when End was called (all launches made)
  CudaGate::Done done;
};

namespace {

constexpr int64_t kMinPollNs = 1'000;
constexpr int64_t kMaxPollNs = 100'000'000;
constexpr int64_t kMinAnchorNs = 1'000'000;
constexpr int64_t kMaxAnchorNs = 60'000'000'000;
// An anchor's sync round trip under this is as good as the clocks allow; above
// it, up to kAnchorTries records are tried and the tightest is kept.
constexpr int64_t kGoodAnchorNs = 10'000;
constexpr int kAnchorTries = 3;
// The launch lag is measured only from an anchor and probes whose record-to-sync round trip is
// at most this: 6.7-9.3 us on an idle H200; a context waiting for its GPU time slice takes ms.
// Tight, because the lag can be wrong by up to half a round trip, next to ~20 us kernels.
constexpr int64_t kTrustedLagRoundTripNs = 12'000;

std::string RangeError(const char* field, int64_t value, int64_t lo, int64_t hi) {
  return std::string(field) + ": " + std::to_string(value) +
         " is outside the accepted range [" + std::to_string(lo) + ", " + std::to_string(hi) +
         "]";
}

}  // namespace

namespace {

void ResolveGateDriver(void* lib, GateDriver* d, std::string* missing) {
  std::string absent;  // newer names an older one stands in for
  ResolvePrimaryContextEntryPoints(lib, d, missing);
  ResolveDriverSymbol(lib, "cuEventCreate", &d->cuEventCreate, missing);
  ResolveDriverSymbol(lib, "cuEventDestroy_v2", &d->cuEventDestroy, missing);
  ResolveDriverSymbol(lib, "cuEventRecord", &d->cuEventRecord, missing);
  ResolveDriverSymbol(lib, "cuEventQuery", &d->cuEventQuery, missing);
  ResolveDriverSymbol(lib, "cuEventSynchronize", &d->cuEventSynchronize, missing);
  // CUDA 12.8+ headers map cuEventElapsedTime to _v2; same signature.
  if (!ResolveDriverSymbol(lib, "cuEventElapsedTime_v2", &d->cuEventElapsedTime, &absent)) {
    ResolveDriverSymbol(lib, "cuEventElapsedTime", &d->cuEventElapsedTime, missing);
  }
  ResolveDriverSymbol(lib, "cuStreamCreate", &d->cuStreamCreate, missing);
  ResolveDriverSymbol(lib, "cuStreamDestroy_v2", &d->cuStreamDestroy, missing);
  // Both since CUDA 10; optional so that an older or partial driver still times ops.
  ResolveDriverSymbol(lib, "cuStreamIsCapturing", &d->cuStreamIsCapturing, &absent);
  ResolveDriverSymbol(lib, "cuThreadExchangeStreamCaptureMode",
                      &d->cuThreadExchangeStreamCaptureMode, &absent);
}

// Puts the calling thread in CU_STREAM_CAPTURE_MODE_RELAXED for its lifetime, then restores the
// thread's mode. cuda.h (cuThreadExchangeStreamCaptureMode): a thread in the default GLOBAL mode
// may not make "potentially unsafe" calls (event queries and synchronisations among them) while
// any thread captures in GLOBAL mode (torch.cuda.graph's default), and such a call invalidates
// that capture; a RELAXED thread may, except on events recorded inside a capture, and the gate
// never records one (Begin skips capturing streams).
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(const GateDriver* d) : d_(d) {
    if (d_->cuThreadExchangeStreamCaptureMode == nullptr) return;
    mode_ = kCuCaptureModeRelaxed;
    swapped_ = d_->cuThreadExchangeStreamCaptureMode(&mode_) == kCuSuccess;
  }
  ~RelaxedCaptureMode() {
    if (swapped_) d_->cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  const GateDriver* const d_;
  int mode_ = 0;
  bool swapped_ = false;
};

constexpr int kCuErrorStreamCaptureImplicit = 906;  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT

}  // namespace

// Loaded once per process, like the memory backend's table (cuda_driver_loader.h).
const GateDriver* LoadGateDriver(std::string* err) {
  return LoadDriverTable<GateDriver>("libcuda.so.1", ResolveGateDriver, err);
}

const GateDriver* LoadGateDriverFrom(const char* library, std::string* err) {
  return LoadDriverTable<GateDriver>(library, ResolveGateDriver, err);
}

std::string ValidateGateConfig(const antman_gate_config& c) {
  if (c.device_ordinal < 0) {
    return "device_ordinal: " + std::to_string(c.device_ordinal) +
           " is outside the accepted range [0, devices visible)";
  }
  if (c.reserved0 != 0) return "reserved0: " + std::to_string(c.reserved0) + " must be 0";
  if (c.poll_interval_ns < kMinPollNs || c.poll_interval_ns > kMaxPollNs) {
    return RangeError("poll_interval_ns", c.poll_interval_ns, kMinPollNs, kMaxPollNs);
  }
  if (c.anchor_interval_ns < kMinAnchorNs || c.anchor_interval_ns > kMaxAnchorNs) {
    return RangeError("anchor_interval_ns", c.anchor_interval_ns, kMinAnchorNs, kMaxAnchorNs);
  }
  return "";
}

HostInterval PlaceOnHostClock(int64_t anchor_ns, float anchor_to_start_ms, float start_to_end_ms,
                              int64_t floor_ns, int64_t now_ns) {
  // Readings are finite floats from the driver; a negative duration is noise.
  const int64_t duration = std::llround(std::max(0.0, double{start_to_end_ms} * 1e6));
  int64_t start = anchor_ns + std::llround(double{anchor_to_start_ms} * 1e6);
  start = std::max(start, floor_ns);
  int64_t end = start + duration;
  if (end > now_ns) {
    // Rounding put the end after the moment it was observed: slide back.
    end = std::max(now_ns, floor_ns);
    start = std::max(floor_ns, end - duration);
  }
  return {start, end};
}

CudaGate::CudaGate(OpManager* manager, const Options& options, const GateDriver* d)
    : manager_(manager), options_(options), d_(d) {}

std::unique_ptr<CudaGate> CudaGate::Create(OpManager* manager, const Options& options,
                                           const GateDriver* driver, std::string* err,
                                           int* code) {
  *code = ANTMAN_ERR_INVALID;
  if (manager == nullptr) {
    *err = "opm: must not be NULL";
    return nullptr;
  }
  antman_gate_config c{};
  c.device_ordinal = options.device_ordinal;
  c.poll_interval_ns = options.poll_interval_ns;
  c.anchor_interval_ns = options.anchor_interval_ns;
  *err = ValidateGateConfig(c);
  if (!err->empty()) return nullptr;
  *code = ANTMAN_ERR_DEVICE;
  if (driver == nullptr) driver = LoadGateDriver(err);
  if (driver == nullptr) return nullptr;
  std::unique_ptr<CudaGate> gate(new CudaGate(manager, options, driver));
  if (!gate->Start(err, code)) return nullptr;
  return gate;
}

std::string CudaGate::DriverError(const char* call, int rc) const {
  const char* text = nullptr;
  if (d_->cuGetErrorString != nullptr) d_->cuGetErrorString(rc, &text);
  return std::string(call) + " failed: CUDA error " + std::to_string(rc) +
         (text != nullptr ? std::string(" (") + text + ")" : "");
}

bool CudaGate::Start(std::string* err, int* code) {
  *code = ANTMAN_ERR_DEVICE;
  int rc = d_->cuInit(0);
  if (rc != kCuSuccess) {
    *err = DriverError("cuInit", rc);
    return false;
  }
  int count = 0;
  rc = d_->cuDeviceGetCount(&count);
  if (rc != kCuSuccess || options_.device_ordinal >= count) {
    *code = rc != kCuSuccess ? ANTMAN_ERR_DEVICE : ANTMAN_ERR_INVALID;
    *err = "device_ordinal: " + std::to_string(options_.device_ordinal) +
           " is outside the accepted range [0, " + std::to_string(count) +
           ") (CUDA devices visible)";
    return false;
  }
  rc = d_->cuDeviceGet(&device_, options_.device_ordinal);
  if (rc != kCuSuccess) {
    *err = DriverError("cuDeviceGet", rc);
    return false;
  }
  rc = d_->cuDevicePrimaryCtxRetain(&ctx_, device_);
  if (rc != kCuSuccess) {
    *err = DriverError("cuDevicePrimaryCtxRetain", rc);
    return false;
  }
  ctx_retained_ = true;
  rc = InContext([&] { return d_->cuStreamCreate(&anchor_stream_, kCuStreamNonBlocking); });
  if (rc != kCuSuccess) {
    *err = DriverError("cuStreamCreate", rc);
    return false;
  }
  if (Reanchor(err) != ANTMAN_OK) return false;
  poller_ = std::thread([this] { PollLoop(); });
  return true;
}

CudaGate::~CudaGate() {
  if (poller_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      work_cv_.notify_all();
    }
    poller_.join();  // after it has charged every queued op
  }
  if (ctx_retained_) {
    InContext([&] {
      std::lock_guard<std::mutex> lock(mu_);
      if (anchor_ != nullptr) free_events_.push_back(anchor_->event);
      delete anchor_;
      anchor_ = nullptr;
      for (void* event : free_events_) d_->cuEventDestroy(event);
      free_events_.clear();
      if (anchor_stream_ != nullptr) d_->cuStreamDestroy(anchor_stream_);
      return kCuSuccess;
    });
    d_->cuDevicePrimaryCtxRelease(device_);
  }
}

template <typename F>
int CudaGate::InContext(F f) {
  ContextScope<GateDriver> scope(d_, ctx_);
  if (scope.rc() != kCuSuccess) return scope.rc();
  return f();
}

void* CudaGate::TakeEventLocked(int* rc) {
  *rc = kCuSuccess;
  if (!free_events_.empty()) {
    void* event = free_events_.back();
    free_events_.pop_back();
    return event;
  }
  void* event = nullptr;
  *rc = d_->cuEventCreate(&event, 0);  // CU_EVENT_DEFAULT: timed
  if (*rc != kCuSuccess) return nullptr;
  ++stats_.events_created;
  return event;
}

CudaGate::Stamp CudaGate::StampAnchorStream() {
  Stamp s;
  int rc = kCuSuccess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.event = TakeEventLocked(&rc);
  }
  if (s.event == nullptr) {
    s.error = DriverError("cuEventCreate", rc);
    return s;
  }
  s.before = manager_->NowNs();
  rc = d_->cuEventRecord(s.event, anchor_stream_);
  s.returned = manager_->NowNs();
  if (rc == kCuSuccess) rc = d_->cuEventSynchronize(s.event);
  s.after = manager_->NowNs();
  if (rc != kCuSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    free_events_.push_back(s.event);
    s.event = nullptr;
    s.error = DriverError("anchor cuEventRecord/cuEventSynchronize", rc);
  }
  return s;
}

std::optional<int64_t> CudaGate::MeasureLaunchLag(void* anchor_event, int64_t anchor_host_ns,
                                                  int64_t round_trip_ns) {
  // Without it, on an idle stream an op was charged from its end call, but its
  // last kernel starts only when the device has taken the launch: on an H200,
  // ~20 us kernels with host work between them were charged ~2 us too much
  // each and got 5-8 points less than their share (bench/gpu/check.py, step
  // compute_short). A probe event is such a launch: its placed time less the
  // host time its record call returned is the lag. The smallest of a few
  // probes (noise only adds); bounded by half the anchor's round trip, as far
  // as its midpoint can be wrong.
  //
  // Trusted only from a tight anchor and tight probes. Next to another
  // process's work (an opportunistic job's case) the GPU time-slices between
  // contexts and these events wait for their context's turn: they are placed
  // off by up to half a time slice, and a lag taken from them moved the floor
  // as far. On the H200 an opportunist held to 5% with one kernel per turn
  // did its share of work without the lag (run 1) and twice it with the lag
  // (run 2; bench/gpu/check.py, step interference): the likely cause, and
  // why such an anchor keeps the floor at the end call, as before.
  if (round_trip_ns > kTrustedLagRoundTripNs) return std::nullopt;
  int64_t best = std::numeric_limits<int64_t>::max();
  InContext([&] {
    for (int attempt = 0; attempt < kAnchorTries; ++attempt) {
      const Stamp probe = StampAnchorStream();
      if (probe.event == nullptr) break;
      float ms = 0.0f;
      const int rc = d_->cuEventElapsedTime(&ms, anchor_event, probe.event);
      {
        std::lock_guard<std::mutex> lock(mu_);
        free_events_.push_back(probe.event);
      }
      if (rc != kCuSuccess || !std::isfinite(ms)) break;
      if (probe.after - probe.returned > kTrustedLagRoundTripNs) continue;  // it waited: no lag
      best = std::min<int64_t>(best,
                               anchor_host_ns + std::llround(double{ms} * 1e6) - probe.returned);
    }
    return kCuSuccess;
  });
  if (best == std::numeric_limits<int64_t>::max()) return std::nullopt;  // no probe to trust
  return std::clamp(best, -round_trip_ns / 2, round_trip_ns / 2);
}

void CudaGate::ReleaseAnchorLocked(Anchor* anchor) {
  if (anchor == nullptr || --anchor->refs > 0) return;
  free_events_.push_back(anchor->event);
  delete anchor;
}

int CudaGate::Reanchor(std::string* err) {
  std::lock_guard<std::mutex> one_at_a_time(reanchor_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (anchor_ != nullptr &&
        manager_->NowNs() - anchor_->host_ns < options_.anchor_interval_ns) {
      return ANTMAN_OK;  // another thread just did it
    }
  }
  void* best = nullptr;
  int64_t best_host = 0;
  int64_t best_round_trip = std::numeric_limits<int64_t>::max();
  std::string failure;
  // The sync below runs on the launching thread, which may be capturing (or another thread may):
  // relaxed, it does not invalidate a capture (the anchor stream itself never captures).
  RelaxedCaptureMode relaxed(d_);
  InContext([&] {
    for (int attempt = 0; attempt < kAnchorTries && best_round_trip > kGoodAnchorNs;
         ++attempt) {
      const Stamp stamp = StampAnchorStream();
      if (stamp.event == nullptr) {
        failure = stamp.error;
        break;
      }
      // The device stamps the event somewhere between `before` and `after`.
      const int64_t round_trip = stamp.after - stamp.before;
      std::lock_guard<std::mutex> lock(mu_);
      if (round_trip < best_round_trip) {
        if (best != nullptr) free_events_.push_back(best);
        best = stamp.event;
        best_round_trip = round_trip;
        best_host = stamp.before + round_trip / 2;
      } else {
        free_events_.push_back(stamp.event);
      }
    }
    return kCuSuccess;
  });
  if (best == nullptr) {
    *err = failure.empty() ? "anchor: no event could be recorded" : failure;
    return ANTMAN_ERR_DEVICE;
  }
  const std::optional<int64_t> measured = MeasureLaunchLag(best, best_host, best_round_trip);
  const int64_t lag = measured.value_or(0);  // untrusted: the floor is the end call, as before
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseAnchorLocked(anchor_);
  anchor_ = new Anchor{best, best_host, lag, 1};
  if (!measured) ++ext_.launch_lag_untrusted;
  ++stats_.anchors;
  stats_.anchor_uncertainty_ns = best_round_trip;
  return ANTMAN_OK;
}

bool CudaGate::Capturing(void* stream) const {
  if (d_->cuStreamIsCapturing == nullptr) return false;
  int status = kCuCaptureStatusNone;
  const int rc = const_cast<CudaGate*>(this)->InContext(
      [&] { return d_->cuStreamIsCapturing(stream, &status); });
  // IMPLICIT: `stream` is the legacy stream while a blocking stream captures; using it now
  // would join that capture. Any other error: the record below reports it as before.
  if (rc == kCuErrorStreamCaptureImplicit) return true;
  return rc == kCuSuccess && status != kCuCaptureStatusNone;
}

int CudaGate::Begin(void* stream, Op** out, std::string* err) {
  *out = nullptr;
  if (manager_->unthrottled()) return ANTMAN_OK;
  // Work captured into a CUDA graph does not run now: nothing to admit or time, and an event
  // recorded here would be a graph node that may never be queried. Replays are not gated.
  if (Capturing(stream)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++ext_.ops_captured;
    return ANTMAN_OK;
  }
  manager_->Admit(OpManager::Timing::kDevice);
  return RecordStart(stream, /*charge=*/true, manager_->Launched(), out, err);
}

int CudaGate::BeginTimed(void* stream, Op** out, std::string* err) {
  *out = nullptr;
  if (Capturing(stream)) {
    // The timing contract wants `done` once per op: it goes through the queue as (0, 0).
    auto* op = new Op;
    op->stream = stream;
    op->charge = false;
    op->failed = true;
    op->captured = true;
    std::lock_guard<std::mutex> lock(mu_);
    ++ext_.ops_captured;
    *out = op;
    return ANTMAN_OK;
  }
  return RecordStart(stream, /*charge=*/false, 0, out, err);
}

int CudaGate::EndTimed(Op* op, Done done, std::string* err) {
  if (op == nullptr) return ANTMAN_OK;
  op->done = std::move(done);
  return End(op, err);
}

int CudaGate::RecordStart(void* stream, bool charge, int64_t provisional, Op** out,
                          std::string* err) {
  bool stale = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stale = manager_->NowNs() - anchor_->host_ns >= options_.anchor_interval_ns;
  }
  // A failed re-anchor keeps the old anchor: placement gets coarser, the
  // charged durations do not (they come from the op's own two events).
  std::string reanchor_error;
  if (stale) Reanchor(&reanchor_error);

  auto* op = new Op;
  op->stream = stream;
  op->provisional_ns = provisional;
  op->charge = charge;
  int create_rc = kCuSuccess;
  const int rc = InContext([&] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      op->start = TakeEventLocked(&create_rc);
      if (op->start != nullptr) op->end = TakeEventLocked(&create_rc);
      if (op->end == nullptr) return create_rc;
      // Taken after any re-anchor above: that anchor completed before this
      // record, so the op's start is never earlier than its anchor.
      op->anchor = anchor_;
      ++anchor_->refs;
    }
    return d_->cuEventRecord(op->start, stream);
  });
  if (rc != kCuSuccess) {
    *err = DriverError(op->end == nullptr ? "cuEventCreate" : "cuEventRecord (start)", rc);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (op->start != nullptr) free_events_.push_back(op->start);
      if (op->end != nullptr) free_events_.push_back(op->end);
      ReleaseAnchorLocked(op->anchor);
    }
    if (!charge) {
      // Timing only: the caller's `done` must still run exactly once, in
      // order, from the poller: the op goes through the queue as a failure.
      op->start = op->end = nullptr;
      op->anchor = nullptr;
      op->failed = true;
      *out = op;
      return ANTMAN_ERR_DEVICE;
    }
    delete op;
    manager_->DeviceDone(provisional, 0, 0);  // nothing will run: return the charge
    return ANTMAN_ERR_DEVICE;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.ops_begun;
  *out = op;
  return ANTMAN_OK;
}

int CudaGate::End(Op* op, std::string* err) {
  if (op == nullptr) return ANTMAN_OK;
  // Every launch of the op has been made by now (the contract of end): from here on, until the
  // end event completes, the stream only has this op's work and what preceded it.
  op->end_host_ns = manager_->NowNs();
  const int rc =
      op->failed ? kCuSuccess : InContext([&] { return d_->cuEventRecord(op->end, op->stream); });
  if (rc != kCuSuccess) {
    op->failed = true;
    *err = DriverError("cuEventRecord (end)", rc);
  }
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(op);
  ++stats_.ops_pending;
  work_cv_.notify_all();
  return rc == kCuSuccess ? ANTMAN_OK : ANTMAN_ERR_DEVICE;
}

void CudaGate::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  drained_cv_.wait(lock, [this] { return queue_.empty(); });
}

antman_gate_stats CudaGate::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

GateExtStats CudaGate::ext_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  GateExtStats e = ext_;
  e.launch_lag_ns = anchor_ != nullptr ? anchor_->lag_ns : 0;  // the current anchor's, not a copy
  return e;
}

void CudaGate::PollLoop() {
  void* pushed = nullptr;
  const bool have_context = d_->cuCtxPushCurrent(ctx_) == kCuSuccess;
  // This thread's event queries must not invalidate a capture another thread runs.
  RelaxedCaptureMode relaxed(d_);
  // Previous op's end per stream, read and written by this thread only.
  std::unordered_map<void*, int64_t> stream_end;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (queue_.empty()) {
      drained_cv_.notify_all();
      if (stopping_) break;
      work_cv_.wait(lock);
      continue;
    }
    Op* op = queue_.front();  // stays put: only this thread pops
    lock.unlock();
    int rc = op->failed ? kCuErrorNotReady + 1 : d_->cuEventQuery(op->end);
    if (rc == kCuErrorNotReady) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(options_.poll_interval_ns));
      lock.lock();
      continue;
    }
    int64_t busy = 0;
    int64_t host_gap = 0;
    bool charged = false;
    if (rc == kCuSuccess) {
      float start_to_end = 0.0f;
      float anchor_to_start = 0.0f;
      rc = d_->cuEventElapsedTime(&start_to_end, op->start, op->end);
      if (rc == kCuSuccess) {
        rc = d_->cuEventElapsedTime(&anchor_to_start, op->anchor->event, op->start);
      }
      if (rc == kCuSuccess && std::isfinite(start_to_end) && std::isfinite(anchor_to_start)) {
        auto floor_it = stream_end.find(op->stream);
        const int64_t floor_ns = floor_it == stream_end.end() ? 0 : floor_it->second;
        HostInterval iv = PlaceOnHostClock(op->anchor->host_ns, anchor_to_start, start_to_end,
                                           floor_ns, manager_->NowNs());
        // Device time only. The start event completes when the stream's earlier work has; on
        // an idle stream that is at begin, before the op's host work (argument handling, host
        // allocations, a synchronising free) and its launches. Until end was called the
        // stream may have idled waiting for those launches, so that span is not charged: from
        // max(start, end call) to the end event the stream holds only this op's queued work
        // (streams run in order). Exact when the device is behind the host (GPU-bound
        // work); otherwise it undercounts kernels that completed before end was called,
        // never charges host time. docs/op-manager.md, "What the gate charges".
        // The floor is the end call plus the launch lag: the op's last kernel cannot have
        // started before the device took its launch (an anchor-placed time, like iv).
        const int64_t kernel_floor = op->end_host_ns + op->anchor->lag_ns;
        if (kernel_floor > iv.start_ns) {
          const int64_t clip = std::min(kernel_floor, iv.end_ns);
          host_gap += clip - iv.start_ns;
          iv.start_ns = clip;
        }
        stream_end[op->stream] = iv.end_ns;
        if (op->charge) {
          manager_->DeviceDone(op->provisional_ns, iv.start_ns, iv.end_ns);
        } else if (op->done) {
          op->done(iv.start_ns, iv.end_ns);
        }
        if (options_.on_charged) options_.on_charged(iv.start_ns, iv.end_ns);
        busy = iv.end_ns - iv.start_ns;
        charged = true;
      }
    }
    // The op failed on the device or its events could not be read: nothing
    // is known of its device time, so its provisional charge is returned.
    if (!charged && op->charge) manager_->DeviceDone(op->provisional_ns, 0, 0);
    if (!charged && !op->charge && op->done) op->done(0, 0);
    lock.lock();
    queue_.pop_front();
    if (op->start != nullptr) free_events_.push_back(op->start);
    if (op->end != nullptr) free_events_.push_back(op->end);
    ReleaseAnchorLocked(op->anchor);
    const bool captured = op->captured;
    delete op;
    --stats_.ops_pending;
    if (charged) {
      ++stats_.ops_completed;
      stats_.device_busy_ns += busy;
      ext_.host_gap_ns += host_gap;
    } else if (!captured) {
      ++stats_.errors;
    }
  }
  lock.unlock();
  if (have_context) d_->cuCtxPopCurrent(&pushed);
}

}  // namespace antman

struct antman_gate {
  std::unique_ptr<antman::CudaGate> gate;
};

namespace {

int NullGate() { return antman::SetLastError(ANTMAN_ERR_INVALID, "gate: must not be NULL"); }

}  // namespace

extern "C" {

void antman_gate_default_config(antman_gate_config* out) {
  if (out == nullptr) return;
  antman::CudaGate::Options d;
  *out = antman_gate_config{};
  out->device_ordinal = d.device_ordinal;
  out->poll_interval_ns = d.poll_interval_ns;
  out->anchor_interval_ns = d.anchor_interval_ns;
}

int antman_gate_create(antman_opm* opm, const antman_gate_config* config, antman_gate** out,
                       char* err, size_t errlen) {
  auto fail = [&](int code, const std::string& message) {
    antman::CopyError(err, errlen, message);
    return antman::SetLastError(code, message);
  };
  if (out == nullptr) return fail(ANTMAN_ERR_INVALID, "out: must not be NULL");
  *out = nullptr;
  if (opm == nullptr) return fail(ANTMAN_ERR_INVALID, "opm: must not be NULL");
  if (config == nullptr) return fail(ANTMAN_ERR_INVALID, "config: must not be NULL");
  const std::string invalid = antman::ValidateGateConfig(*config);
  if (!invalid.empty()) return fail(ANTMAN_ERR_INVALID, invalid);
  antman::CudaGate::Options options;
  options.device_ordinal = config->device_ordinal;
  options.poll_interval_ns = config->poll_interval_ns;
  options.anchor_interval_ns = config->anchor_interval_ns;
  std::string why;
  int code = ANTMAN_ERR_DEVICE;
  auto gate = antman::CudaGate::Create(opm->manager.get(), options, nullptr, &why, &code);
  if (gate == nullptr) return fail(code, why);
  *out = new antman_gate{std::move(gate)};
  return ANTMAN_OK;
}

void antman_gate_destroy(antman_gate* gate) { delete gate; }

int antman_gate_begin(antman_gate* gate, void* stream, antman_gate_op** op) {
  if (gate == nullptr) return NullGate();
  if (op == nullptr) return antman::SetLastError(ANTMAN_ERR_INVALID, "op: must not be NULL");
  antman::CudaGate::Op* raw = nullptr;
  std::string why;
  const int rc = gate->gate->Begin(stream, &raw, &why);
  *op = reinterpret_cast<antman_gate_op*>(raw);  // opaque to C
  return rc == ANTMAN_OK ? rc : antman::SetLastError(rc, why);
}

int antman_gate_end(antman_gate* gate, antman_gate_op* op) {
  if (gate == nullptr) return NullGate();
  std::string why;
  const int rc = gate->gate->End(reinterpret_cast<antman::CudaGate::Op*>(op), &why);
  return rc == ANTMAN_OK ? rc : antman::SetLastError(rc, why);
}

int antman_gate_drain(antman_gate* gate) {
  if (gate == nullptr) return NullGate();
  gate->gate->Drain();
  return ANTMAN_OK;
}

int antman_gate_get_stats(antman_gate* gate, antman_gate_stats* out) {
  if (gate == nullptr) return NullGate();
  if (out == nullptr) return antman::SetLastError(ANTMAN_ERR_INVALID, "out: must not be NULL");
  *out = gate->gate->stats();
  return ANTMAN_OK;
}

size_t antman_gate_get_ext_stats(antman_gate* gate, antman_gate_ext_stats* out, size_t size) {
  if (gate == nullptr || out == nullptr) return 0;
  const antman::GateExtStats e = gate->gate->ext_stats();
  antman_gate_ext_stats s{};
  s.ops_captured = e.ops_captured;
  s.host_gap_ns = e.host_gap_ns;
  s.launch_lag_ns = e.launch_lag_ns;
  s.launch_lag_untrusted = e.launch_lag_untrusted;
  const size_t n = std::min(size, sizeof(s));
  std::memcpy(out, &s, n);
  return n;
}

}  // extern "C"
