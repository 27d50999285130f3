// A stand-in for libcuda.so.1 (no GPU): the entry points the memory backend and the event gate
// resolve, with streams whose work completes asynchronously, so that allocator and gate tests see
// the orderings a real device produces. "Device" memory is host memory. What the model assumes,
// and which CUDA 13.0 cuda.h text each rule comes from: docs/memory-core.md, "The fake CUDA
// driver". Exported with the driver's own symbol names (cuMemAlloc_v2, cuEventElapsedTime_v2, ...).
//
// Model in one paragraph: every stream (cuStreamCreate, and one shared object for the legacy /
// per-thread default streams NULL, 0x1, 0x2) has a host worker thread that runs its queued work
// in order. Work is a fake kernel (fake_cuda_launch: sleeps delay_us, then memsets its buffer), an
// event record (stamped with the host steady clock when the worker reaches it, i.e. when the
// stream's prior work has completed), or a wait for an event (cuStreamWaitEvent). cuMemAlloc
// refuses beyond the settable capacity; cuMemFree / cuMemFreeHost synchronise the device (they
// wait for every stream to drain, and count it when there was work to wait for). Stream capture
// (cuStreamBeginCapture_v2 .. cuStreamEndCapture) records fake kernels into a graph instead of
// running them; an "unsafe" call (cuMemAlloc, cuMemFree, cuMemHostAlloc, cuMemFreeHost,
// cuEventQuery, cuEventSynchronize, cuStreamQuery, cuStreamSynchronize, cuCtxSynchronize) made
// while a capture forbids it (the thread's capture mode rules of cuThreadExchangeStreamCaptureMode)
// fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture; the fake counts
// it so that tests can assert none happened.
//
// Test-control functions (extern "C", found with dlsym):
//   void fake_cuda_set(const char* key, int v)      unified, can_map, devices (start-up checks)
//   int  fake_cuda_get(const char* key)             live_device, live_host, ctx_depth,
//                                                   alloc_outside_ctx
//   void fake_cuda_set64(const char* key, long long v)
//        "total"            device memory the driver reports (default 2 GiB)
//        "other_process"    bytes held by other processes (default 1 GiB): cuMemGetInfo's free is
//                           total - other_process - bytes this process holds; cuMemAlloc refuses
//                           (CUDA_ERROR_OUT_OF_MEMORY) beyond it
//        "free_syncs"       1 (default): cuMemFree/cuMemFreeHost wait for the device to drain
//   long long fake_cuda_get64(const char* key)
//        device_bytes, host_bytes        bytes held now through cuMemAlloc / cuMemHostAlloc
//        alloc_calls, free_calls, host_alloc_calls, host_free_calls
//        alloc_refusals                  cuMemAlloc calls refused for capacity
//        free_syncs                      cuMemFree/cuMemFreeHost calls that had to wait for work
//                                        still queued or running on a stream
//        capture_invalidations           captures invalidated by an unsafe call
//        races                           fake kernels launched on a buffer that a kernel of
//                                        another stream, not ordered before it, still uses
//        kernels_launched, kernels_completed, kernel_busy_ns (sum of kernel run intervals)
//        in_flight                       fake kernels queued or running now
//        unsafe_calls                    unsafe calls made while any capture was active (even
//                                        when the thread's mode allowed them)
//        ctx_pushes                      cuCtxPushCurrent calls (all threads)
//   const char* fake_cuda_last_invalidation()       the call that last invalidated a capture ("")
//   void fake_cuda_reset_counters()                 zeroes every counter above (not the state)
//   int  fake_cuda_launch(void* stream, void* ptr, size_t bytes, int delay_us, int value)
//        a kernel that runs delay_us on `stream` then memsets [ptr, ptr+bytes) to `value`
//        (ptr may be NULL: a pure delay); captured instead when the stream is capturing
//   long long fake_cuda_in_flight_on(const void* ptr, size_t bytes)
//        fake kernels queued or running that touch [ptr, ptr+bytes)
//   int  fake_cuda_kernel_intervals(long long* out, int max)
//        [start_ns, end_ns] pairs of completed kernels (steady clock), oldest first; returns
//        the number of pairs written
//   long long fake_cuda_now_ns()                    the steady clock the fake stamps with
//   void fake_cuda_block_stream(void* stream, int blocked)
//        holds a stream's worker before its next piece of work (1) or lets it go on (0), so a
//        test can keep work in flight as long as it needs without timing assumptions
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

