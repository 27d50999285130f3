// tf-antman's allocator for PyTorch's CUDA tensors: a subclass of PyTorch's
// CUDAPluggableAllocator (torch/csrc/cuda/CUDAPluggableAllocator.h) that serves the whole
// allocator contract over libantman_torch.so (cc/torch/allocator_shim.h), installed from C++
// before the first CUDA allocation. Why a subclass, and the torch versions it compiles against:
// docs/pytorch.md, "Memory: the allocator extension".
//
//   - malloc / free: the base class keeps each block's size, device and stream and calls the
//     shim's antman_torch_malloc / antman_torch_free, which reuse blocks in stream order
//     (cc/torch/stream_ordered.h);
//   - recordStream (Tensor.record_stream): passed on to antman_torch_record_stream; the base
//     class drops it unless a callback was set, which PyTorch's Python API cannot do;
//   - getDeviceStats / resetPeakStats / resetAccumulatedStats: the core's figures under
//     PyTorch's fields (cc/torch/torch_stats.h), so torch.cuda.memory_stats(),
//     memory_allocated(), max_memory_allocated(), memory_reserved() and
//     reset_peak_memory_stats() work (the base class raises);
//   - emptyCache: antman_torch_empty_cache on every device served;
//   - beginAllocateToPool (CUDA graph capture, torch.cuda.use_mem_pool): refused with one error
//     before the capture begins (PyTorch calls it before cudaStreamBeginCapture).
//
// Built at run time with torch.utils.cpp_extension against the job's PyTorch, with CUDA
// (tf_antman/torch/compute.py: build_extension); the shim's functions come in by address from
// the library instance Python loaded (no link to it). Compiled in CI against torch 2.14.1+cu130
// (tests/torch/test_cuda_build.py), and against 2.8.0 to 2.13.0 by hand (2.7 and older lack
// register_fork_handler_for_device_init; scripts/check_torch_headers.sh, docs/pytorch.md).
// C++17 only: torch 2.11's cpp_extension uses -std=c++17.
#include <torch/extension.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/utils/device_lazy_init.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace {

using MallocFn = void* (*)(ssize_t size, int device, void* stream);
using FreeFn = void (*)(void* ptr, ssize_t size, int device, void* stream);
using RecordFn = int (*)(void* ptr, int device, void* stream);
using EmptyFn = uint64_t (*)(int device);
using StatsFn = int (*)(int device, int64_t* out);  // antman_torch_device_stats as int64s
using DeviceFn = void (*)(int device);

// antman_torch_device_stats (cc/torch/torch_stats.h): 9 Stats of 4 int64s, then 5 counts.
constexpr int kStats = 9;
constexpr int kCounts = 5;
constexpr int kMaxDevices = 64;  // ANTMAN_TORCH_MAX_DEVICES

constexpr const char* kPoolRefusal =
    "tf-antman: CUDA graph capture and private memory pools (torch.cuda.graph, "
    "torch.cuda.CUDAGraph.capture_begin, torch.cuda.use_mem_pool, torch.compile with "
    "mode=\"reduce-overhead\") are not served by tf-antman's memory for PyTorch: a graph's "
    "replays need its blocks kept out of every other use, which the memory core cannot yet "
    "promise. Refused before the capture began, so nothing ran. Run this job without the "
    "ANTMAN_* variables (tf-antman off), or without CUDA graphs (docs/pytorch.md).";

struct Fns {
  MallocFn malloc = nullptr;
  FreeFn free = nullptr;
  RecordFn record = nullptr;
  EmptyFn empty = nullptr;
  StatsFn stats = nullptr;
  DeviceFn reset_peaks = nullptr;
  DeviceFn reset_accumulated = nullptr;
};

using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
// c10::CachingDeviceAllocator::DeviceStats since torch 2.8, c10::cuda::CUDACachingAllocator's
// before: whatever this torch's base class returns.
using DeviceStats = decltype(std::declval<Base&>().getDeviceStats(c10::DeviceIndex{0}));

template <typename StatArray>
void Fill(StatArray* arr, const int64_t* v) {
  auto& all = (*arr)[0];  // StatType::AGGREGATE ("all"): tf-antman has no small/large pools
  all.current = v[0];
  all.peak = v[1];
  all.allocated = v[2];
  all.freed = v[3];
}

