// The stream-ordered cache's StreamEvents (stream_ordered.h) over the CUDA driver API, opened
// with dlopen like the rest of cc/core (cuda_driver_loader.h): events without timing, pooled,
// each call made with the device's primary context current (the one PyTorch uses; pushed only
// when it is not, antman::ContextScope), so frees from threads that never touched CUDA work too. The driver is opened and the context retained at the
// first event, not before: a job on one stream never needs one (stream_ordered.h).
#ifndef TF_ANTMAN_CC_TORCH_CUDA_EVENTS_H_
#define TF_ANTMAN_CC_TORCH_CUDA_EVENTS_H_

#include <mutex>
#include <string>
#include <vector>

#include "cc/torch/stream_ordered.h"

namespace antman_torch {

struct CudaEventDriver;

class CudaEvents : public StreamEvents {
 public:
  // library: the driver's path for dlopen ("libcuda.so.1"; a fake one in tests).
  CudaEvents(int device, std::string library);
  ~CudaEvents() override;
  Event Record(Stream stream) override;
  bool Done(Event event) override;
  void Wait(Event event) override;
  void Synchronize(Stream stream) override;
  void Release(Event event) override;
  // The first driver error seen (empty if none): reported once on stderr as well.
  std::string Error();

 private:
  bool ReadyLocked();
  void FailLocked(const std::string& what, int rc);

  const int device_;
  const std::string library_;
  std::mutex mu_;
  const CudaEventDriver* d_ = nullptr;
  void* ctx_ = nullptr;
  bool tried_ = false;
  std::string error_;
  std::vector<void*> pool_;
};

}  // namespace antman_torch

#endif  // TF_ANTMAN_CC_TORCH_CUDA_EVENTS_H_