extern "C" {
using CUresult = int;
}

namespace {

constexpr CUresult kOk = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kOutOfMemory = 2;
constexpr CUresult kInvalidHandle = 400;
constexpr CUresult kIllegalState = 401;
constexpr CUresult kNotReady = 600;
constexpr CUresult kCaptureUnsupported = 900;  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
constexpr CUresult kCaptureInvalidated = 901;  // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
constexpr CUresult kCaptureImplicit = 906;     // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
constexpr CUresult kCaptureWrongThread = 908;  // CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD

constexpr int kCaptureNone = 0;         // CU_STREAM_CAPTURE_STATUS_NONE
constexpr int kCaptureActive = 1;       // CU_STREAM_CAPTURE_STATUS_ACTIVE
constexpr int kCaptureInvalid = 2;      // CU_STREAM_CAPTURE_STATUS_INVALIDATED
constexpr int kModeGlobal = 0;          // CU_STREAM_CAPTURE_MODE_GLOBAL
[[maybe_unused]] constexpr int kModeThreadLocal = 1;  // CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
constexpr int kModeRelaxed = 2;         // CU_STREAM_CAPTURE_MODE_RELAXED
constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING
constexpr unsigned kStreamNonBlocking = 1;   // CU_STREAM_NON_BLOCKING

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int g_unified = 1;       // CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
int g_can_map = 1;       // CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
int g_device_count = 1;
std::atomic<int> g_live_device{0};  // regions handed out and not freed
std::atomic<int> g_live_host{0};
std::atomic<int> g_ctx_depth{0};    // pushes minus pops (all threads)
std::atomic<int64_t> g_ctx_pushes{0};  // a counter of fake_cuda_get64, kept apart from g_n:
                                       // pushes take no lock
std::atomic<int> g_alloc_outside_ctx{0};
char g_ctx;              // the one "primary context"
thread_local std::vector<void*> tl_ctx;
thread_local int tl_capture_mode = kModeGlobal;

struct Stream;
struct Event {
  unsigned flags = 0;
  uint64_t recorded = 0;    // records made (generation)
  uint64_t completed = 0;   // generation whose record the stream has reached
  int64_t stamp_ns = 0;     // when the latest completed record was reached
  bool captured = false;    // last recorded inside a capture
  Stream* stream = nullptr;
  uint64_t kernel_seq = 0;  // the recording stream's kernels enqueued before the record
};

struct KernelSpec {
  char* ptr;
  size_t bytes;
  int delay_us;
  int value;
};

struct Kernel {
  KernelSpec spec;
  Stream* stream;
  uint64_t seq;  // per stream, from 1
};

struct Work {
  enum Kind { kKernel, kRecord, kWait } kind;
  std::list<Kernel>::iterator kernel;  // kKernel: its entry in g_in_flight
  Event* event = nullptr;
  uint64_t generation = 0;
};

struct Graph {
  std::vector<KernelSpec> kernels;
};

struct Stream {
  unsigned flags = 0;
  std::deque<Work> queue;
  bool running = false;  // the worker is executing the front item
  bool blocked = false;
  bool stop = false;
  uint64_t kernel_seq = 0;               // kernels enqueued
  std::map<Stream*, uint64_t> ordered;   // other stream -> kernels of it ordered before ours
  int capture = kCaptureNone;
  int capture_mode = kModeGlobal;
  std::thread::id capture_thread;
  uint64_t capture_id = 0;
  std::unique_ptr<Graph> graph;
  std::thread worker;
};

// Never destroyed: worker threads may still wait on them while the process exits.
std::mutex& g_mu = *new std::mutex;
std::condition_variable& g_cv = *new std::condition_variable;  // any change: work, completion
std::set<Stream*>& g_streams = *new std::set<Stream*>;
Stream* g_legacy = nullptr;  // NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
std::list<Kernel>& g_in_flight = *new std::list<Kernel>;
std::vector<std::pair<int64_t, int64_t>>& g_intervals =
    *new std::vector<std::pair<int64_t, int64_t>>;
std::string& g_last_invalidation = *new std::string;
uint64_t g_next_capture_id = 1;

int64_t g_total = int64_t{2} << 30;
int64_t g_other = int64_t{1} << 30;
bool g_free_syncs = true;
std::map<void*, size_t>& g_device_regions = *new std::map<void*, size_t>;
std::map<void*, size_t>& g_host_regions = *new std::map<void*, size_t>;
int64_t g_device_bytes = 0;
int64_t g_host_bytes = 0;

struct Counters {
  int64_t alloc_calls, free_calls, host_alloc_calls, host_free_calls, alloc_refusals, free_syncs,
      capture_invalidations, races, kernels_launched, kernels_completed, kernel_busy_ns,
      unsafe_calls;
} g_n{};

void RunWorker(Stream* s);

Stream* NewStreamLocked(unsigned flags) {
  auto* s = new Stream;
  s->flags = flags;
  g_streams.insert(s);
  s->worker = std::thread(RunWorker, s);
  return s;
}

// The stream a handle names; nullptr for an unknown handle. Called with g_mu held.
Stream* Resolve(void* handle) {
  const auto bits = reinterpret_cast<uintptr_t>(handle);
  if (bits <= 2) {
    if (g_legacy == nullptr) g_legacy = NewStreamLocked(0);
    return g_legacy;
  }
  auto* s = static_cast<Stream*>(handle);
  return g_streams.count(s) != 0 ? s : nullptr;
}

bool Idle(const Stream* s) { return s->queue.empty() && !s->running; }
bool AllIdleLocked() {
  for (Stream* s : g_streams) {
    if (!Idle(s)) return false;
  }
  return true;
}

void RunWorker(Stream* s) {
  std::unique_lock<std::mutex> lock(g_mu);
  for (;;) {
    g_cv.wait(lock, [s] { return s->stop || (!s->queue.empty() && !s->blocked); });
    if (s->queue.empty()) return;  // stopping and drained
    Work w = s->queue.front();
    s->running = true;
    if (w.kind == Work::kWait) {
      Event* e = w.event;
      g_cv.wait(lock, [e, &w] { return e->completed >= w.generation; });
    } else if (w.kind == Work::kKernel) {
      const KernelSpec spec = w.kernel->spec;
      lock.unlock();
      const int64_t start = NowNs();
      if (spec.delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(spec.delay_us));
      if (spec.ptr != nullptr && spec.bytes > 0) std::memset(spec.ptr, spec.value, spec.bytes);
      const int64_t end = NowNs();
      lock.lock();
      g_intervals.emplace_back(start, end);
      ++g_n.kernels_completed;
      g_n.kernel_busy_ns += end - start;
      g_in_flight.erase(w.kernel);
    } else {  // kRecord: the stream's prior work has completed now
      Event* e = w.event;
      if (w.generation > e->completed) {
        e->completed = w.generation;
        e->stamp_ns = NowNs();
      }
    }
    s->queue.pop_front();
    s->running = false;
    g_cv.notify_all();
  }
}

// The capture rules of cuThreadExchangeStreamCaptureMode (cuda.h 13.0): a thread in GLOBAL mode
// may not make a potentially unsafe call while it has a non-relaxed capture of its own or any
// thread has a GLOBAL capture; THREAD_LOCAL: only its own; RELAXED: never prohibited. A prohibited
// call invalidates the captures that prohibit it and fails. Called with g_mu held.
CUresult CheckUnsafeLocked(const char* call) {
  const std::thread::id me = std::this_thread::get_id();
  bool any_active = false;
  bool prohibited = false;
  for (Stream* s : g_streams) {
    if (s->capture != kCaptureActive) continue;
    any_active = true;
    if (tl_capture_mode == kModeRelaxed) continue;
    const bool own = s->capture_thread == me && s->capture_mode != kModeRelaxed;
    const bool global = tl_capture_mode == kModeGlobal && s->capture_mode == kModeGlobal;
    if (own || global) {
      s->capture = kCaptureInvalid;
      ++g_n.capture_invalidations;
      g_last_invalidation = call;
      prohibited = true;
    }
  }
  if (any_active) ++g_n.unsafe_calls;
  return prohibited ? kCaptureUnsupported : kOk;
}

void WaitIdleLocked(std::unique_lock<std::mutex>* lock, Stream* only) {
  g_cv.wait(*lock, [only] { return only != nullptr ? Idle(only) : AllIdleLocked(); });
}

// cuMemFree and cuMemFreeHost: "may" synchronise (cuda.h); the model always does.
void SyncForFreeLocked(std::unique_lock<std::mutex>* lock) {
  if (!g_free_syncs || AllIdleLocked()) return;
  ++g_n.free_syncs;
  WaitIdleLocked(lock, nullptr);
}

bool Overlaps(const KernelSpec& k, const char* p, size_t n) {
  return k.ptr != nullptr && n > 0 && k.ptr < p + n && p < k.ptr + k.bytes;
}

void EnqueueKernelLocked(Stream* s, const KernelSpec& spec) {
  // A kernel of another stream still using this memory, and not ordered before this one
  // (cuStreamWaitEvent on an event recorded after it), is a race: stream-ordered reuse broken.
  for (const Kernel& k : g_in_flight) {
    if (k.stream == s || !Overlaps(k.spec, spec.ptr, spec.bytes)) continue;
    auto it = s->ordered.find(k.stream);
    if (it == s->ordered.end() || it->second < k.seq) ++g_n.races;
  }
  Kernel k{spec, s, ++s->kernel_seq};
  Work w{Work::kKernel, g_in_flight.insert(g_in_flight.end(), k), nullptr, 0};
  s->queue.push_back(w);
  ++g_n.kernels_launched;
  g_cv.notify_all();
}

}  // namespace

