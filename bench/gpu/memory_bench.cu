// The memory core on a real GPU, without TensorFlow: built by bench/gpu/build.sh from the core's
// sources, run on a machine with a CUDA driver. Prints ONE JSON line on stdout (flat keys, listed
// in docs/gpu-path.md, "The memory bench"); progress goes to stderr.
//
//   memory_bench [--quick] [--shrink-gib N]
//
// Four measurements, each judged by something outside the mechanism it measures:
//  shrink     cached device memory (N GiB; default 2 with --quick, else 16) released by a limit
//             of 0, timed by the bench's steady clock around the call (not the allocator's own
//             timers) and checked against the driver's free memory; baseline in the same run:
//             cudaFree of regions of the same sizes (paper: 16.3 GB in 17 ms). Twice: on an idle
//             GPU (shrink_*) and with a kernel of another stream spinning across each shrink
//             (shrink_inflight_*; shrink_inflight_kernel_running_after counts the shrinks that
//             returned before that kernel ended).
//  limit      worker threads allocate, touch and free through the universal allocator while a
//             changer thread moves the limit (now and at step boundaries) and an observer thread
//             samples the allocator's statistics; the device region source is wrapped by a
//             counter of the bytes the driver has handed out, which at every growth is compared
//             with the limit in force (raised before the call that raises it, lowered after the
//             call that lowers it returned). Overshoot: the larger of that excess and the
//             observer's reserved - max(limit, regions holding live blocks).
//  fallback   a bandwidth-bound kernel (y = a*x + y) on buffers the allocator placed in device
//             memory and on buffers it placed in pinned host memory past the limit (placement
//             checked with cudaPointerGetAttributes); results compared bit for bit and with a CPU
//             reference; times from CUDA events, alternated and repeated.
//  fit        a request no cached region fits while the cache fills the limit lands on the device
//             (the cache is released first), not in host memory.
// Exit: 0 all checks passed, 1 a check failed (the JSON line is still printed), 77 no CUDA device
// or driver (a JSON line with "skipped").
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/antman_memory.h"
#include "cc/core/backend.h"
#include "cc/core/universal.h"

namespace {

constexpr uint64_t MiB = uint64_t{1} << 20;
constexpr uint64_t GiB = uint64_t{1} << 30;
constexpr int kSkip = 77;
constexpr int kJsonVersion = 1;

// Flat JSON object, keys in insertion order.
class Json {
 public:
  void Num(const char* k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.6g", std::isfinite(v) ? v : -1.0);
    Raw(k, buf);
  }
  void Int(const char* k, uint64_t v) { Raw(k, std::to_string(v)); }
  void Bool(const char* k, bool v) { Raw(k, v ? "true" : "false"); }
  void Str(const char* k, const std::string& v) {
    std::string e;
    for (char c : v) {
      if (c == '"' || c == '\\') e += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) e += c;
    }
    Raw(k, "\"" + e + "\"");
  }
  std::string Text() const { return "{" + body_.str() + "}"; }

 private:
  void Raw(const char* k, const std::string& v) {
    body_ << (first_ ? "" : ", ") << "\"" << k << "\": " << v;
    first_ = false;
  }
  std::ostringstream body_;
  bool first_ = true;
};

bool g_ok = true;
void Check(bool cond, const char* what) {
  if (!cond) {
    std::fprintf(stderr, "CHECK FAILED: %s\n", what);
    g_ok = false;
  }
}

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

size_t DriverFree() {
  size_t f = 0, t = 0;
  cudaMemGetInfo(&f, &t);
  return f;
}

void Raise(std::atomic<uint64_t>* a, uint64_t v) {
  uint64_t cur = a->load();
  while (v > cur && !a->compare_exchange_weak(cur, v)) {
  }
}

// Counts the bytes the driver has handed out through `inner`, outside the allocator's books, and
// compares the total with `bound` at every region it hands out.
class CountingSource : public antman::RegionSource {
 public:
  CountingSource(antman::RegionSource* inner, const std::atomic<uint64_t>* bound)
      : inner_(inner), bound_(bound) {}
  void* AllocRegion(size_t bytes) override {
    void* p = inner_->AllocRegion(bytes);
    if (p == nullptr) return nullptr;
    const uint64_t held = held_.fetch_add(bytes) + bytes;
    ++growths_;
    if (bound_ != nullptr) {
      const uint64_t bound = bound_->load();
      if (held > bound) Raise(&max_overshoot_, held - bound);
    }
    return p;
  }
  void FreeRegion(void* ptr, size_t bytes) override {
    inner_->FreeRegion(ptr, bytes);
    held_.fetch_sub(bytes);
  }
  uint64_t held() const { return held_.load(); }
  uint64_t growths() const { return growths_.load(); }
  uint64_t max_overshoot() const { return max_overshoot_.load(); }

