// bench/gpu compute half: real kernels on one CUDA stream, gated by the op manager through the
// CUDA event gate of libantman_core.so (C API: cc/core/antman_ops.h, cc/core/cuda_gate.h).
// No TensorFlow, no Bazel: bench/gpu/build_compute.sh builds it, bench/gpu/check.py drives it.
//
//   compute_bench probe                       exit 0 if a CUDA device is usable, else 77
//   compute_bench share [--quick] [--kernel-us U --host-us H] [--burst-us B]
//                                             phases at share 1 (the job's natural share), then
//                                             0.25 / 0.5 / 0.75; one JSON line of raw counts
//   compute_bench guarantee --iters N --kernels K
//                                             K kernels at share 1: wall time (one JSON line)
//   compute_bench opportunist --iters N --share S [--burst-us B]
//                                             warms up at share 1, then kernels at share S
//                                             until SIGTERM; prints READY once at S, then
//                                             "P <unix time> <kernels>" every 50 ms, and a JSON
//                                             line at the end (kernels done, wall seconds)
//
// --burst-us B: the manager's device_burst_ns in us ([0, 1e6]; default: the library's, 2 ms):
// a throttled job banks B of busy time before each turn on the GPU. The JSON line says which.
// Long kernels (default): FMA and SAXPY kernels alternating, ~0.5 ms each, launched back to
// back. Short kernels (--kernel-us U): FMA kernels of ~U us with H us of host work (a spin on
// the host clock) between launches, as a PyTorch job's small ops are.
// The share is judged by witnesses outside the gate, never by the gate's or the bench's CUDA
// events (which share the gate's stream and its bias):
//  - CUPTI kernel activity records (start/end stamped by the GPU for every kernel of this
//    process, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, which does not serialise kernels), inside
//    a window read with cuptiGetTimestamp on the same clock; libcupti is loaded at run time
//    (dlopen: CUPTI_LIB, else libcupti.so.13 / libcupti.so on the loader's path), and its
//    absence is reported ("cupti_error"), never fatal;
//  - the work done: kernels completed per second in each phase (the caller divides by the
//    natural phase's rate);
//  - NVML utilisation, sampled by the caller (bench/gpu/check.py) over "phase_epoch_s".
// The caller (check.py) computes the figures from these raw counts. The manager's own figure is
// printed beside them for comparison only.
// Exit status: 0 done, 1 a failed check or CUDA error, 2 usage, 77 no CUDA device or driver.
#include <cuda_runtime.h>
#include <cupti_activity.h>  // types only: libcupti is loaded with dlopen (Cupti below)
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cc/core/antman_ops.h"
#include "cc/core/cuda_gate.h"