extern "C" {

// ---- test control -------------------------------------------------------------------------

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

void fake_cuda_set64(const char* key, long long value) {  // NOLINT(runtime/int)
  std::lock_guard<std::mutex> lock(g_mu);
  if (std::strcmp(key, "total") == 0) g_total = value;
  if (std::strcmp(key, "other_process") == 0) g_other = value;
  if (std::strcmp(key, "free_syncs") == 0) g_free_syncs = value != 0;
}

long long fake_cuda_get64(const char* key) {  // NOLINT(runtime/int)
  std::lock_guard<std::mutex> lock(g_mu);
  const struct {
    const char* name;
    int64_t value;
  } table[] = {
      {"device_bytes", g_device_bytes},
      {"host_bytes", g_host_bytes},
      {"alloc_calls", g_n.alloc_calls},
      {"free_calls", g_n.free_calls},
      {"host_alloc_calls", g_n.host_alloc_calls},
      {"host_free_calls", g_n.host_free_calls},
      {"alloc_refusals", g_n.alloc_refusals},
      {"free_syncs", g_n.free_syncs},
      {"capture_invalidations", g_n.capture_invalidations},
      {"races", g_n.races},
      {"kernels_launched", g_n.kernels_launched},
      {"kernels_completed", g_n.kernels_completed},
      {"kernel_busy_ns", g_n.kernel_busy_ns},
      {"unsafe_calls", g_n.unsafe_calls},
      {"in_flight", static_cast<int64_t>(g_in_flight.size())},
      {"ctx_pushes", g_ctx_pushes.load()},
  };
  for (const auto& row : table) {
    if (std::strcmp(key, row.name) == 0) return row.value;
  }
  return -1;
}

const char* fake_cuda_last_invalidation() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_mu);
  copy = g_last_invalidation;
  return copy.c_str();
}

