// Opening the CUDA driver with dlopen and resolving its entry points into a table of function
// pointers: shared by the memory core's CUDA backend (backend_cuda.cc), the CUDA event gate
// (cuda_gate.cc) and the PyTorch front-end's events (cc/torch/cuda_events.cc), so that they build
// with plain g++ and load on machines without a GPU (creation then fails with one line instead of
// the process failing to start). Also ContextScope: a context current for one call.
#ifndef TF_ANTMAN_CC_CORE_CUDA_DRIVER_LOADER_H_
#define TF_ANTMAN_CC_CORE_CUDA_DRIVER_LOADER_H_

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace antman {

// Resolves `name` into *out; when it is absent, appends it to *missing (", "-separated) and
// returns false. Pass a scratch string as `missing` for an optional entry point or a newer name
// tried before an older one.
template <typename F>
bool ResolveDriverSymbol(void* lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

// The entry points every user of the driver needs to reach a device's primary context (the one
// TensorFlow's stream executor and PyTorch use), for any table with members of these names: the
// memory backend and the event gate resolve them here, alike, and then their own.
template <typename Table>
void ResolvePrimaryContextEntryPoints(void* lib, Table* t, std::string* missing) {
  std::string absent;  // optional entry points, and newer names an older one stands in for
  ResolveDriverSymbol(lib, "cuInit", &t->cuInit, missing);
  ResolveDriverSymbol(lib, "cuDeviceGetCount", &t->cuDeviceGetCount, missing);
  ResolveDriverSymbol(lib, "cuDeviceGet", &t->cuDeviceGet, missing);
  ResolveDriverSymbol(lib, "cuDevicePrimaryCtxRetain", &t->cuDevicePrimaryCtxRetain, missing);
  if (!ResolveDriverSymbol(lib, "cuDevicePrimaryCtxRelease_v2", &t->cuDevicePrimaryCtxRelease,
                           &absent)) {
    ResolveDriverSymbol(lib, "cuDevicePrimaryCtxRelease", &t->cuDevicePrimaryCtxRelease, missing);
  }
  ResolveDriverSymbol(lib, "cuCtxGetCurrent", &t->cuCtxGetCurrent, missing);
  ResolveDriverSymbol(lib, "cuCtxPushCurrent_v2", &t->cuCtxPushCurrent, missing);
  ResolveDriverSymbol(lib, "cuCtxPopCurrent_v2", &t->cuCtxPopCurrent, missing);
  ResolveDriverSymbol(lib, "cuGetErrorString", &t->cuGetErrorString, &absent);
}

// Makes a context current on the calling thread for the scope's lifetime: pushed (and popped at
// the end) only when it is not current already. A framework thread (PyTorch's, TensorFlow's)
// usually has the primary context current, so a call from it costs one cuCtxGetCurrent instead of
// a push and a pop; a thread that never touched CUDA still gets it. For any table with
// cuCtxGetCurrent, cuCtxPushCurrent and cuCtxPopCurrent members of the driver's ABI (int results,
// contexts of type Ctx): the memory backend, the event gate and the PyTorch front-end's events
// use it alike.
template <typename Table, typename Ctx = void*>
class ContextScope {
 public:
  ContextScope(const Table* d, Ctx ctx) : d_(d) {
    Ctx current = nullptr;
    if (d->cuCtxGetCurrent(&current) == 0 && current == ctx) return;
    rc_ = d->cuCtxPushCurrent(ctx);
    pushed_ = rc_ == 0;
  }
  ~ContextScope() {
    if (!pushed_) return;
    Ctx popped = nullptr;
    d_->cuCtxPopCurrent(&popped);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
  // 0 (CUDA_SUCCESS) when the context is current; else the push's error.
  int rc() const { return rc_; }

 private:
  const Table* const d_;
  int rc_ = 0;
  bool pushed_ = false;
};

// The table of type `Table` for `library`, filled by `resolve(lib, &table, &missing)` the first
// time a process asks for that path, then kept with its outcome: the library is never closed (the
// driver keeps global state) and a failure is reported the same way on every later call. Returns
// nullptr and sets *err to "CUDA driver not available: dlopen(<library>) failed: <why>" or
// "<library> lacks driver entry points: <names>". Thread-safe.
template <typename Table>
const Table* LoadDriverTable(const std::string& library,
                             void (*resolve)(void* lib, Table* table, std::string* missing),
                             std::string* err) {
  struct Loaded {
    Table table{};
    std::string error;
  };
  static std::mutex mu;
  static auto* loaded = new std::map<std::string, std::unique_ptr<Loaded>>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<Loaded>& slot = (*loaded)[library];
  if (slot == nullptr) {
    slot = std::make_unique<Loaded>();
    void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      slot->error = "CUDA driver not available: dlopen(" + library + ") failed: " +
                    (why != nullptr ? why : "unknown error");
    } else {
      std::string missing;
      resolve(lib, &slot->table, &missing);
      if (!missing.empty()) slot->error = library + " lacks driver entry points: " + missing;
    }
  }
  if (!slot->error.empty()) {
    *err = slot->error;
    return nullptr;
  }
  return &slot->table;
}

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_CUDA_DRIVER_LOADER_H_