 private:
  antman::RegionSource* inner_;
  const std::atomic<uint64_t>* bound_;
  std::atomic<uint64_t> held_{0};
  std::atomic<uint64_t> growths_{0};
  std::atomic<uint64_t> max_overshoot_{0};
};

// Records the sizes of the regions returned while recording is on (for the cudaFree baseline).
class RecordingSource : public antman::RegionSource {
 public:
  explicit RecordingSource(antman::RegionSource* inner) : inner_(inner) {}
  void* AllocRegion(size_t bytes) override { return inner_->AllocRegion(bytes); }
  void FreeRegion(void* ptr, size_t bytes) override {
    inner_->FreeRegion(ptr, bytes);
    if (recording_) freed_.push_back(bytes);
  }
  void Record(bool on) { recording_ = on; }
  std::vector<size_t> TakeFreed() { return std::move(freed_); }

 private:
  antman::RegionSource* inner_;
  bool recording_ = false;      // only the bench thread uses this allocator
  std::vector<size_t> freed_;
};

bool MakeBackend(uint64_t host_capacity, antman::Backend* b) {
  antman_mem_config c{};
  c.backend = ANTMAN_BACKEND_CUDA;
  c.device_ordinal = 0;
  c.host_capacity = host_capacity;
  std::string err;
  if (!antman::MakeCudaBackend(c, b, &err)) {
    std::fprintf(stderr, "CUDA backend: %s\n", err.c_str());
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Spins until the GPU's global timer (ns) passes `until_ns`: a kernel that is still running
// while the shrink runs, on memory of its own (not the allocator's).
__global__ void SpinUntil(unsigned long long until_ns, unsigned long long* out) {
  unsigned long long t = 0;
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t < until_ns);
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = t;
}

__global__ void ReadTimer(unsigned long long* out) {
  unsigned long long t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = t;
}

// `in_flight`: a kernel on another stream spins for kSpinMs across each timed shrink; the key
// prefix is then "shrink_inflight_". `shrink_gib` 0: the default size (2 GiB quick, 16 full).
void BenchShrink(bool quick, uint64_t shrink_gib, bool in_flight, Json* out) {
  const std::string key = in_flight ? "shrink_inflight_" : "shrink_";
  auto K = [&](const char* k) { return key + k; };
  constexpr double kSpinMs = 300;
  unsigned long long* spin_buf = nullptr;
  cudaStream_t spin_stream = nullptr;
  if (in_flight) {
    cudaMalloc(&spin_buf, sizeof(unsigned long long));
    cudaStreamCreateWithFlags(&spin_stream, cudaStreamNonBlocking);
  }
  // The GPU's own clock now, then a kernel that spins kSpinMs past it on spin_stream.
  auto spin = [&] {
    ReadTimer<<<1, 1, 0, spin_stream>>>(spin_buf);
    unsigned long long now_ns = 0;
    cudaMemcpyAsync(&now_ns, spin_buf, sizeof(now_ns), cudaMemcpyDeviceToHost, spin_stream);
    cudaStreamSynchronize(spin_stream);
    SpinUntil<<<1, 32, 0, spin_stream>>>(now_ns + static_cast<unsigned long long>(kSpinMs * 1e6),
                                         spin_buf);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // it has started
  };
  int kernels_running = 0;  // shrinks that returned while the spinning kernel still ran
  antman::Backend backend;
  if (!MakeBackend(0, &backend)) {
    Check(false, "shrink: backend");
    return;
  }
  RecordingSource source(backend.device.get());
  const size_t free0 = DriverFree();
  uint64_t bytes = shrink_gib > 0 ? shrink_gib * GiB : (quick ? 2 * GiB : 16 * GiB);
  if (free0 < bytes + 4 * GiB) bytes = std::max<uint64_t>(GiB, free0 / 2 / GiB * GiB);
  const int reps = quick ? 2 : 5;
  antman::UniversalOptions o;
  o.device_capacity = free0;
  o.limit = bytes + 2 * GiB;
  antman::UniversalAllocator mem(&source, nullptr, o);
  std::vector<double> ours_ms, raw_ms, rates;
  uint64_t regions = 0;
  uint64_t freed_bytes = 0;
  bool driver_got_it_back = true;
  for (int rep = 0; rep < reps; ++rep) {
    mem.SetLimit(bytes + 2 * GiB);
    // A training job's cache: blocks of mixed sizes, 64 to 512 MiB.
    std::vector<void*> blocks;
    std::mt19937_64 rng(rep);
    for (uint64_t got = 0; got < bytes;) {
      const uint64_t n = std::min<uint64_t>(bytes - got, (64 << (rng() % 4)) * MiB);
      void* p = mem.Allocate(256, n);
      if (p == nullptr) break;
      blocks.push_back(p);
      got += n;
    }
    for (void* p : blocks) cudaMemsetAsync(p, 0, 4096);  // used once, as a job's tensors are
    cudaDeviceSynchronize();
    for (void* p : blocks) mem.Free(p);
    antman_mem_stats before;
    mem.GetStats(&before);
    const size_t free_before = DriverFree();
    if (in_flight) spin();
    source.Record(true);
    // The bench's steady clock around the call, not the allocator's own timers.
    const auto t0 = std::chrono::steady_clock::now();
    const antman::ShrinkResult r = mem.SetLimit(0);
    const auto t1 = std::chrono::steady_clock::now();
    source.Record(false);
    if (in_flight) {
      kernels_running += cudaStreamQuery(spin_stream) == cudaErrorNotReady;
      cudaStreamSynchronize(spin_stream);
    }
    const size_t free_after = DriverFree();
    ours_ms.push_back(Ms(t1 - t0));
    rates.push_back(r.bytes_freed / double(GiB) / std::max(ours_ms.back(), 1e-6));
    regions = r.regions_freed;
    freed_bytes = r.bytes_freed;
    // The memory really went back to the driver (allow 256 MiB of noise from other users).
    driver_got_it_back &= r.bytes_freed == before.reserved &&
                          free_after + 256 * MiB >= free_before + r.bytes_freed;
    // Baseline: cudaFree of freshly allocated regions of exactly the sizes the shrink released.
    std::vector<size_t> sizes = source.TakeFreed();
    std::vector<void*> raw;
    for (size_t s : sizes) {
      void* p = nullptr;
      if (cudaMalloc(&p, s) == cudaSuccess) raw.push_back(p);
    }
    cudaDeviceSynchronize();
    if (in_flight) spin();  // the baseline under the same condition: a kernel spinning across the frees
    const auto t2 = std::chrono::steady_clock::now();
    for (void* p : raw) cudaFree(p);
    const auto t3 = std::chrono::steady_clock::now();
    if (in_flight) cudaStreamSynchronize(spin_stream);
    raw_ms.push_back(Ms(t3 - t2));
    std::fprintf(stderr, "shrink %d: %.2f GiB in %llu regions: %.3f ms (cudaFree baseline %.3f ms)\n",
                 rep, r.bytes_freed / double(GiB), (unsigned long long)r.regions_freed,
                 ours_ms.back(), raw_ms.back());
  }
  Check(driver_got_it_back, in_flight ? "shrink (kernels in flight): released bytes back in the driver's free memory"
                                       : "shrink: released bytes back in the driver's free memory");
  out->Num(K("gib").c_str(), freed_bytes / double(GiB));
  out->Int(K("regions").c_str(), regions);
  out->Int(K("reps").c_str(), reps);
  out->Num(K("ms_median").c_str(), Median(ours_ms));
  out->Num(K("ms_max").c_str(), *std::max_element(ours_ms.begin(), ours_ms.end()));
  out->Num(K("gib_per_ms").c_str(), Median(rates));  // median over repetitions of freed / time
  out->Num(K("gib_per_ms_min").c_str(), *std::min_element(rates.begin(), rates.end()));
  out->Num(K("baseline_cudafree_ms_median").c_str(), Median(raw_ms));
  out->Bool(K("driver_free_ok").c_str(), driver_got_it_back);
  if (in_flight) {
    // How many shrinks returned while the spinning kernel still ran (it did not wait for it).
    out->Int("shrink_inflight_kernel_running_after", kernels_running);
    out->Num("shrink_inflight_spin_ms", kSpinMs);
    cudaStreamDestroy(spin_stream);
    cudaFree(spin_buf);
  }
}

// ---------------------------------------------------------------------------------------------
__global__ void Touch(unsigned char* p, size_t n, unsigned char v) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}