void fake_cuda_reset_counters() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_n = Counters{};
  g_ctx_pushes = 0;
  g_intervals.clear();
  g_last_invalidation.clear();
}

int fake_cuda_launch(void* stream, void* ptr, size_t bytes, int delay_us, int value) {
  std::lock_guard<std::mutex> lock(g_mu);
  Stream* s = Resolve(stream);
  if (s == nullptr || delay_us < 0) return kInvalidValue;
  const KernelSpec spec{static_cast<char*>(ptr), bytes, delay_us, value};
  if (s->capture == kCaptureActive) {
    s->graph->kernels.push_back(spec);
    return kOk;
  }
  if (s->capture == kCaptureInvalid) return kCaptureInvalidated;
  EnqueueKernelLocked(s, spec);
  return kOk;
}

long long fake_cuda_in_flight_on(const void* ptr, size_t bytes) {  // NOLINT(runtime/int)
  std::lock_guard<std::mutex> lock(g_mu);
  long long n = 0;  // NOLINT(runtime/int)
  for (const Kernel& k : g_in_flight) n += Overlaps(k.spec, static_cast<const char*>(ptr), bytes);
  return n;
}

int fake_cuda_kernel_intervals(long long* out, int max) {  // NOLINT(runtime/int)
  std::lock_guard<std::mutex> lock(g_mu);
  int n = 0;
  for (const auto& iv : g_intervals) {
    if (n >= max) break;
    out[2 * n] = iv.first;
    out[2 * n + 1] = iv.second;
    ++n;
  }
  return n;
}

