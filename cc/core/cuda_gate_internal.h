// C++ side of the CUDA event gate (C API and behaviour: cc/core/cuda_gate.h).
// Exposed for the framework glue and for tests: the driver is a table of
// function pointers, so tests run the gate against a fake driver without a GPU.
#ifndef TF_ANTMAN_CC_CORE_CUDA_GATE_INTERNAL_H_
#define TF_ANTMAN_CC_CORE_CUDA_GATE_INTERNAL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cc/core/cuda_gate.h"
#include "cc/core/op_manager.h"

namespace antman {

// The driver entry points the gate uses, with the driver's ABI: CUresult is an
// int, CUdevice an int, every handle a pointer. Opaque handles are void* here.
struct GateDriver {
  int (*cuInit)(unsigned int flags);
  int (*cuDeviceGetCount)(int* count);
  int (*cuDeviceGet)(int* device, int ordinal);
  int (*cuDevicePrimaryCtxRetain)(void** ctx, int device);
  int (*cuDevicePrimaryCtxRelease)(int device);
  int (*cuCtxGetCurrent)(void** ctx);
  int (*cuCtxPushCurrent)(void* ctx);
  int (*cuCtxPopCurrent)(void** ctx);
  int (*cuEventCreate)(void** event, unsigned int flags);
  int (*cuEventDestroy)(void* event);
  int (*cuEventRecord)(void* event, void* stream);
  int (*cuEventQuery)(void* event);
  int (*cuEventSynchronize)(void* event);
  int (*cuEventElapsedTime)(float* ms, void* start, void* end);
  int (*cuStreamCreate)(void** stream, unsigned int flags);
  int (*cuStreamDestroy)(void* stream);
  int (*cuGetErrorString)(int result, const char** text);  // may be null
  // Optional (null: streams are taken as never capturing, the thread's capture
  // mode is left alone). Appended: tables built by tests leave them null.
  int (*cuStreamIsCapturing)(void* stream, int* status);
  int (*cuThreadExchangeStreamCaptureMode)(int* mode);
};

constexpr int kCuSuccess = 0;
constexpr int kCuErrorNotReady = 600;     // CUDA_ERROR_NOT_READY
constexpr unsigned kCuStreamNonBlocking = 1;  // CU_STREAM_NON_BLOCKING
constexpr int kCuCaptureStatusNone = 0;       // CU_STREAM_CAPTURE_STATUS_NONE
constexpr int kCuCaptureModeRelaxed = 2;      // CU_STREAM_CAPTURE_MODE_RELAXED

// libcuda.so.1 through dlopen, once per process; nullptr and *err if absent.
const GateDriver* LoadGateDriver(std::string* err);
// The same from another path (tests load the fake driver, cc/core/testdata).
const GateDriver* LoadGateDriverFrom(const char* library, std::string* err);

// Extra figures (cuda_gate.h, antman_gate_ext_stats).
struct GateExtStats {
  int64_t ops_captured = 0;    // begin calls on a capturing stream: passed, uncharged
  int64_t host_gap_ns = 0;     // [start event, end call) time not charged (host work)
  int64_t launch_lag_ns = 0;   // the current anchor's launch lag (filled by ext_stats())
  int64_t launch_lag_untrusted = 0;  // anchors whose lag was not trusted (taken as 0)
};

// "" if valid, else the bad field and its accepted range.
std::string ValidateGateConfig(const antman_gate_config& config);

// An op's interval on the manager's clock, from event readings.
struct HostInterval {
  int64_t start_ns;
  int64_t end_ns;
};
// anchor_ns: host time of the anchor event; anchor_to_start_ms and
// start_to_end_ms: cuEventElapsedTime readings; floor_ns: end of the previous
// op on the same stream (a stream runs its ops one after another, so rounding
// must not make them overlap); now_ns: the time the completion was seen (the
// kernel cannot have ended later). The duration is kept whole where it can be.
HostInterval PlaceOnHostClock(int64_t anchor_ns, float anchor_to_start_ms,
                              float start_to_end_ms, int64_t floor_ns,
                              int64_t now_ns);

class CudaGate {
 public:
  struct Options {
    int device_ordinal = 0;
    int64_t poll_interval_ns = 20'000;
    int64_t anchor_interval_ns = 1'000'000'000;
    // Called by the poller with each interval charged (diagnostics, tests).
    std::function<void(int64_t start_ns, int64_t end_ns)> on_charged;
  };
  struct Op;

  // nullptr and *err (field or driver failure) on failure; *code gets the
  // ANTMAN_ERR_* class of the failure.
  static std::unique_ptr<CudaGate> Create(OpManager* manager,
                                          const Options& options,
                                          const GateDriver* driver,
                                          std::string* err, int* code);
  ~CudaGate();
  CudaGate(const CudaGate&) = delete;
  CudaGate& operator=(const CudaGate&) = delete;