namespace {

constexpr int kSkip = 77;
constexpr int kJsonVersion = 2;

#define CUDA_OK(expr)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "compute_bench: %s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

#define ANTMAN_OK_OR_DIE(expr)                                                          \
  do {                                                                                  \
    int rc_ = (expr);                                                                   \
    if (rc_ != ANTMAN_OK) {                                                             \
      std::fprintf(stderr, "compute_bench: %s failed: %s\n", #expr, antman_core_last_error()); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// Compute-bound: a dependent FMA chain per thread (no memory traffic after the load).
__global__ void FmaChain(float* data, int n, int iters) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float a = data[i], b = 1.0001f, c = 0.9999f;
  for (int k = 0; k < iters; ++k) {
    a = fmaf(a, b, c);
    b = fmaf(b, c, a * 1e-7f);
  }
  data[i] = a + b;
}

// Bandwidth-bound: y = a*x + y over a large buffer.
__global__ void Saxpy(const float* x, float* y, size_t n, float a) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = a * x[i] + y[i];
  }
}

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Wall-clock time (Unix epoch), for matching phases with NVML samples taken by check.py.
double EpochS() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Host work between two launches: a spin on the host clock (a sleep would give the thread away
// and last far longer than a few microseconds).
void HostWork(double us) {
  if (us <= 0) return;
  const double end = NowS() + us * 1e-6;
  while (NowS() < end) {
  }
}

// The job: on one stream, alternating compute- and bandwidth-bound kernels (long mode), or FMA
// kernels only (short mode, with host work between launches).
struct Job {
  cudaStream_t stream = nullptr;
  float* compute_buf = nullptr;
  float* x = nullptr;
  float* y = nullptr;
  int compute_n = 0;
  size_t saxpy_n = 0;
  int iters = 1;
  int blocks = 0;
  bool fma_only = false;
  double host_us = 0;
  long launched = 0;

  void Init(int iters_in) {
    iters = iters_in;
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    blocks = prop.multiProcessorCount * 4;
    compute_n = blocks * 256;
    saxpy_n = size_t{64} << 20;  // 64 Mi floats: 256 MiB per vector
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_OK(cudaMalloc(&compute_buf, compute_n * sizeof(float)));
    CUDA_OK(cudaMalloc(&x, saxpy_n * sizeof(float)));
    CUDA_OK(cudaMalloc(&y, saxpy_n * sizeof(float)));
    CUDA_OK(cudaMemset(compute_buf, 0, compute_n * sizeof(float)));
    CUDA_OK(cudaMemset(x, 0, saxpy_n * sizeof(float)));
    CUDA_OK(cudaMemset(y, 0, saxpy_n * sizeof(float)));
    CUDA_OK(cudaDeviceSynchronize());
  }
  void Launch() {
    if (fma_only || launched % 2 == 0) {
      FmaChain<<<blocks, 256, 0, stream>>>(compute_buf, compute_n, iters);
    } else {
      Saxpy<<<blocks, 256, 0, stream>>>(x, y, saxpy_n, 1.0001f);
    }
    ++launched;
  }
  ~Job() {
    cudaFree(compute_buf);
    cudaFree(x);
    cudaFree(y);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// The manager and the gate through the C API, as a framework front-end would use them.
struct Gated {
  antman_opm* opm = nullptr;
  antman_gate* gate = nullptr;
  int64_t burst_ns = 0;
  explicit Gated(double share, double burst_us = -1) {
    antman_opm_config oc;
    antman_opm_default_config(&oc);
    oc.initial_share = share;
    if (burst_us >= 0) oc.device_burst_ns = std::llround(burst_us * 1000.0);
    burst_ns = oc.device_burst_ns;
    char err[512];
    if (antman_opm_create(&oc, &opm, err, sizeof(err)) != ANTMAN_OK) {
      std::fprintf(stderr, "compute_bench: antman_opm_create: %s\n", err);
      std::exit(1);
    }
    antman_gate_config gc;
    antman_gate_default_config(&gc);
    if (antman_gate_create(opm, &gc, &gate, err, sizeof(err)) != ANTMAN_OK) {
      std::fprintf(stderr, "compute_bench: antman_gate_create: %s\n", err);
      std::exit(1);
    }
  }
  ~Gated() {
    antman_gate_destroy(gate);  // waits for the device to finish every gated op
    antman_opm_destroy(opm);
  }
  template <typename F>
  void Run(cudaStream_t stream, F launch) {
    antman_gate_op* op = nullptr;
    ANTMAN_OK_OR_DIE(antman_gate_begin(gate, stream, &op));
    launch();
    ANTMAN_OK_OR_DIE(antman_gate_end(gate, op));
  }
};

// CUPTI kernel activity records, the share's witness outside the gate. Loaded with dlopen so
// that the bench runs (without this witness) where libcupti is absent.
class Cupti {
 public:
  // Loads libcupti and enables kernel records; false with error() set if it cannot. Must run
  // before the CUDA context is created, so that every kernel of the process is recorded.
  bool Start() {
    const char* env = std::getenv("CUPTI_LIB");
    const char* names[] = {env, "libcupti.so.13", "libcupti.so"};
    for (const char* n : names) {
      if (n == nullptr || *n == '\0') continue;
      lib_ = dlopen(n, RTLD_NOW | RTLD_LOCAL);
      if (lib_ != nullptr) break;
    }
    if (lib_ == nullptr) return Fail(std::string("libcupti not found (CUPTI_LIB, libcupti.so.13): ") + dlerror());
    enable_ = reinterpret_cast<decltype(enable_)>(dlsym(lib_, "cuptiActivityEnable"));
    register_ = reinterpret_cast<decltype(register_)>(dlsym(lib_, "cuptiActivityRegisterCallbacks"));
    flush_ = reinterpret_cast<decltype(flush_)>(dlsym(lib_, "cuptiActivityFlushAll"));
    next_ = reinterpret_cast<decltype(next_)>(dlsym(lib_, "cuptiActivityGetNextRecord"));
    stamp_ = reinterpret_cast<decltype(stamp_)>(dlsym(lib_, "cuptiGetTimestamp"));
    if (!enable_ || !register_ || !flush_ || !next_ || !stamp_) return Fail("libcupti lacks a symbol");
    self_ = this;
    if (register_(&Requested, &Completed) != CUPTI_SUCCESS) return Fail("cuptiActivityRegisterCallbacks failed");
    if (enable_(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
      return Fail("cuptiActivityEnable(CONCURRENT_KERNEL) failed");
    ok_ = true;
    return true;
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  uint64_t Now() {
    uint64_t t = 0;
    if (ok_ && stamp_(&t) != CUPTI_SUCCESS) t = 0;
    return t;
  }
  // Union of the recorded kernels' [start, end) inside [from, to) (ns on CUPTI's clock), after
  // flushing every buffer; -1 without CUPTI.
  int64_t BusyNs(uint64_t from, uint64_t to) {
    if (!ok_) return -1;
    flush_(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::vector<std::pair<uint64_t, uint64_t>> in;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& k : kernels_) {
        const uint64_t a = std::max(k.first, from), b = std::min(k.second, to);
        if (a < b) in.emplace_back(a, b);
      }
    }
    std::sort(in.begin(), in.end());
    uint64_t busy = 0, cur_a = 0, cur_b = 0;
    bool open = false;
    for (const auto& k : in) {
      if (open && k.first <= cur_b) {
        cur_b = std::max(cur_b, k.second);
        continue;
      }
      if (open) busy += cur_b - cur_a;
      cur_a = k.first;
      cur_b = k.second;
      open = true;
    }
    if (open) busy += cur_b - cur_a;
    return static_cast<int64_t>(busy);
  }

 private:
  bool Fail(const std::string& why) {
    error_ = why;
    ok_ = false;
    return false;
  }
  static void CUPTIAPI Requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = 8 << 20;
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
    *max_records = 0;
  }
  static void CUPTIAPI Completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    Cupti* self = self_;
    CUpti_Activity* record = nullptr;
    std::vector<std::pair<uint64_t, uint64_t>> got;
    while (self->next_(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
          record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        got.emplace_back(k->start, k->end);
      }
    }
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->kernels_.insert(self->kernels_.end(), got.begin(), got.end());
    }
    std::free(buffer);
  }

  static Cupti* self_;
  void* lib_ = nullptr;
  bool ok_ = false;
  std::string error_;
  CUptiResult (*enable_)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_)(uint32_t) = nullptr;
  CUptiResult (*next_)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult (*stamp_)(uint64_t*) = nullptr;
  std::mutex mu_;
  std::vector<std::pair<uint64_t, uint64_t>> kernels_;
};
Cupti* Cupti::self_ = nullptr;

// Iterations of FmaChain for about `target_ms` per kernel on this GPU.
int Calibrate(Job& job, double target_ms) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  int iters = 64;
  for (int round = 0; round < 16; ++round) {
    // Several kernels between the events, so that the launch of one does not dominate a
    // ~20 us target.
    constexpr int kReps = 10;
    CUDA_OK(cudaEventRecord(a, job.stream));
    for (int r = 0; r < kReps; ++r)
      FmaChain<<<job.blocks, 256, 0, job.stream>>>(job.compute_buf, job.compute_n, iters);
    CUDA_OK(cudaEventRecord(b, job.stream));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    ms /= kReps;
    if (ms > 0.85 * target_ms && ms < 1.2 * target_ms) break;
    iters = std::max(1, static_cast<int>(iters * target_ms / std::max(ms, 0.0005f)));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return iters;
}

struct Phase {
  double target;
  long kernels;
  double seconds;       // measured part, host clock (launch of the first kernel to the sync)
  double epoch_start;   // the same part, Unix time (for NVML samples)
  double epoch_end;
  int64_t busy_ns;      // CUPTI: union of this process's kernels inside the window; -1 without
  int64_t window_ns;    // CUPTI: the window; -1 without
  double manager;       // the manager's achieved_share_window (comparison only)
};

// Runs the job at `share` for `seconds` after `warmup_s`.
Phase RunPhase(Job& job, Gated& g, Cupti& cupti, double share, double warmup_s, double seconds) {
  ANTMAN_OK_OR_DIE(antman_opm_set_share(g.opm, share));
  double t_end = NowS() + warmup_s;
  while (NowS() < t_end) {
    g.Run(job.stream, [&] { job.Launch(); });
    HostWork(job.host_us);
  }
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const uint64_t c0 = cupti.Now();
  const double epoch_start = EpochS();
  const double t0 = NowS();
  t_end = t0 + seconds;
  long kernels = 0;
  while (NowS() < t_end) {
    g.Run(job.stream, [&] { job.Launch(); });
    HostWork(job.host_us);
    ++kernels;
  }
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double t1 = NowS();
  const uint64_t c1 = cupti.Now();
  const double epoch_end = EpochS();
  ANTMAN_OK_OR_DIE(antman_gate_drain(g.gate));
  antman_opm_stats st;
  ANTMAN_OK_OR_DIE(antman_opm_get_stats(g.opm, &st));
  const int64_t busy = cupti.ok() ? cupti.BusyNs(c0, c1) : -1;
  const int64_t window = cupti.ok() ? static_cast<int64_t>(c1 - c0) : -1;
  return Phase{share, kernels, t1 - t0, epoch_start, epoch_end, busy, window, st.achieved_share_window};
}

int Share(bool quick, double kernel_us, double host_us, double burst_us) {
  Cupti cupti;
  cupti.Start();  // before the context: every kernel of the process gets a record
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // the primary context, which the gate also uses
  Job job;
  job.Init(1);
  const bool short_mode = kernel_us > 0;
  job.fma_only = short_mode;
  job.host_us = host_us;
  job.iters = Calibrate(job, short_mode ? kernel_us / 1000.0 : 0.5);
  Gated g(1.0, burst_us);
  const double seconds = quick ? 1.5 : 4.0;
  const double targets[] = {1.0, 0.25, 0.5, 0.75};  // share 1 first: the job's natural share
  std::string phases = "[";
  for (int i = 0; i < 4; ++i) {
    const Phase p = RunPhase(job, g, cupti, targets[i], 0.3, seconds);
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"target\": %.2f, \"kernels\": %ld, \"seconds\": %.6f, \"epoch\": [%.6f, %.6f], "
                  "\"busy_ns\": %lld, \"window_ns\": %lld, \"manager_share_window\": %.4f}",
                  i ? ", " : "", p.target, p.kernels, p.seconds, p.epoch_start, p.epoch_end,
                  static_cast<long long>(p.busy_ns), static_cast<long long>(p.window_ns), p.manager);
    phases += buf;
  }
  phases += "]";
  antman_gate_stats gs;
  ANTMAN_OK_OR_DIE(antman_gate_get_stats(g.gate, &gs));
  antman_gate_ext_stats ext{};
  antman_gate_get_ext_stats(g.gate, &ext, sizeof(ext));
  std::string cupti_error;
  for (char c : cupti.error()) {
    if (c != '"' && c != '\\' && static_cast<unsigned char>(c) >= 0x20) cupti_error += c;
  }
  std::printf(
      "{\"bench\": \"gpu_compute_share\", \"version\": %d, \"quick\": %s, \"mode\": \"%s\", "
      "\"kernel_us_target\": %.1f, \"host_us\": %.1f, \"fma_iters\": %d, \"cupti\": %s, "
      "\"cupti_error\": %s%s%s, \"phases\": %s, \"gate_ops_completed\": %lld, \"gate_errors\": %lld, "
      "\"gate_anchors\": %lld, \"gate_anchor_uncertainty_ns\": %lld, \"gate_launch_lag_ns\": %lld, "
      "\"gate_host_gap_ns\": %lld, \"gate_launch_lag_untrusted\": %lld, \"device_burst_ns\": %lld}\n",
      kJsonVersion, quick ? "true" : "false", short_mode ? "short" : "long",
      short_mode ? kernel_us : 500.0, host_us, job.iters, cupti.ok() ? "true" : "false",
      cupti.ok() ? "" : "\"", cupti.ok() ? "null" : cupti_error.c_str(), cupti.ok() ? "" : "\"",
      phases.c_str(), static_cast<long long>(gs.ops_completed), static_cast<long long>(gs.errors),
      static_cast<long long>(gs.anchors), static_cast<long long>(gs.anchor_uncertainty_ns),
      static_cast<long long>(ext.launch_lag_ns), static_cast<long long>(ext.host_gap_ns),
      static_cast<long long>(ext.launch_lag_untrusted), static_cast<long long>(g.burst_ns));
  return gs.errors == 0 ? 0 : 1;
}

int Guarantee(int iters, long kernels) {
  Job job;
  job.Init(iters);
  Gated g(1.0);  // the guarantee job at 100%: the gate's unthrottled path
  for (int i = 0; i < 20; ++i) g.Run(job.stream, [&] { job.Launch(); });  // warm-up
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double epoch0 = EpochS();
  const double t0 = NowS();
  for (long i = 0; i < kernels; ++i) g.Run(job.stream, [&] { job.Launch(); });
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double wall = NowS() - t0;
  const double epoch1 = EpochS();
  // The epoch window lets the caller count an opportunist's kernels inside this run alone.
  std::printf("{\"bench\": \"gpu_compute_guarantee\", \"version\": %d, \"kernels\": %ld, "
              "\"wall_s\": %.6f, \"epoch\": [%.6f, %.6f]}\n", kJsonVersion, kernels, wall, epoch0,
              epoch1);
  return 0;
}

std::atomic<bool> g_stop{false};
void OnTerm(int) { g_stop = true; }

int Opportunist(int iters, double share, double burst_us) {
  std::signal(SIGTERM, OnTerm);
  std::signal(SIGINT, OnTerm);
  Job job;
  job.Init(iters);
  // Warm-up at share 1: at share 0 the gate holds every op at its admission, so a warm-up there
  // would never end.
  Gated g(1.0, burst_us);
  for (int i = 0; i < 20; ++i) g.Run(job.stream, [&] { job.Launch(); });
  CUDA_OK(cudaStreamSynchronize(job.stream));
  ANTMAN_OK_OR_DIE(antman_opm_set_share(g.opm, share));
  // A held op (share 0) blocks the loop inside admit, where the flag is not read: on the stop
  // signal this thread opens the gate (share 1) so that the loop sees the flag and ends.
  std::thread waker([&] {
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    antman_opm_set_share(g.opm, 1.0);
  });
  std::printf("READY\nP %.6f 0\n", EpochS());
  std::fflush(stdout);
  const double t0 = NowS();
  long kernels = 0;
  // Progress lines "P <unix time> <kernels launched>" every 50 ms: the caller counts the kernels
  // inside the guarantee job's run (a held op blocks the loop: no line while nothing launches).
  double next_progress = t0;
  while (!g_stop.load()) {
    g.Run(job.stream, [&] { job.Launch(); });
    ++kernels;
    const double now = NowS();
    if (now >= next_progress) {
      std::printf("P %.6f %ld\n", EpochS(), kernels);
      std::fflush(stdout);
      next_progress = now + 0.05;
    }
  }
  const double t_stop = NowS();
  std::printf("P %.6f %ld\n", EpochS(), kernels);
  CUDA_OK(cudaStreamSynchronize(job.stream));
  waker.join();
  antman_opm_stats st;
  ANTMAN_OK_OR_DIE(antman_opm_get_stats(g.opm, &st));
  // kernels launched between READY and the stop: the caller turns them into a busy fraction with
  // the kernel time measured alone (the work this process got done, not the gate's figure).
  std::printf("{\"bench\": \"gpu_compute_opportunist\", \"version\": %d, \"share\": %.3f, "
              "\"kernels\": %ld, \"wall_s\": %.6f, \"manager_share_window\": %.4f, "
              "\"device_burst_ns\": %lld}\n",
              kJsonVersion, share, kernels, t_stop - t0, st.achieved_share_window,
              static_cast<long long>(g.burst_ns));
  return 0;
}

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s probe | share [--quick] [--kernel-us U --host-us H] [--burst-us B] | "
               "guarantee --iters N --kernels K | opportunist --iters N --share S [--burst-us B]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage(argv[0]);
  const std::string mode = argv[1];
  bool quick = false;
  long iters = -1, kernels = -1;
  double share = -1, kernel_us = 0, host_us = 0, burst_us = -1;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--kernels" && i + 1 < argc) {
      kernels = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--share" && i + 1 < argc) {
      share = std::strtod(argv[++i], nullptr);
    } else if (a == "--kernel-us" && i + 1 < argc) {
      kernel_us = std::strtod(argv[++i], nullptr);
    } else if (a == "--host-us" && i + 1 < argc) {
      host_us = std::strtod(argv[++i], nullptr);
    } else if (a == "--burst-us" && i + 1 < argc) {
      burst_us = std::strtod(argv[++i], nullptr);
      if (!(burst_us >= 0 && burst_us <= 1e6)) {
        std::fprintf(stderr, "--burst-us: %s is outside the accepted range [0, 1e6]\n", argv[i]);
        return 2;
      }
    } else {
      return Usage(argv[0]);
    }
  }
  // Arguments first: a usage error is 2 on any machine.
  if (mode != "probe" && mode != "share" && mode != "guarantee" && mode != "opportunist") {
    return Usage(argv[0]);
  }
  if ((mode == "guarantee" || mode == "opportunist") && (iters < 1 || iters > (1 << 30))) {
    std::fprintf(stderr, "--iters: %ld is outside the accepted range [1, 2^30]\n", iters);
    return 2;
  }
  if (mode == "guarantee" && (kernels < 1 || kernels > 100'000'000)) {
    std::fprintf(stderr, "--kernels: %ld is outside the accepted range [1, 1e8]\n", kernels);
    return 2;
  }
  if (mode == "opportunist" && !(share >= 0.0 && share <= 1.0)) {
    std::fprintf(stderr, "--share: %g is outside the accepted range [0, 1]\n", share);
    return 2;
  }
  if (!(kernel_us == 0 || (kernel_us >= 5 && kernel_us <= 10000))) {
    std::fprintf(stderr, "--kernel-us: %g is outside the accepted range [5, 10000]\n", kernel_us);
    return 2;
  }
  if (!(host_us >= 0 && host_us <= 10000)) {
    std::fprintf(stderr, "--host-us: %g is outside the accepted range [0, 10000]\n", host_us);
    return 2;
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("{\"bench\": \"gpu_compute\", \"version\": %d, \"skipped\": \"no CUDA device or "
                "driver: %s\"}\n", kJsonVersion, cudaGetErrorString(e));
    return kSkip;
  }
  // share: CUPTI is started before the context exists (Share), so that every kernel is recorded.
  if (mode == "share") return Share(quick, kernel_us, host_us, burst_us);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // the primary context, which the gate also uses
  if (mode == "probe") return 0;
  if (mode == "guarantee") return Guarantee(static_cast<int>(iters), kernels);
  return Opportunist(static_cast<int>(iters), share, burst_us);
}