long long fake_cuda_now_ns() { return NowNs(); }  // NOLINT(runtime/int)

void fake_cuda_block_stream(void* stream, int blocked) {
  std::lock_guard<std::mutex> lock(g_mu);
  Stream* s = Resolve(stream);
  if (s == nullptr) return;
  s->blocked = blocked != 0;
  g_cv.notify_all();
}

// ---- device, context ----------------------------------------------------------------------

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
CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = tl_ctx.empty() ? nullptr : tl_ctx.back();
  return kOk;
}
CUresult cuCtxPushCurrent_v2(void* ctx) {
  tl_ctx.push_back(ctx);
  ++g_ctx_depth;
  ++g_ctx_pushes;
  return kOk;
}
CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (tl_ctx.empty()) return kInvalidValue;
  if (ctx != nullptr) *ctx = tl_ctx.back();
  tl_ctx.pop_back();
  --g_ctx_depth;
  return kOk;
}
CUresult cuCtxSynchronize() {
  std::unique_lock<std::mutex> lock(g_mu);
  const CUresult rc = CheckUnsafeLocked("cuCtxSynchronize");
  if (rc != kOk) return rc;
  WaitIdleLocked(&lock, nullptr);
  return kOk;
}
CUresult cuGetErrorString(CUresult, const char** text) {
  *text = "fake error";
  return kOk;
}

// ---- memory -------------------------------------------------------------------------------

CUresult cuMemAlloc_v2(unsigned long long* p, size_t bytes) {  // NOLINT(runtime/int)
  if (tl_ctx.empty()) ++g_alloc_outside_ctx;
  std::unique_lock<std::mutex> lock(g_mu);
  ++g_n.alloc_calls;
  const CUresult rc = CheckUnsafeLocked("cuMemAlloc");
  if (rc != kOk) return rc;
  const int64_t free_now = g_total - g_other - g_device_bytes;
  if (bytes == 0) return kInvalidValue;
  if (static_cast<int64_t>(bytes) > free_now) {
    ++g_n.alloc_refusals;
    return kOutOfMemory;
  }
  void* m = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (m == nullptr) return kOutOfMemory;
  *p = reinterpret_cast<unsigned long long>(m);  // NOLINT(runtime/int)
  g_device_regions[m] = bytes;
  g_device_bytes += static_cast<int64_t>(bytes);
  ++g_live_device;
  return kOk;
}
CUresult cuMemFree_v2(unsigned long long p) {  // NOLINT(runtime/int)
  std::unique_lock<std::mutex> lock(g_mu);
  ++g_n.free_calls;
  const CUresult rc = CheckUnsafeLocked("cuMemFree");
  if (rc != kOk) return rc;
  auto it = g_device_regions.find(reinterpret_cast<void*>(p));
  if (it == g_device_regions.end()) return kInvalidValue;
  SyncForFreeLocked(&lock);
  g_device_bytes -= static_cast<int64_t>(it->second);
  g_device_regions.erase(it);
  std::free(reinterpret_cast<void*>(p));
  --g_live_device;
  return kOk;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t f = g_total - g_other - g_device_bytes;
  *free_bytes = f > 0 ? static_cast<size_t>(f) : 0;
  *total = static_cast<size_t>(g_total);
  return kOk;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int) {
  if (tl_ctx.empty()) ++g_alloc_outside_ctx;
  std::unique_lock<std::mutex> lock(g_mu);
  ++g_n.host_alloc_calls;
  const CUresult rc = CheckUnsafeLocked("cuMemHostAlloc");
  if (rc != kOk) return rc;
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (*p == nullptr) return kOutOfMemory;
  g_host_regions[*p] = bytes;
  g_host_bytes += static_cast<int64_t>(bytes);
  ++g_live_host;
  return kOk;
}
CUresult cuMemFreeHost(void* p) {
  std::unique_lock<std::mutex> lock(g_mu);
  ++g_n.host_free_calls;
  const CUresult rc = CheckUnsafeLocked("cuMemFreeHost");
  if (rc != kOk) return rc;
  auto it = g_host_regions.find(p);
  if (it == g_host_regions.end()) return kInvalidValue;
  SyncForFreeLocked(&lock);
  g_host_bytes -= static_cast<int64_t>(it->second);
  g_host_regions.erase(it);
  std::free(p);
  --g_live_host;
  return kOk;
}

// ---- streams ------------------------------------------------------------------------------

