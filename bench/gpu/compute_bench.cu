// bench/gpu compute half: real kernels on one CUDA stream, gated by the op manager through the
// CUDA event gate of libantman_core.so (C API: cc/core/antman_ops.h, cc/core/cuda_gate.h).
// No TensorFlow, no Bazel: bench/gpu/build_compute.sh builds it, bench/gpu/run.py drives it.
//
//   compute_bench probe                       exit 0 if a CUDA device is usable, else 77
//   compute_bench share [--quick]             achieved share at 25/50/75% (one JSON line)
//   compute_bench guarantee --iters N --kernels K
//                                             K kernels at share 1: wall time (one JSON line)
//   compute_bench opportunist --iters N --share S
//                                             kernels at share S until SIGTERM; prints READY
//                                             once running, a JSON line at the end
//
// The share is measured independently of the manager: the bench records its own CUDA events
// right around every kernel (inside the gate's) and divides the sum of the kernels' event
// intervals by the span from the first kernel's start to the last kernel's end. The manager's
// own figure is printed beside it for comparison only.
// Exit status: 0 done, 1 a failed check or CUDA error, 2 usage, 77 no CUDA device or driver.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cc/core/antman_ops.h"
#include "cc/core/cuda_gate.h"

namespace {

constexpr int kSkip = 77;
constexpr int kJsonVersion = 1;

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

// Wall-clock time (Unix epoch), for matching phases with NVML samples taken by run.py.
double EpochS() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The job: alternating compute- and bandwidth-bound kernels on one stream.
struct Job {
  cudaStream_t stream = nullptr;
  float* compute_buf = nullptr;
  float* x = nullptr;
  float* y = nullptr;
  int compute_n = 0;
  size_t saxpy_n = 0;
  int iters = 1;
  int blocks = 0;
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
    if (launched++ % 2 == 0) {
      FmaChain<<<blocks, 256, 0, stream>>>(compute_buf, compute_n, iters);
    } else {
      Saxpy<<<blocks, 256, 0, stream>>>(x, y, saxpy_n, 1.0001f);
    }
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
  explicit Gated(double share) {
    antman_opm_config oc;
    antman_opm_default_config(&oc);
    oc.initial_share = share;
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

// Iterations of FmaChain for about `target_ms` per kernel on this GPU.
int Calibrate(Job& job, double target_ms) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  int iters = 1024;
  for (int round = 0; round < 12; ++round) {
    CUDA_OK(cudaEventRecord(a, job.stream));
    FmaChain<<<job.blocks, 256, 0, job.stream>>>(job.compute_buf, job.compute_n, iters);
    CUDA_OK(cudaEventRecord(b, job.stream));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    if (ms > 0.8 * target_ms && ms < 1.25 * target_ms) break;
    iters = std::max(1, static_cast<int>(iters * target_ms / std::max(ms, 0.001f)));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return iters;
}

struct Phase {
  double achieved;      // sum of kernel event intervals / span (the bench's own events)
  double manager;       // the manager's achieved_share_window (comparison only)
  long kernels;
  double mean_kernel_ms;
  double epoch_start;   // measured part of the phase, Unix time
  double epoch_end;
};

// Runs the job at `share` for `seconds` after `warmup_s`, timing every kernel with its own events.
Phase RunPhase(Job& job, Gated& g, double share, double warmup_s, double seconds) {
  ANTMAN_OK_OR_DIE(antman_opm_set_share(g.opm, share));
  double t_end = NowS() + warmup_s;
  while (NowS() < t_end) g.Run(job.stream, [&] { job.Launch(); });
  std::vector<cudaEvent_t> ev;
  ev.reserve(1 << 16);
  const double epoch_start = EpochS();
  t_end = NowS() + seconds;
  while (NowS() < t_end && ev.size() + 2 <= (size_t{1} << 16)) {
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    g.Run(job.stream, [&] {
      CUDA_OK(cudaEventRecord(a, job.stream));
      job.Launch();
      CUDA_OK(cudaEventRecord(b, job.stream));
    });
    ev.push_back(a);
    ev.push_back(b);
  }
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double epoch_end = EpochS();
  ANTMAN_OK_OR_DIE(antman_gate_drain(g.gate));
  antman_opm_stats st;
  ANTMAN_OK_OR_DIE(antman_opm_get_stats(g.opm, &st));
  double busy_ms = 0;
  for (size_t i = 0; i < ev.size(); i += 2) {
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    busy_ms += ms;
  }
  float span_ms = 0;
  CUDA_OK(cudaEventElapsedTime(&span_ms, ev.front(), ev.back()));
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  const long kernels = static_cast<long>(ev.size() / 2);
  return Phase{busy_ms / span_ms, st.achieved_share_window, kernels, busy_ms / kernels,
               epoch_start, epoch_end};
}

int Share(bool quick) {
  Job job;
  job.Init(1);
  job.iters = Calibrate(job, 0.5);
  Gated g(1.0);
  const double seconds = quick ? 1.5 : 4.0;
  // share 1 first: the job's natural share (it cannot be held above what it uses by itself).
  Phase natural = RunPhase(job, g, 1.0, 0.3, seconds);
  const double targets[] = {0.25, 0.5, 0.75};
  std::string achieved = "[", manager = "[", kernels = "[";
  char span[128];
  std::snprintf(span, sizeof(span), "[[%.6f, %.6f]", natural.epoch_start, natural.epoch_end);
  std::string phases = span;
  double worst = 0;
  for (int i = 0; i < 3; ++i) {
    Phase p = RunPhase(job, g, targets[i], 0.3, seconds);
    const double expected = std::min(targets[i], natural.achieved);
    worst = std::max(worst, 100.0 * std::fabs(p.achieved - expected));
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%s%.4f", i ? ", " : "", p.achieved);
    achieved += buf;
    std::snprintf(buf, sizeof(buf), "%s%.4f", i ? ", " : "", p.manager);
    manager += buf;
    std::snprintf(buf, sizeof(buf), "%s%ld", i ? ", " : "", p.kernels);
    kernels += buf;
    std::snprintf(span, sizeof(span), ", [%.6f, %.6f]", p.epoch_start, p.epoch_end);
    phases += span;
  }
  antman_gate_stats gs;
  ANTMAN_OK_OR_DIE(antman_gate_get_stats(g.gate, &gs));
  std::printf(
      "{\"bench\": \"gpu_compute_share\", \"version\": %d, \"quick\": %s, "
      "\"share_targets\": [0.25, 0.5, 0.75], \"share_achieved\": %s], "
      "\"share_error_points_max\": %.3f, \"natural_share\": %.4f, \"mean_kernel_ms\": %.4f, "
      "\"fma_iters\": %d, \"kernels\": %s], \"manager_share_window\": %s], "
      "\"gate_ops_completed\": %lld, \"gate_errors\": %lld, \"gate_anchors\": %lld, "
      "\"gate_anchor_uncertainty_ns\": %lld, \"phase_epoch_s\": %s]}\n",
      kJsonVersion, quick ? "true" : "false", achieved.c_str(), worst, natural.achieved,
      natural.mean_kernel_ms, job.iters, kernels.c_str(), manager.c_str(),
      static_cast<long long>(gs.ops_completed), static_cast<long long>(gs.errors),
      static_cast<long long>(gs.anchors), static_cast<long long>(gs.anchor_uncertainty_ns),
      phases.c_str());
  return gs.errors == 0 ? 0 : 1;
}

int Guarantee(int iters, long kernels) {
  Job job;
  job.Init(iters);
  Gated g(1.0);  // the guarantee job at 100%: the gate's unthrottled path
  for (int i = 0; i < 20; ++i) g.Run(job.stream, [&] { job.Launch(); });  // warm-up
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double t0 = NowS();
  for (long i = 0; i < kernels; ++i) g.Run(job.stream, [&] { job.Launch(); });
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double wall = NowS() - t0;
  std::printf("{\"bench\": \"gpu_compute_guarantee\", \"version\": %d, \"kernels\": %ld, "
              "\"wall_s\": %.6f}\n", kJsonVersion, kernels, wall);
  return 0;
}

std::atomic<bool> g_stop{false};
void OnTerm(int) { g_stop = true; }

int Opportunist(int iters, double share) {
  std::signal(SIGTERM, OnTerm);
  std::signal(SIGINT, OnTerm);
  Job job;
  job.Init(iters);
  Gated g(share);
  for (int i = 0; i < 20; ++i) g.Run(job.stream, [&] { job.Launch(); });
  CUDA_OK(cudaStreamSynchronize(job.stream));
  std::printf("READY\n");
  std::fflush(stdout);
  const double t0 = NowS();
  long kernels = 0;
  while (!g_stop.load()) {
    g.Run(job.stream, [&] { job.Launch(); });
    ++kernels;
  }
  CUDA_OK(cudaStreamSynchronize(job.stream));
  const double wall = NowS() - t0;
  antman_opm_stats st;
  ANTMAN_OK_OR_DIE(antman_opm_get_stats(g.opm, &st));
  std::printf("{\"bench\": \"gpu_compute_opportunist\", \"version\": %d, \"share\": %.3f, "
              "\"kernels\": %ld, \"kernels_per_s\": %.2f, \"manager_share_window\": %.4f}\n",
              kJsonVersion, share, kernels, kernels / wall, st.achieved_share_window);
  return 0;
}

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s probe | share [--quick] | guarantee --iters N --kernels K | "
               "opportunist --iters N --share S\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage(argv[0]);
  const std::string mode = argv[1];
  bool quick = false;
  long iters = -1, kernels = -1;
  double share = -1;
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
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("{\"bench\": \"gpu_compute\", \"version\": %d, \"skipped\": \"no CUDA device or "
                "driver: %s\"}\n", kJsonVersion, cudaGetErrorString(e));
    return kSkip;
  }
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // the primary context, which the gate also uses
  if (mode == "probe") return 0;
  if (mode == "share") return Share(quick);
  if (mode == "guarantee") return Guarantee(static_cast<int>(iters), kernels);
  return Opportunist(static_cast<int>(iters), share);
}
