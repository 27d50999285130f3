// CUDA driver API region sources. libcuda is opened with dlopen at run time, and the few driver
// types used are declared here, so the library builds with plain g++ and loads on machines
// without a GPU (creation then fails with a message instead of the process failing to start).
//
// Every call runs in the device's primary context, the one TensorFlow's stream executor uses,
// so pointers from here are valid in TensorFlow's kernels.
#include <cstdio>
#include <memory>
#include <string>

#include "cc/core/backend.h"
#include "cc/core/cuda_driver_loader.h"

namespace antman {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): the driver's own type
constexpr CUresult kCudaSuccess = 0;
constexpr unsigned int kHostAllocPortable = 0x01;   // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned int kHostAllocDeviceMap = 0x02;  // CU_MEMHOSTALLOC_DEVICEMAP
constexpr int kAttrCanMapHostMemory = 19;           // CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
constexpr int kAttrUnifiedAddressing = 41;          // CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING

struct Driver {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemGetInfo)(size_t*, size_t*);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned int);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuGetErrorString)(CUresult, const char**);  // optional
  CUresult (*cuCtxSynchronize)();                         // optional (a fake may lack it)
};

void ResolveDriver(void* lib, Driver* driver, std::string* missing) {
  ResolvePrimaryContextEntryPoints(lib, driver, missing);
  ResolveDriverSymbol(lib, "cuDeviceGetAttribute", &driver->cuDeviceGetAttribute, missing);
  ResolveDriverSymbol(lib, "cuMemAlloc_v2", &driver->cuMemAlloc, missing);
  ResolveDriverSymbol(lib, "cuMemFree_v2", &driver->cuMemFree, missing);
  ResolveDriverSymbol(lib, "cuMemGetInfo_v2", &driver->cuMemGetInfo, missing);
  ResolveDriverSymbol(lib, "cuMemHostAlloc", &driver->cuMemHostAlloc, missing);
  ResolveDriverSymbol(lib, "cuMemFreeHost", &driver->cuMemFreeHost, missing);
  std::string absent;
  ResolveDriverSymbol(lib, "cuCtxSynchronize", &driver->cuCtxSynchronize, &absent);
}

// Loaded once per library path and process (cuda_driver_loader.h).
const Driver* LoadDriver(const char* library, std::string* err) {
  return LoadDriverTable<Driver>(library, ResolveDriver, err);
}

std::string ErrorText(const Driver& d, CUresult rc) {
  const char* text = nullptr;
  if (d.cuGetErrorString != nullptr) d.cuGetErrorString(rc, &text);
  return "CUDA error " + std::to_string(rc) + (text != nullptr ? std::string(" (") + text + ")" : "");
}

// Holds a retained primary context; sources share it and the last one releases it.
class CudaDevice {
 public:
  CudaDevice(const Driver* d, CUdevice dev, CUcontext ctx) : d_(d), dev_(dev), ctx_(ctx) {}
  ~CudaDevice() { d_->cuDevicePrimaryCtxRelease(dev_); }

  // Runs f with the primary context current on this thread (pushed only when it is not), then
  // restores the previous one; a failed push is returned without running f.
  template <typename F>
  CUresult InContext(F f) const {
    ContextScope<Driver, CUcontext> scope(d_, ctx_);
    if (scope.rc() != kCudaSuccess) return scope.rc();
    return f();
  }
  const Driver& driver() const { return *d_; }
  // Waits until the device has run every kernel queued in the primary context, so that a
  // region about to go back is not used by one still in flight (cuMemFree and cuMemFreeHost
  // only "may" synchronise, cuda.h). One call covers a batch of regions.
  void Synchronize() const {
    if (d_->cuCtxSynchronize == nullptr) return;
    const CUresult rc = InContext([&] { return d_->cuCtxSynchronize(); });
    if (rc != kCudaSuccess) {
      std::fprintf(stderr, "antman cuda backend: cuCtxSynchronize failed: %s\n",
                   ErrorText(*d_, rc).c_str());
    }
  }

 private:
  const Driver* d_;
  CUdevice dev_;
  CUcontext ctx_;
};

class CudaDeviceSource : public RegionSource {
 public:
  explicit CudaDeviceSource(std::shared_ptr<CudaDevice> dev) : dev_(std::move(dev)) {}
  void* AllocRegion(size_t bytes) override {
    CUdeviceptr p = 0;
    const CUresult rc = dev_->InContext([&] { return dev_->driver().cuMemAlloc(&p, bytes); });
    return rc == kCudaSuccess ? reinterpret_cast<void*>(p) : nullptr;
  }
  void Quiesce() override { dev_->Synchronize(); }
  bool MemInfo(size_t* free_bytes, size_t* total_bytes) override {
    return dev_->InContext([&] { return dev_->driver().cuMemGetInfo(free_bytes, total_bytes); }) ==
           kCudaSuccess;
  }
  void FreeRegion(void* ptr, size_t) override {
    const CUresult rc = dev_->InContext(
        [&] { return dev_->driver().cuMemFree(reinterpret_cast<CUdeviceptr>(ptr)); });
    if (rc != kCudaSuccess) {
      std::fprintf(stderr, "antman cuda backend: cuMemFree failed: %s\n",
                   ErrorText(dev_->driver(), rc).c_str());
    }
  }