CUresult cuStreamCreate(void** stream, unsigned int flags) {
  std::lock_guard<std::mutex> lock(g_mu);
  *stream = NewStreamLocked(flags);
  return kOk;
}
CUresult cuStreamDestroy_v2(void* stream) {
  Stream* s = nullptr;
  {
    std::unique_lock<std::mutex> lock(g_mu);
    s = Resolve(stream);
    if (s == nullptr || s == g_legacy) return kInvalidHandle;
    // The driver lets queued work finish after destroy returns; the model joins its worker.
    s->blocked = false;
    s->stop = true;
    g_cv.notify_all();
  }
  s->worker.join();
  std::lock_guard<std::mutex> lock(g_mu);
  g_streams.erase(s);
  delete s;
  return kOk;
}
CUresult cuStreamQuery(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  const CUresult rc = CheckUnsafeLocked("cuStreamQuery");
  if (rc != kOk) return rc;
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  return Idle(s) ? kOk : kNotReady;
}
CUresult cuStreamSynchronize(void* stream) {
  std::unique_lock<std::mutex> lock(g_mu);
  const CUresult rc = CheckUnsafeLocked("cuStreamSynchronize");
  if (rc != kOk) return rc;
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  WaitIdleLocked(&lock, s);
  return kOk;
}
CUresult cuStreamWaitEvent(void* stream, void* event, unsigned int) {
  std::lock_guard<std::mutex> lock(g_mu);
  Stream* s = Resolve(stream);
  auto* e = static_cast<Event*>(event);
  if (s == nullptr || e == nullptr) return kInvalidHandle;
  if (s->capture != kCaptureNone) return kOk;  // a graph dependency: not modelled
  if (e->recorded == 0 || e->captured) return kOk;  // nothing to wait for
  if (e->stream != nullptr && e->stream != s) {
    uint64_t& seen = s->ordered[e->stream];
    if (e->kernel_seq > seen) seen = e->kernel_seq;
    // What the recording stream had been told to wait for is ordered before us too.
    for (const auto& [other, seq] : e->stream->ordered) {
      uint64_t& mine = s->ordered[other];
      if (seq > mine) mine = seq;
    }
  }
  s->queue.push_back(Work{Work::kWait, {}, e, e->recorded});
  g_cv.notify_all();
  return kOk;
}
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  if (mode == nullptr || *mode < kModeGlobal || *mode > kModeRelaxed) return kInvalidValue;
  std::swap(*mode, tl_capture_mode);
  return kOk;
}
CUresult cuStreamBeginCapture_v2(void* stream, int mode) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (mode < kModeGlobal || mode > kModeRelaxed) return kInvalidValue;
  if (reinterpret_cast<uintptr_t>(stream) <= 2) return kCaptureUnsupported;  // legacy stream
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  if (s->capture != kCaptureNone) return kIllegalState;
  s->capture = kCaptureActive;
  s->capture_mode = mode;
  s->capture_thread = std::this_thread::get_id();
  s->capture_id = g_next_capture_id++;
  s->graph = std::make_unique<Graph>();
  return kOk;
}
CUresult cuStreamEndCapture(void* stream, void** graph) {
  std::lock_guard<std::mutex> lock(g_mu);
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  if (s->capture == kCaptureNone) return kIllegalState;
  if (s->capture_mode != kModeRelaxed && s->capture_thread != std::this_thread::get_id()) {
    return kCaptureWrongThread;
  }
  const bool invalid = s->capture == kCaptureInvalid;
  s->capture = kCaptureNone;
  std::unique_ptr<Graph> g = std::move(s->graph);
  *graph = invalid ? nullptr : g.release();
  return invalid ? kCaptureInvalidated : kOk;
}
// The legacy stream while a blocking stream captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT.
CUresult CaptureStatusLocked(void* stream, int* status, uint64_t* id) {
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  if (s == g_legacy) {
    for (Stream* other : g_streams) {
      if (other->capture != kCaptureNone && (other->flags & kStreamNonBlocking) == 0) {
        return kCaptureImplicit;
      }
    }
  }
  *status = s->capture;
  if (id != nullptr) *id = s->capture_id;
  return kOk;
}
CUresult cuStreamIsCapturing(void* stream, int* status) {
  std::lock_guard<std::mutex> lock(g_mu);
  return CaptureStatusLocked(stream, status, nullptr);
}
CUresult cuStreamGetCaptureInfo_v3(void* stream, int* status, unsigned long long* id,  // NOLINT
                                   void** graph, const void** deps, const void** edges,
                                   size_t* num_deps) {
  std::lock_guard<std::mutex> lock(g_mu);
  uint64_t capture_id = 0;
  const CUresult rc = CaptureStatusLocked(stream, status, &capture_id);
  if (rc != kOk) return rc;
  if (id != nullptr) *id = capture_id;
  if (graph != nullptr) *graph = nullptr;
  if (deps != nullptr) *deps = nullptr;
  if (edges != nullptr) *edges = nullptr;
  if (num_deps != nullptr) *num_deps = 0;
  return kOk;
}