void BenchLimit(bool quick, Json* out) {
  antman::Backend backend;
  if (!MakeBackend(2 * GiB, &backend)) {
    Check(false, "limit: backend");
    return;
  }
  constexpr uint64_t kStart = GiB;
  std::atomic<uint64_t> bound{kStart};
  CountingSource device(backend.device.get(), &bound);
  antman::UniversalOptions o;
  o.device_capacity = backend.device_capacity;
  o.limit = kStart;
  o.host_capacity = 2 * GiB;
  o.min_region = 2 * MiB;
  o.max_region = 128 * MiB;  // many growths, so that growth races with limit changes
  antman::UniversalAllocator mem(&device, backend.host.get(), o);

  const double seconds = quick ? 1.5 : 8.0;
  std::atomic<bool> done{false};
  std::atomic<uint64_t> samples{0}, over_allowed{0}, over_limit{0}, changes{0};
  std::thread observer([&] {
    while (!done.load()) {
      const antman::BfcStats s = mem.device().GetStats();
      if (s.reserved > std::max(s.limit, s.pinned))
        Raise(&over_allowed, s.reserved - std::max(s.limit, s.pinned));
      if (s.reserved > s.limit) Raise(&over_limit, s.reserved - s.limit);
      ++samples;
    }
  });
  std::thread changer([&] {
    std::mt19937_64 rng(42);
    uint64_t current = kStart;
    while (!done.load()) {
      const int r = static_cast<int>(rng() % 10);
      if (r == 0) {
        mem.ReleaseCached();
      } else {
        const uint64_t next = 256 * MiB + rng() % (1280 * MiB);
        if (next > current) bound = next;
        if (r < 5) {
          mem.SetLimit(next);
        } else {
          mem.RequestLimit(next);
          mem.StepBoundary();
        }
        bound = next;
        current = next;
        ++changes;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    }
  });
  std::atomic<uint64_t> allocs{0}, failed{0}, kernels{0};
  // CUDA's last error is per host thread: the workers record their own launch and synchronise
  // errors here, for the main thread's check (count, and the first error's code).
  std::atomic<uint64_t> kernel_errors{0};
  std::atomic<int> first_kernel_error{cudaSuccess};
  auto record = [&](cudaError_t e) {
    if (e == cudaSuccess) return;
    ++kernel_errors;
    int none = cudaSuccess;
    first_kernel_error.compare_exchange_strong(none, static_cast<int>(e));
  };
  std::vector<std::thread> workers;
  const auto stop_at = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      record(cudaSetDevice(0));
      cudaStream_t stream = nullptr;
      record(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      std::mt19937_64 rng(t + 1);
      std::vector<void*> live;
      while (std::chrono::steady_clock::now() < stop_at) {
        if (live.size() < 8 && (live.empty() || rng() % 100 < 55)) {
          const size_t n = 64 * 1024 + rng() % (48 * MiB);
          void* p = mem.Allocate(256, n);
          if (p == nullptr) {
            ++failed;
            continue;
          }
          ++allocs;
          // Device memory is written by a kernel, as a training step would.
          if (mem.IsHost(p) == 0) {
            Touch<<<256, 256, 0, stream>>>(static_cast<unsigned char*>(p), n, 1);
            record(cudaGetLastError());  // this thread's launch error
            ++kernels;
          }
          live.push_back(p);
        } else {
          const size_t k = rng() % live.size();
          record(cudaStreamSynchronize(stream));  // no kernel uses a block once it is freed
          mem.Free(live[k]);
          live[k] = live.back();
          live.pop_back();
        }
      }
      record(cudaStreamSynchronize(stream));  // the kernels' execution errors
      for (void* p : live) mem.Free(p);
      record(cudaStreamDestroy(stream));
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  changer.join();
  observer.join();
  antman_mem_stats s;
  mem.GetStats(&s);
  const std::string invariants = mem.CheckInvariants();
  Check(invariants.empty(), "limit: allocator invariants after the run");
  // The allocator's books agree with what the driver handed out and got back.
  Check(device.held() == s.reserved, "limit: driver-held bytes equal reserved after the run");
  // (The main thread launched none of them; its own last error may be a stale, non-sticky one
  // from the shrink bench's baseline cudaMalloc, which is not this check's business.)
  Check(kernels.load() > 0 && kernel_errors.load() == 0,
        "limit: kernels on allocated blocks (launched, and every launch and sync succeeded)");
  const uint64_t overshoot = std::max(device.max_overshoot(), over_allowed.load());
  Check(overshoot == 0, "limit: no overshoot");
  out->Int("limit_overshoot_bytes", overshoot);
  out->Int("limit_driver_overshoot_bytes", device.max_overshoot());
  out->Int("limit_snapshot_overshoot_bytes", over_allowed.load());
  out->Int("limit_excess_live_bytes_max", over_limit.load());
  out->Int("limit_observer_samples", samples.load());
  out->Int("limit_changes", changes.load());
  out->Int("limit_growths", device.growths());
  out->Int("limit_allocs", allocs.load());
  out->Int("limit_kernels", kernels.load());
  out->Int("limit_kernel_errors", kernel_errors.load());
  out->Str("limit_kernel_first_error",
           cudaGetErrorName(static_cast<cudaError_t>(first_kernel_error.load())));
  out->Int("limit_host_fallbacks", s.host_fallbacks);
  out->Num("limit_seconds", seconds);
}

// ---------------------------------------------------------------------------------------------
__global__ void Saxpy(float a, const float* x, float* y, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = a * x[i] + y[i];
  }
}

cudaMemoryType TypeOf(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return cudaMemoryTypeUnregistered;
  return a.type;
}

void BenchFallback(bool quick, Json* out) {
  const size_t bytes = (quick ? 64 : 256) * MiB;
  const size_t n = bytes / sizeof(float);
  antman::Backend backend;
  if (!MakeBackend(2 * bytes + 64 * MiB, &backend)) {
    Check(false, "fallback: backend");
    return;
  }
  antman::UniversalOptions o;
  o.device_capacity = backend.device_capacity;
  o.limit = 2 * bytes;  // room for the device pair exactly; the next pair spills to the host
  o.host_capacity = 2 * bytes + 64 * MiB;
  antman::UniversalAllocator mem(backend.device.get(), backend.host.get(), o);
  float* xd = static_cast<float*>(mem.Allocate(256, bytes));
  float* yd = static_cast<float*>(mem.Allocate(256, bytes));
  float* xh = static_cast<float*>(mem.Allocate(256, bytes));
  float* yh = static_cast<float*>(mem.Allocate(256, bytes));
  const bool placed = xd && yd && xh && yh && mem.IsHost(xd) == 0 && mem.IsHost(yd) == 0 &&
                      mem.IsHost(xh) == 1 && mem.IsHost(yh) == 1 &&
                      TypeOf(xd) == cudaMemoryTypeDevice && TypeOf(yd) == cudaMemoryTypeDevice &&
                      TypeOf(xh) == cudaMemoryTypeHost && TypeOf(yh) == cudaMemoryTypeHost;
  Check(placed, "fallback: device pair on the device, the next pair in pinned host memory");
  if (!placed) {
    out->Bool("host_fallback_ok", false);
    return;
  }
  std::vector<float> x0(n), y0(n), ref(n), back(n);
  for (size_t i = 0; i < n; ++i) {
    x0[i] = static_cast<float>(i % 1000) * 0.5f;
    y0[i] = static_cast<float>(i % 77) - 3.0f;
  }
  const float a = 1.25f;
  for (size_t i = 0; i < n; ++i) ref[i] = a * x0[i] + y0[i];
  cudaMemcpy(xd, x0.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(yd, y0.data(), bytes, cudaMemcpyHostToDevice);
  std::memcpy(xh, x0.data(), bytes);  // host-backed: written in place by the CPU
  std::memcpy(yh, y0.data(), bytes);
  Saxpy<<<1024, 256>>>(a, xd, yd, n);
  Saxpy<<<1024, 256>>>(a, xh, yh, n);  // the kernel reads and writes host memory over the bus
  const bool ran = cudaDeviceSynchronize() == cudaSuccess;
  cudaMemcpy(back.data(), yd, bytes, cudaMemcpyDeviceToHost);
  size_t differ = 0, off_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    differ += std::memcmp(&back[i], &yh[i], sizeof(float)) != 0;
    off_ref += std::fabs(back[i] - ref[i]) > 1e-5f * std::max(1.0f, std::fabs(ref[i]));
  }
  const bool ok = ran && differ == 0 && off_ref == 0;
  Check(ok, "fallback: host-backed results equal device-backed ones and the CPU reference");

  // Bandwidth-bound: 12 bytes moved per element. Alternate device / host, repeat.
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto time_ms = [&](float* x, float* y) {
    cudaEventRecord(e0);
    Saxpy<<<1024, 256>>>(a, x, y, n);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return static_cast<double>(ms);
  };
  time_ms(xd, yd);  // warm-up
  time_ms(xh, yh);
  std::vector<double> dev_ms, host_ms, ratios;
  const int reps = quick ? 3 : 7;
  for (int r = 0; r < reps; ++r) {
    dev_ms.push_back(time_ms(xd, yd));
    host_ms.push_back(time_ms(xh, yh));
    ratios.push_back(host_ms.back() / dev_ms.back());
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const double moved = 3.0 * bytes;
  out->Bool("host_fallback_ok", ok);
  out->Int("host_fallback_mismatches", differ + off_ref);
  out->Num("host_fallback_buffer_mib", bytes / double(MiB));
  out->Num("host_fallback_device_ms_median", Median(dev_ms));
  out->Num("host_fallback_host_ms_median", Median(host_ms));
  out->Num("host_fallback_device_gbps", moved / (Median(dev_ms) * 1e6));
  out->Num("host_fallback_host_gbps", moved / (Median(host_ms) * 1e6));
  out->Num("host_fallback_slowdown", Median(host_ms) / Median(dev_ms));
  out->Num("host_fallback_slowdown_min", *std::min_element(ratios.begin(), ratios.end()));
  out->Num("host_fallback_slowdown_max", *std::max_element(ratios.begin(), ratios.end()));
  for (void* p : {static_cast<void*>(xd), static_cast<void*>(yd), static_cast<void*>(xh),
                  static_cast<void*>(yh)}) {
    mem.Free(p);
  }
}

// ---------------------------------------------------------------------------------------------
void BenchFit(Json* out) {
  antman::Backend backend;
  if (!MakeBackend(GiB, &backend)) {
    Check(false, "fit: backend");
    return;
  }
  antman::UniversalOptions o;
  o.device_capacity = backend.device_capacity;
  o.limit = 512 * MiB;
  o.host_capacity = GiB;
  o.min_region = 64 * MiB;
  o.max_region = 64 * MiB;
  antman::UniversalAllocator mem(backend.device.get(), backend.host.get(), o);
  std::vector<void*> small;
  for (int i = 0; i < 8; ++i) small.push_back(mem.Allocate(256, 64 * MiB));
  for (void* p : small) mem.Free(p);  // 512 MiB cached in 64 MiB regions
  void* big = mem.Allocate(256, 256 * MiB);
  antman_mem_ext_stats e;
  mem.GetExtStats(&e);
  const bool ok = big != nullptr && mem.IsHost(big) == 0 && TypeOf(big) == cudaMemoryTypeDevice &&
                  e.fit_release_bytes >= 256 * MiB;
  Check(ok, "fit: a request no cached region fits is served on the device");
  out->Bool("device_first_after_release_ok", ok);
  if (big != nullptr) mem.Free(big);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  long shrink_gib = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--shrink-gib") == 0 && i + 1 < argc) {
      shrink_gib = std::strtol(argv[++i], nullptr, 10);
      if (shrink_gib < 1 || shrink_gib > 1024) {
        std::fprintf(stderr, "--shrink-gib: %ld is outside the accepted range [1, 1024]\n", shrink_gib);
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--shrink-gib N]\n", argv[0]);
      return 2;
    }
  }
  Json out;
  out.Str("bench", "gpu_memory");
  out.Int("version", kJsonVersion);
  out.Bool("quick", quick);
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    out.Str("skipped", std::string("no CUDA device or driver: ") + cudaGetErrorString(e));
    std::printf("%s\n", out.Text().c_str());
    return kSkip;
  }
  cudaSetDevice(0);
  cudaFree(nullptr);  // brings up the primary context the core also uses
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int driver = 0;
  cudaDriverGetVersion(&driver);
  out.Str("device", prop.name);
  out.Int("driver_version", driver);
  out.Num("device_memory_gib", prop.totalGlobalMem / double(GiB));

  BenchShrink(quick, static_cast<uint64_t>(shrink_gib), false, &out);
  BenchShrink(quick, static_cast<uint64_t>(shrink_gib), true, &out);
  BenchLimit(quick, &out);
  BenchFallback(quick, &out);
  BenchFit(&out);
  out.Bool("checks_ok", g_ok);
  std::printf("%s\n", out.Text().c_str());
  return g_ok ? 0 : 1;
}