class AntmanAllocator final : public Base {
 public:
  explicit AntmanAllocator(const Fns& f)
      : Base([f](size_t n, int d, cudaStream_t s) { return f.malloc(static_cast<ssize_t>(n), d, s); },
             [f](void* p, size_t n, int d, cudaStream_t s) { f.free(p, static_cast<ssize_t>(n), d, s); }),
        f_(f) {
    set_reset_fn([f] {  // torch.cuda.empty_cache(): every device served
      for (int d = 0; d < kMaxDevices; ++d) f.empty(d);
    });
    set_begin_allocate_to_pool([](int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>) {
      TORCH_CHECK(false, kPoolRefusal);
    });
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) return;  // empty tensors have no block
    f_.record(ptr.get(), ptr.device().index(), stream.stream());
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    int64_t v[kStats * 4 + kCounts] = {0};
    f_.stats(device, v);
    DeviceStats s;
    Fill(&s.allocation, v + 0);
    Fill(&s.segment, v + 4);
    Fill(&s.active, v + 8);
    Fill(&s.inactive_split, v + 12);
    Fill(&s.allocated_bytes, v + 16);
    Fill(&s.reserved_bytes, v + 20);
    Fill(&s.active_bytes, v + 24);
    Fill(&s.inactive_split_bytes, v + 28);
    Fill(&s.requested_bytes, v + 32);
    s.num_alloc_retries = v[36];
    s.num_ooms = v[37];
    s.num_sync_all_streams = v[38];
    s.num_device_alloc = v[39];
    s.num_device_free = v[40];
    return s;
  }

  void resetPeakStats(c10::DeviceIndex device) override { f_.reset_peaks(device); }
  void resetAccumulatedStats(c10::DeviceIndex device) override { f_.reset_accumulated(device); }
  std::string name() override { return "tf-antman"; }

 private:
  Fns f_;
};

std::mutex g_mu;
bool g_installed = false;

template <typename F>
F As(int64_t address, const char* field) {
  TORCH_CHECK(address != 0, "tf-antman allocator: ", field, " must be a non-zero function address");
  return reinterpret_cast<F>(address);
}

// Makes the allocator PyTorch's for CUDA tensors. PyTorch refuses once its own allocator has
// served (CUDA initialised): the Python side checks that first, with a clearer message.
void Install(int64_t malloc_fn, int64_t free_fn, int64_t record_fn, int64_t empty_fn,
             int64_t stats_fn, int64_t reset_peaks_fn, int64_t reset_accumulated_fn) {
  std::lock_guard<std::mutex> lock(g_mu);
  TORCH_CHECK(!g_installed, "tf-antman allocator: already installed");
  Fns f;
  f.malloc = As<MallocFn>(malloc_fn, "malloc_fn");
  f.free = As<FreeFn>(free_fn, "free_fn");
  f.record = As<RecordFn>(record_fn, "record_fn");
  f.empty = As<EmptyFn>(empty_fn, "empty_fn");
  f.stats = As<StatsFn>(stats_fn, "stats_fn");
  f.reset_peaks = As<DeviceFn>(reset_peaks_fn, "reset_peaks_fn");
  f.reset_accumulated = As<DeviceFn>(reset_accumulated_fn, "reset_accumulated_fn");
  auto allocator = std::make_shared<AntmanAllocator>(f);
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  // tf-antman's memory core has initialised the CUDA driver (cuInit, primary context) before
  // PyTorch did, and PyTorch registers its fork guard only at its own lazy CUDA init: a forked
  // child (a DataLoader worker) that touched CUDA would meet an undefined driver state instead of
  // PyTorch's "Cannot re-initialize CUDA in forked subprocess". Register the same guard now.
  torch::utils::register_fork_handler_for_device_init(at::kCUDA);
  g_installed = true;
}

std::string CurrentName() { return c10::cuda::CUDACachingAllocator::get()->name(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tf-antman: PyTorch's CUDA allocator over tf-antman's memory cores";
  m.def("install", &Install, py::arg("malloc_fn"), py::arg("free_fn"), py::arg("record_fn"),
        py::arg("empty_fn"), py::arg("stats_fn"), py::arg("reset_peaks_fn"),
        py::arg("reset_accumulated_fn"));
  m.def("current_name", &CurrentName);
}