// A captured graph is its list of fake kernels; an executable graph is a copy of it.
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {  // NOLINT
  if (graph == nullptr) return kInvalidValue;
  *exec = new Graph(*static_cast<Graph*>(graph));
  return kOk;
}
CUresult cuGraphLaunch(void* exec, void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  Stream* s = Resolve(stream);
  if (s == nullptr || exec == nullptr) return kInvalidHandle;
  for (const KernelSpec& k : static_cast<Graph*>(exec)->kernels) EnqueueKernelLocked(s, k);
  return kOk;
}
CUresult cuGraphExecDestroy(void* exec) {
  delete static_cast<Graph*>(exec);
  return kOk;
}
CUresult cuGraphDestroy(void* graph) {
  delete static_cast<Graph*>(graph);
  return kOk;
}

// ---- events -------------------------------------------------------------------------------

CUresult cuEventCreate(void** event, unsigned int flags) {
  auto* e = new Event;
  e->flags = flags;
  *event = e;
  return kOk;
}
CUresult cuEventDestroy_v2(void* event) {
  // The driver defers the release until the event's record completes; the model waits for it.
  std::unique_lock<std::mutex> lock(g_mu);
  auto* e = static_cast<Event*>(event);
  if (e == nullptr) return kInvalidHandle;
  g_cv.wait(lock, [e] { return e->captured || e->completed >= e->recorded; });
  delete e;
  return kOk;
}
CUresult cuEventRecord(void* event, void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* e = static_cast<Event*>(event);
  Stream* s = Resolve(stream);
  if (e == nullptr || s == nullptr) return kInvalidHandle;
  if (s->capture == kCaptureInvalid) return kCaptureInvalidated;
  e->stream = s;
  e->kernel_seq = s->kernel_seq;
  if (s->capture == kCaptureActive) {  // a node of the graph, not work of the stream
    e->captured = true;
    return kOk;
  }
  e->captured = false;
  ++e->recorded;
  s->queue.push_back(Work{Work::kRecord, {}, e, e->recorded});
  g_cv.notify_all();
  return kOk;
}
CUresult cuEventQuery(void* event) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* e = static_cast<Event*>(event);
  if (e == nullptr) return kInvalidHandle;
  const CUresult rc = CheckUnsafeLocked("cuEventQuery");
  if (rc != kOk) return rc;
  if (e->captured) return kCaptureUnsupported;  // recorded inside a capture: never legal
  return e->completed >= e->recorded ? kOk : kNotReady;
}
CUresult cuEventSynchronize(void* event) {
  std::unique_lock<std::mutex> lock(g_mu);
  auto* e = static_cast<Event*>(event);
  if (e == nullptr) return kInvalidHandle;
  const CUresult rc = CheckUnsafeLocked("cuEventSynchronize");
  if (rc != kOk) return rc;
  if (e->captured) return kCaptureUnsupported;
  const uint64_t target = e->recorded;
  g_cv.wait(lock, [e, target] { return e->completed >= target; });
  return kOk;
}
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* a = static_cast<Event*>(start);
  auto* b = static_cast<Event*>(end);
  if (a == nullptr || b == nullptr || ms == nullptr) return kInvalidHandle;
  if (((a->flags | b->flags) & kEventDisableTiming) != 0) return kInvalidHandle;
  if (a->recorded == 0 || b->recorded == 0 || a->captured || b->captured) return kInvalidHandle;
  if (a->completed < a->recorded || b->completed < b->recorded) return kNotReady;
  // The driver's answer is a float in ms (about 0.5 us resolution on a real device).
  *ms = static_cast<float>(static_cast<double>(b->stamp_ns - a->stamp_ns) / 1e6);
  return kOk;
}
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
  return cuEventElapsedTime_v2(ms, start, end);
}

}  // extern "C"