  // See cuda_gate.h. *op is nullptr when the manager is unthrottled.
  int Begin(void* stream, Op** op, std::string* err);
  int End(Op* op, std::string* err);

  // Timing only, for a caller that admits and charges by itself (the TF GPU
  // device's DeviceOpGate, cc/tf/device_timer.h): records the start event
  // whatever the share, without admission; EndTimed records the end event and
  // the poller calls `done(start_ns, end_ns)` once the device has run the op
  // (in end order, on the poller thread, exactly once; (0, 0) when the
  // device reported an error). The manager is not charged by the gate. A
  // BeginTimed that fails (ANTMAN_ERR_DEVICE) still returns an op: pass it to
  // EndTimed as usual and `done(0, 0)` follows, so `done` always runs once.
  // On a stream capturing into a CUDA graph BeginTimed records nothing and
  // returns an op whose `done` is told (0, 0) (counted in ops_captured, not
  // errors). Intervals are clipped as in Begin/End (cuda_gate.h, "Charged").
  // This is the DeviceTimer contract of cc/tf/device_timer.h (Before/After).
  using Done = std::function<void(int64_t start_ns, int64_t end_ns)>;
  int BeginTimed(void* stream, Op** op, std::string* err);
  int EndTimed(Op* op, Done done, std::string* err);
  void Drain();
  antman_gate_stats stats() const;
  GateExtStats ext_stats() const;

 private:
  struct Anchor {
    void* event;
    int64_t host_ns;
    // Launch lag: where this anchor places work the device starts on an idle
    // stream, less the host time the call that queued it returned. The
    // device's submission latency plus this anchor's own placement error
    // (its host time is the midpoint of a record and a sync). Measured with
    // probe events on the anchor stream at each anchor; it moves the floor
    // of what an op is charged from its end call to end call + lag.
    int64_t lag_ns;
    int refs;  // ops holding it, +1 while current
  };

  CudaGate(OpManager* manager, const Options& options, const GateDriver* d);
  bool Start(std::string* err, int* code);
  // Runs with the gate's context current on this thread, restoring the
  // previous one (PyTorch/TF threads already have it: then nothing is pushed).
  template <typename F>
  int InContext(F f);
  std::string DriverError(const char* call, int rc) const;
  void* TakeEventLocked(int* rc);  // from the pool, or a new one
  void ReleaseAnchorLocked(Anchor* anchor);
  // An event of the pool recorded on the idle anchor stream and synchronized, with the host
  // times around it: before the record, when the record returned, when the sync returned. With
  // the gate's context current. On failure `event` is nullptr (back in the pool if it was
  // taken) and `error` names the call.
  struct Stamp {
    void* event = nullptr;
    int64_t before = 0, returned = 0, after = 0;
    std::string error;
  };
  Stamp StampAnchorStream();
  // nullopt where it cannot be trusted (see kTrustedLagRoundTripNs).
  std::optional<int64_t> MeasureLaunchLag(void* anchor_event, int64_t anchor_host_ns,
                                          int64_t round_trip_ns);
  // Re-anchors if due, then records op's start event; charge: the op was
  // admitted and provisionally charged by Begin.
  int RecordStart(void* stream, bool charge, int64_t provisional, Op** out, std::string* err);
  // Records and synchronizes a new anchor; best of a few tries.
  int Reanchor(std::string* err);
  // Whether work on `stream` is being captured into a CUDA graph (or the
  // legacy stream is unusable because a blocking stream captures): then the
  // gate records no event and queries nothing for the op.
  bool Capturing(void* stream) const;
  void PollLoop();
  void Complete(Op* op);

  OpManager* const manager_;
  const Options options_;
  const GateDriver* const d_;
  int device_ = 0;
  void* ctx_ = nullptr;
  bool ctx_retained_ = false;
  void* anchor_stream_ = nullptr;

  std::mutex reanchor_mu_;  // one re-anchor at a time; taken before mu_
  mutable std::mutex mu_;
  std::condition_variable work_cv_;     // poller: ops queued, or stopping
  std::condition_variable drained_cv_;  // Drain(): queue empty
  std::vector<void*> free_events_;
  Anchor* anchor_ = nullptr;
  std::deque<Op*> queue_;  // ended ops in end() order; only the poller pops
  std::unordered_map<void*, int64_t> stream_end_ns_;  // floor per stream
  bool stopping_ = false;
  antman_gate_stats stats_{};
  GateExtStats ext_{};
  std::thread poller_;
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_CUDA_GATE_INTERNAL_H_
