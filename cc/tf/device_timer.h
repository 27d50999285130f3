// How the GPU device learns when an op's kernels ran, to charge the operator
// manager with device time (OpManager::Launched / DeviceDone). No TensorFlow
// types: the device passes its compute stream as an opaque pointer (a
// CUstream), so the same interface can be served by TensorFlow's event manager
// (gpu_device.cc, today) or by the framework-free CUDA event gate of the core
// (docs/gpu-path.md, "Device time").
#ifndef TF_ANTMAN_CC_TF_DEVICE_TIMER_H_
#define TF_ANTMAN_CC_TF_DEVICE_TIMER_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>

#include "cc/core/op_manager.h"

namespace antman {

class DeviceTimer {
 public:
  // [start_ns, end_ns): the device time of the kernels launched between
  // Before() and After(), on the operator manager's clock (SystemClock()).
  using Done = std::function<void(int64_t start_ns, int64_t end_ns)>;

  virtual ~DeviceTimer() = default;

  // On the launching thread, after admission and right before the launch.
  // Returns a token for After(). Must not block on the device.
  virtual int64_t Before(void* stream) = 0;

  // On the launching thread, right after the launch returned (for an async
  // kernel: from its done callback). `done` runs exactly once, on any thread,
  // once the device has passed every kernel enqueued on `stream` so far. Must
  // not block on the device; `done` must not be called from inside After().
  virtual void After(int64_t token, void* stream, Done done) = 0;
};

// Device time of an op from what the host sees, for timers that learn only
// when a stream *passed* a point (TF's event manager polls events; it cannot
// say when a kernel started): the op's kernels started at its launch, or when
// the stream finished the work queued before it, whichever is later, and ended
// when the stream passed it. One stream runs its work in order, so this is the
// stream's occupancy by the op; it counts launch latency and the gap between
// back-to-back kernels of one op as busy, never time the stream was idle
// before the launch. Completions may be reported out of order (callbacks run on
// a thread pool): a completion earlier than one already seen is clamped.
class StreamOccupancy {
 public:
  struct Interval {
    int64_t start_ns;
    int64_t end_ns;
  };

  // The op launched at `launch_ns` was seen complete at `seen_ns`.
  Interval Complete(int64_t launch_ns, int64_t seen_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t start = std::max(launch_ns, last_end_ns_);
    int64_t end = std::max(seen_ns, start);
    last_end_ns_ = std::max(last_end_ns_, end);
    return {start, end};
  }

 private:
  std::mutex mu_;
  int64_t last_end_ns_ = 0;
};

// The sequence every gated GPU op follows (paper §4.1 with device time):
// admission (which also bounds the launches still pending on the device),
// launch, then charge the kernel time when the device reports it. Kept apart
// from the TF device so the order of calls is tested without a GPU.
class DeviceOpGate {
 public:
  DeviceOpGate(OpManager* manager, DeviceTimer* timer) : manager_(manager), timer_(timer) {}

  // An op between admission and the end of its launch.
  struct Admitted {
    int64_t token;
  };

  // Blocks until the manager admits a device-timed op; marks the stream.
  Admitted Admit(void* stream) {
    manager_->Admit(OpManager::Timing::kDevice);
    return {timer_->Before(stream)};
  }

  // The launch returned: charge a provisional estimate now and the device's
  // own time when the stream has passed the op.
  void Launched(Admitted admitted, void* stream) {
    OpManager* manager = manager_;
    int64_t provisional = manager->Launched();
    timer_->After(admitted.token, stream, [manager, provisional](int64_t start, int64_t end) {
      manager->DeviceDone(provisional, start, end);
    });
  }

  // A synchronous launch on the calling thread.
  template <typename Launch>
  void Run(void* stream, Launch&& launch) {
    Admitted admitted = Admit(stream);
    std::forward<Launch>(launch)();
    Launched(admitted, stream);
  }

 private:
  OpManager* manager_;
  DeviceTimer* timer_;
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_DEVICE_TIMER_H_
