// CUDA driver events for the stream-ordered cache (cuda_events.h).
#include "cc/torch/cuda_events.h"

#include <cstdio>
#include <utility>

#include "cc/core/cuda_driver_loader.h"

namespace antman_torch {

struct CudaEventDriver {
  int (*cuInit)(unsigned) = nullptr;
  int (*cuDeviceGetCount)(int*) = nullptr;
  int (*cuDeviceGet)(int*, int) = nullptr;
  int (*cuDevicePrimaryCtxRetain)(void**, int) = nullptr;
  int (*cuDevicePrimaryCtxRelease)(int) = nullptr;
  int (*cuCtxGetCurrent)(void**) = nullptr;
  int (*cuCtxPushCurrent)(void*) = nullptr;
  int (*cuCtxPopCurrent)(void**) = nullptr;
  int (*cuGetErrorString)(int, const char**) = nullptr;
  int (*cuEventCreate)(void**, unsigned) = nullptr;
  int (*cuEventDestroy)(void*) = nullptr;
  int (*cuEventRecord)(void*, void*) = nullptr;
  int (*cuEventQuery)(void*) = nullptr;
  int (*cuEventSynchronize)(void*) = nullptr;
  int (*cuStreamSynchronize)(void*) = nullptr;
};

namespace {

constexpr int kSuccess = 0;
constexpr int kNotReady = 600;           // CUDA_ERROR_NOT_READY
constexpr unsigned kDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING: cheaper to record

void Resolve(void* lib, CudaEventDriver* d, std::string* missing) {
  antman::ResolvePrimaryContextEntryPoints(lib, d, missing);
  antman::ResolveDriverSymbol(lib, "cuEventCreate", &d->cuEventCreate, missing);
  antman::ResolveDriverSymbol(lib, "cuEventDestroy_v2", &d->cuEventDestroy, missing);
  antman::ResolveDriverSymbol(lib, "cuEventRecord", &d->cuEventRecord, missing);
  antman::ResolveDriverSymbol(lib, "cuEventQuery", &d->cuEventQuery, missing);
  antman::ResolveDriverSymbol(lib, "cuEventSynchronize", &d->cuEventSynchronize, missing);
  antman::ResolveDriverSymbol(lib, "cuStreamSynchronize", &d->cuStreamSynchronize, missing);
}

// The primary context current for the duration of one call (pushed only when it is not). A
// failed push is not an error of its own: the call is made anyway and reports the driver's error.
using PrimaryContext = antman::ContextScope<CudaEventDriver>;

}  // namespace

CudaEvents::CudaEvents(int device, std::string library)
    : device_(device), library_(std::move(library)) {}

CudaEvents::~CudaEvents() {
  std::lock_guard<std::mutex> lock(mu_);
  if (d_ == nullptr) return;
  {
    PrimaryContext in_context(d_, ctx_);
    for (void* e : pool_) d_->cuEventDestroy(e);
  }
  d_->cuDevicePrimaryCtxRelease(device_);
}

void CudaEvents::FailLocked(const std::string& what, int rc) {
  if (!error_.empty()) return;
  const char* text = nullptr;
  if (d_ != nullptr && d_->cuGetErrorString != nullptr) d_->cuGetErrorString(rc, &text);
  error_ = what + " failed: CUDA error " + std::to_string(rc) + (text ? std::string(" (") + text + ")" : "");
  std::fprintf(stderr, "tf-antman: stream-ordered reuse on device %d: %s; the allocator "
               "synchronises streams instead\n", device_, error_.c_str());
}

bool CudaEvents::ReadyLocked() {
  if (d_ != nullptr) return true;
  if (tried_) return false;
  tried_ = true;
  std::string err;
  const CudaEventDriver* d = antman::LoadDriverTable<CudaEventDriver>(library_, &Resolve, &err);
  if (d == nullptr) {
    FailLocked(err, -1);
    return false;
  }
  int dev = 0;
  int rc = d->cuInit(0);
  if (rc == kSuccess) rc = d->cuDeviceGet(&dev, device_);
  if (rc == kSuccess) rc = d->cuDevicePrimaryCtxRetain(&ctx_, dev);
  if (rc != kSuccess) {
    d_ = d;  // for the error string
    FailLocked("retaining the primary context", rc);
    d_ = nullptr;
    return false;
  }
  d_ = d;
  return true;
}

Event CudaEvents::Record(Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ReadyLocked()) return nullptr;
  PrimaryContext in_context(d_, ctx_);
  void* e = nullptr;
  if (!pool_.empty()) {
    e = pool_.back();
    pool_.pop_back();
  } else if (int rc = d_->cuEventCreate(&e, kDisableTiming); rc != kSuccess) {
    FailLocked("cuEventCreate", rc);
    return nullptr;
  }
  if (int rc = d_->cuEventRecord(e, stream); rc != kSuccess) {
    FailLocked("cuEventRecord", rc);
    pool_.push_back(e);
    return nullptr;
  }
  return e;
}

bool CudaEvents::Done(Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (d_ == nullptr) return true;
  PrimaryContext in_context(d_, ctx_);
  const int rc = d_->cuEventQuery(event);
  if (rc == kNotReady) return false;
  if (rc != kSuccess) FailLocked("cuEventQuery", rc);  // nothing left to run for it
  return true;
}

void CudaEvents::Wait(Event event) {
  const CudaEventDriver* d = nullptr;
  void* ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (d_ == nullptr) return;
    d = d_;
    ctx = ctx_;
  }
  PrimaryContext in_context(d, ctx);  // waited for without the lock: other devices' frees go on
  if (int rc = d->cuEventSynchronize(event); rc != kSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked("cuEventSynchronize", rc);
  }
}

void CudaEvents::Synchronize(Stream stream) {
  const CudaEventDriver* d = nullptr;
  void* ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ReadyLocked()) return;
    d = d_;
    ctx = ctx_;
  }
  PrimaryContext in_context(d, ctx);
  if (int rc = d->cuStreamSynchronize(stream); rc != kSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked("cuStreamSynchronize", rc);
  }
}

void CudaEvents::Release(Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (event != nullptr) pool_.push_back(event);
}

std::string CudaEvents::Error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace antman_torch