 private:
  std::shared_ptr<CudaDevice> dev_;
};

// Pinned, mapped host memory: with unified addressing kernels use the host pointer directly.
class CudaHostSource : public RegionSource {
 public:
  explicit CudaHostSource(std::shared_ptr<CudaDevice> dev) : dev_(std::move(dev)) {}
  void* AllocRegion(size_t bytes) override {
    void* p = nullptr;
    const CUresult rc = dev_->InContext([&] {
      return dev_->driver().cuMemHostAlloc(&p, bytes, kHostAllocDeviceMap | kHostAllocPortable);
    });
    return rc == kCudaSuccess ? p : nullptr;
  }
  // Host regions are mapped into kernels' address space: unpinned only when none can use them.
  void Quiesce() override { dev_->Synchronize(); }
  void FreeRegion(void* ptr, size_t) override {
    const CUresult rc = dev_->InContext([&] { return dev_->driver().cuMemFreeHost(ptr); });
    if (rc != kCudaSuccess) {
      std::fprintf(stderr, "antman cuda backend: cuMemFreeHost failed: %s\n",
                   ErrorText(dev_->driver(), rc).c_str());
    }
  }

 private:
  std::shared_ptr<CudaDevice> dev_;
};

}  // namespace

std::string CheckHostMappingSupport(int ordinal, int unified_addressing, int can_map_host,
                                    uint64_t host_capacity) {
  if (host_capacity == 0 || (unified_addressing != 0 && can_map_host != 0)) return "";
  const std::string which = unified_addressing == 0 && can_map_host == 0
                                ? "unified addressing nor mapping of host memory"
                                : unified_addressing == 0 ? "unified addressing"
                                                          : "mapping of host memory";
  return "CUDA device " + std::to_string(ordinal) + " supports no " + which +
         " (CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING=" + std::to_string(unified_addressing) +
         ", CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY=" + std::to_string(can_map_host) +
         "): kernels could not use tensors in the host fallback arena; set host_capacity to 0 "
         "(ANTMAN_HOST_MEMORY=0) to run without host fallback";
}

bool MakeCudaBackend(const antman_mem_config& config, Backend* out, std::string* err) {
  return MakeCudaBackendFrom("libcuda.so.1", config, out, err);
}

bool MakeCudaBackendFrom(const char* library, const antman_mem_config& config, Backend* out,
                         std::string* err) {
  const Driver* d = LoadDriver(library, err);
  if (d == nullptr) return false;
  CUresult rc = d->cuInit(0);
  if (rc != kCudaSuccess) {
    *err = "cuInit failed: " + ErrorText(*d, rc);
    return false;
  }
  int count = 0;
  rc = d->cuDeviceGetCount(&count);
  if (rc != kCudaSuccess || config.device_ordinal >= count) {
    *err = "device_ordinal: " + std::to_string(config.device_ordinal) + " is not in [0, " +
           std::to_string(count) + ") (CUDA devices visible)";
    return false;
  }
  CUdevice dev = 0;
  rc = d->cuDeviceGet(&dev, config.device_ordinal);
  if (rc != kCudaSuccess) {
    *err = "cuDeviceGet failed: " + ErrorText(*d, rc);
    return false;
  }
  // Host fallback hands kernels host pointers as they are: that needs unified addressing and
  // device-mapped pinned memory. Checked now, not at the first spill in the middle of training.
  int unified = 0;
  int can_map = 0;
  rc = d->cuDeviceGetAttribute(&unified, kAttrUnifiedAddressing, dev);
  if (rc == kCudaSuccess) rc = d->cuDeviceGetAttribute(&can_map, kAttrCanMapHostMemory, dev);
  if (rc != kCudaSuccess) {
    *err = "cuDeviceGetAttribute failed: " + ErrorText(*d, rc);
    return false;
  }
  const std::string unsupported =
      CheckHostMappingSupport(config.device_ordinal, unified, can_map, config.host_capacity);
  if (!unsupported.empty()) {
    *err = unsupported;
    return false;
  }
  CUcontext ctx = nullptr;
  rc = d->cuDevicePrimaryCtxRetain(&ctx, dev);
  if (rc != kCudaSuccess) {
    *err = "cuDevicePrimaryCtxRetain failed: " + ErrorText(*d, rc);
    return false;
  }
  auto device = std::make_shared<CudaDevice>(d, dev, ctx);
  uint64_t capacity = config.device_capacity;
  if (capacity == 0) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    rc = device->InContext([&] { return d->cuMemGetInfo(&free_bytes, &total_bytes); });
    if (rc != kCudaSuccess) {
      *err = "cuMemGetInfo failed: " + ErrorText(*d, rc);
      return false;
    }
    capacity = free_bytes;
  }
  out->device = std::make_unique<CudaDeviceSource>(device);
  out->host = std::make_unique<CudaHostSource>(device);
  out->device_capacity = capacity;
  return true;
}

}  // namespace antman
