// Loading the fake CUDA driver (fake_cuda_driver.cc) into a test: its test-control functions and
// the driver entry points a test drives directly (streams, events, capture), resolved with dlsym
// from the library path the test is given (bazel: $(rootpath //cc/core:libfake_cuda_driver.so)).
// The memory backend and the event gate load the same library through their own loaders
// (MakeCudaBackendFrom, LoadGateDriverFrom); dlopen returns the one copy, so they share its state.
#ifndef TF_ANTMAN_CC_CORE_TESTDATA_FAKE_CUDA_DRIVER_H_
#define TF_ANTMAN_CC_CORE_TESTDATA_FAKE_CUDA_DRIVER_H_

#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <type_traits>

namespace antman_test {

struct FakeCuda {
  // Test control (see the header comment of fake_cuda_driver.cc for every key).
  void (*set)(const char* key, int value) = nullptr;
  int (*get)(const char* key) = nullptr;
  void (*set64)(const char* key, long long value) = nullptr;  // NOLINT(runtime/int)
  long long (*get64)(const char* key) = nullptr;              // NOLINT(runtime/int)
  const char* (*last_invalidation)() = nullptr;
  void (*reset_counters)() = nullptr;
  int (*launch)(void* stream, void* ptr, size_t bytes, int delay_us, int value) = nullptr;
  long long (*in_flight_on)(const void* ptr, size_t bytes) = nullptr;  // NOLINT(runtime/int)
  int (*kernel_intervals)(long long* out, int max) = nullptr;          // NOLINT(runtime/int)
  long long (*now_ns)() = nullptr;                                     // NOLINT(runtime/int)
  void (*block_stream)(void* stream, int blocked) = nullptr;
  // Driver entry points, with the driver's ABI (CUresult = int, handles = void*).
  int (*cuCtxPushCurrent)(void* ctx) = nullptr;
  int (*cuCtxPopCurrent)(void** ctx) = nullptr;
  int (*cuDevicePrimaryCtxRetain)(void** ctx, int device) = nullptr;
  int (*cuStreamCreate)(void** stream, unsigned flags) = nullptr;
  int (*cuStreamDestroy)(void* stream) = nullptr;
  int (*cuStreamSynchronize)(void* stream) = nullptr;
  int (*cuStreamQuery)(void* stream) = nullptr;
  int (*cuStreamWaitEvent)(void* stream, void* event, unsigned flags) = nullptr;
  int (*cuStreamBeginCapture)(void* stream, int mode) = nullptr;
  int (*cuStreamEndCapture)(void* stream, void** graph) = nullptr;
  int (*cuStreamIsCapturing)(void* stream, int* status) = nullptr;
  int (*cuThreadExchangeStreamCaptureMode)(int* mode) = nullptr;
  int (*cuGraphInstantiateWithFlags)(void** exec, void* graph, unsigned long long) = nullptr;  // NOLINT
  int (*cuGraphLaunch)(void* exec, void* stream) = nullptr;
  int (*cuGraphExecDestroy)(void* exec) = nullptr;
  int (*cuGraphDestroy)(void* graph) = nullptr;
  int (*cuEventCreate)(void** event, unsigned flags) = nullptr;
  int (*cuEventDestroy)(void* event) = nullptr;
  int (*cuEventRecord)(void* event, void* stream) = nullptr;
  int (*cuEventQuery)(void* event) = nullptr;
  int (*cuEventSynchronize)(void* event) = nullptr;
  int (*cuEventElapsedTime)(float* ms, void* start, void* end) = nullptr;
  int (*cuCtxSynchronize)() = nullptr;
  int (*cuMemAlloc)(unsigned long long* p, size_t bytes) = nullptr;  // NOLINT(runtime/int)
  int (*cuMemFree)(unsigned long long p) = nullptr;                  // NOLINT(runtime/int)
  int (*cuMemGetInfo)(size_t* free_bytes, size_t* total) = nullptr;

  // false (and a line on stderr) when the library or one of its symbols is missing.
  bool Load(const char* path) {
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
      return false;
    }
    bool ok = true;
    auto get_sym = [&](auto* slot, const char* name) {
      *slot = reinterpret_cast<std::remove_reference_t<decltype(*slot)>>(dlsym(lib, name));
      if (*slot == nullptr) {
        std::fprintf(stderr, "%s lacks %s\n", path, name);
        ok = false;
      }
    };
    get_sym(&set, "fake_cuda_set");
    get_sym(&get, "fake_cuda_get");
    get_sym(&set64, "fake_cuda_set64");
    get_sym(&get64, "fake_cuda_get64");
    get_sym(&last_invalidation, "fake_cuda_last_invalidation");
    get_sym(&reset_counters, "fake_cuda_reset_counters");
    get_sym(&launch, "fake_cuda_launch");
    get_sym(&in_flight_on, "fake_cuda_in_flight_on");
    get_sym(&kernel_intervals, "fake_cuda_kernel_intervals");
    get_sym(&now_ns, "fake_cuda_now_ns");
    get_sym(&block_stream, "fake_cuda_block_stream");
    get_sym(&cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    get_sym(&cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    get_sym(&cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    get_sym(&cuStreamCreate, "cuStreamCreate");
    get_sym(&cuStreamDestroy, "cuStreamDestroy_v2");
    get_sym(&cuStreamSynchronize, "cuStreamSynchronize");
    get_sym(&cuStreamQuery, "cuStreamQuery");
    get_sym(&cuStreamWaitEvent, "cuStreamWaitEvent");
    get_sym(&cuStreamBeginCapture, "cuStreamBeginCapture_v2");
    get_sym(&cuStreamEndCapture, "cuStreamEndCapture");
    get_sym(&cuStreamIsCapturing, "cuStreamIsCapturing");
    get_sym(&cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode");
    get_sym(&cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags");
    get_sym(&cuGraphLaunch, "cuGraphLaunch");
    get_sym(&cuGraphExecDestroy, "cuGraphExecDestroy");
    get_sym(&cuGraphDestroy, "cuGraphDestroy");
    get_sym(&cuEventCreate, "cuEventCreate");
    get_sym(&cuEventDestroy, "cuEventDestroy_v2");
    get_sym(&cuEventRecord, "cuEventRecord");
    get_sym(&cuEventQuery, "cuEventQuery");
    get_sym(&cuEventSynchronize, "cuEventSynchronize");
    get_sym(&cuEventElapsedTime, "cuEventElapsedTime_v2");
    get_sym(&cuCtxSynchronize, "cuCtxSynchronize");
    get_sym(&cuMemAlloc, "cuMemAlloc_v2");
    get_sym(&cuMemFree, "cuMemFree_v2");
    get_sym(&cuMemGetInfo, "cuMemGetInfo_v2");
    return ok;
  }
};

// CUDA values the tests use (cuda.h 13.0).
constexpr int kCuCaptureStatusNone = 0;
constexpr int kCuCaptureStatusActive = 1;
constexpr int kCuCaptureStatusInvalidated = 2;
constexpr int kCuCaptureModeGlobal = 0;
constexpr int kCuCaptureModeThreadLocal = 1;
constexpr int kCuCaptureModeRelaxed = 2;
constexpr int kCuErrorOutOfMemory = 2;
constexpr int kCuErrorNotReady = 600;
constexpr int kCuErrorCaptureUnsupported = 900;
constexpr int kCuErrorCaptureInvalidated = 901;

}  // namespace antman_test

#endif  // TF_ANTMAN_CC_CORE_TESTDATA_FAKE_CUDA_DRIVER_H_
