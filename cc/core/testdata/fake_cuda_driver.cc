// A stand-in for libcuda.so.1 with the entry points the CUDA backend resolves, so that the
// backend's start-up checks and its region sources run on machines without a GPU. "Device"
// memory is host memory. Tests steer it through fake_cuda_set (found with dlsym).
#include <cstdlib>
#include <cstring>

namespace {

int g_unified = 1;       // CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
int g_can_map = 1;       // CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
int g_device_count = 1;
int g_live_device = 0;   // regions handed out and not freed
int g_live_host = 0;
int g_ctx_depth = 0;     // pushes minus pops
int g_alloc_outside_ctx = 0;
char g_ctx;              // the one "primary context"

}  // namespace

extern "C" {

using CUresult = int;
constexpr CUresult kOk = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kOutOfMemory = 2;

void fake_cuda_set(const char* key, int value) {
  if (std::strcmp(key, "unified") == 0) g_unified = value;
  if (std::strcmp(key, "can_map") == 0) g_can_map = value;
  if (std::strcmp(key, "devices") == 0) g_device_count = value;
}

int fake_cuda_get(const char* key) {
  if (std::strcmp(key, "live_device") == 0) return g_live_device;
  if (std::strcmp(key, "live_host") == 0) return g_live_host;
  if (std::strcmp(key, "ctx_depth") == 0) return g_ctx_depth;
  if (std::strcmp(key, "alloc_outside_ctx") == 0) return g_alloc_outside_ctx;
  return -1;
}

CUresult cuInit(unsigned int) { return kOk; }
CUresult cuDeviceGetCount(int* n) {
  *n = g_device_count;
  return kOk;
}
CUresult cuDeviceGet(int* dev, int ordinal) {
  *dev = ordinal;
  return kOk;
}
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
  if (attr == 41) *v = g_unified;
  else if (attr == 19) *v = g_can_map;
  else return kInvalidValue;
  return kOk;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
  *ctx = &g_ctx;
  return kOk;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return kOk; }
CUresult cuCtxPushCurrent_v2(void*) {
  ++g_ctx_depth;
  return kOk;
}
CUresult cuCtxPopCurrent_v2(void** ctx) {
  --g_ctx_depth;
  if (ctx != nullptr) *ctx = &g_ctx;
  return kOk;
}
CUresult cuMemAlloc_v2(unsigned long long* p, size_t bytes) {  // NOLINT(runtime/int)
  if (g_ctx_depth <= 0) ++g_alloc_outside_ctx;
  void* m = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (m == nullptr) return kOutOfMemory;
  *p = reinterpret_cast<unsigned long long>(m);  // NOLINT(runtime/int)
  ++g_live_device;
  return kOk;
}
CUresult cuMemFree_v2(unsigned long long p) {  // NOLINT(runtime/int)
  std::free(reinterpret_cast<void*>(p));
  --g_live_device;
  return kOk;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  *free_bytes = size_t{1} << 30;
  *total = size_t{2} << 30;
  return kOk;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int) {
  if (g_ctx_depth <= 0) ++g_alloc_outside_ctx;
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (*p == nullptr) return kOutOfMemory;
  ++g_live_host;
  return kOk;
}
CUresult cuMemFreeHost(void* p) {
  std::free(p);
  --g_live_host;
  return kOk;
}
CUresult cuGetErrorString(CUresult, const char** text) {
  *text = "fake error";
  return kOk;
}

}  // extern "C"
