// tf-antman compute gate for PyTorch: a global RecordFunction callback that admits every
// top-level ATen op of the process through the op manager (cc/core/antman_ops.h) and, on a GPU,
// charges the op's kernel time from CUDA events through the gate (cc/core/cuda_gate.h).
//
// Built at run time with torch.utils.cpp_extension (tf_antman/torch/compute.py) against the
// PyTorch of the job: its C++ ABI must match, so no prebuilt binary ships. It must be built with
// NDEBUG, as libtorch is: at::RecordFunction has a debug-only member, and without NDEBUG our view
// of its layout differs from libtorch's (seen on torch 2.13: inputs() then failed its debug
// assertion at random and the callback threw, letting ops through ungated). The core's functions
// are passed in by address from the library instance Python already loaded (no link to it).
// C++17 only: torch 2.11's cpp_extension compiles with -std=c++17 (scripts/check_torch_headers.sh
// checks a release's headers; docs/pytorch.md, "Versions").
//
// Why a global RecordFunction callback (docs/pytorch.md):
//   - global callbacks run on every thread, so ops that autograd's engine runs on its own
//     device threads (the whole backward pass on CUDA) and ops on user threads are gated too;
//     a TorchDispatchMode is per thread and would miss them unless entered on each;
//   - it is switched off while the job runs at share 1: with no callback enabled the dispatcher
//     takes its fast path and nothing of ours runs per op;
//   - only the outermost op on a thread is gated (aten::linear, not the addmm inside it): the
//     events around it cover the kernels of every op it calls.
// Ops the dispatcher never sees are not gated: Triton kernels that torch.compile generates and
// CUDA graph replays (docs/pytorch.md, "What escapes").
#include <torch/extension.h>

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#ifdef ANTMAN_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using AdmitFn = int (*)(void* opm, int timing, int64_t* admitted_ns);
using FinishFn = int (*)(void* opm, int64_t admitted_ns);
using GateBeginFn = int (*)(void* gate, void* stream, void** op);
using GateEndFn = int (*)(void* gate, void* op);
constexpr int kTimingHost = 0;  // ANTMAN_TIMING_HOST

struct Hook {
  void* opm = nullptr;
  void* gate = nullptr;  // device mode only
  AdmitFn admit = nullptr;
  FinishFn finish = nullptr;
  GateBeginFn gate_begin = nullptr;
  GateEndFn gate_end = nullptr;
  c10::DeviceType device_type = c10::DeviceType::CPU;  // ops that touch this type are gated
  bool device_timed = false;
};

Hook g_hook;
std::mutex g_mu;  // install / enable / disable
bool g_installed = false;
bool g_enabled = false;
at::CallbackHandle g_handle = 0;

// Figures for tests and statistics.
std::atomic<int64_t> g_gated{0};          // top-level ops admitted
std::atomic<int64_t> g_nested{0};         // ops inside a gated op (covered by it)
std::atomic<int64_t> g_other_device{0};   // top-level ops that touch no tensor of the device
std::atomic<int64_t> g_errors{0};         // admit/begin/end calls that returned an error
std::atomic<int64_t> g_inspect_errors{0}; // ops whose inputs could not be read (then gated)
std::atomic<int64_t> g_threads{0};        // distinct threads that gated an op
// Shutdown (Python's atexit, before the interpreter frees the op manager and the gate whose raw
// pointers g_hook holds): no op is gated any more, and Shutdown waits for the gated ops in flight.
std::atomic<bool> g_shutdown{false};
std::atomic<int64_t> g_in_flight{0};      // ops between a gating OnStart and its OnEnd
// Gated ops open on this thread. Only an admitted op covers the ops it calls: a wrapper that
// touches no device tensor (autograd's `evaluate_function: XBackward0`, which has no inputs)
// must not, or the whole backward pass ran ungated as "nested".
thread_local int t_gated_depth = 0;
thread_local bool t_counted = false;

struct Ctx : at::ObserverContext {
  int64_t admitted_ns = 0;
  void* gate_op = nullptr;
};

bool OnDevice(const at::Tensor& t, c10::DeviceType type) {
  return t.defined() && t.device().type() == type;
}

// Whether the op reads or creates memory of the gated device type: a tensor argument on it, a
// list holding one, or a device argument of that type (factories such as empty/randn/zeros).
bool TouchesDevice(const at::RecordFunction& fn, c10::DeviceType type) {
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      if (OnDevice(v.toTensor(), type)) return true;
    } else if (v.isDevice()) {
      if (v.toDevice().type() == type) return true;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        if (OnDevice(t, type)) return true;
      }
    } else if (v.isList()) {  // Tensor?[] (index) and other generic lists
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor() && OnDevice(e.toTensor(), type)) return true;
      }
    }
  }
  return false;
}

std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction& fn) {
  if (t_gated_depth > 0) {
    g_nested.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  const Hook& h = g_hook;
  bool touches = true;  // an op we cannot inspect is gated: over-gating is safe, escaping is not
  try {
    touches = TouchesDevice(fn, h.device_type);
  } catch (...) {
    g_inspect_errors.fetch_add(1, std::memory_order_relaxed);
  }
  if (!touches) {
    g_other_device.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  // Counted before the flag is read: Shutdown sets the flag, then waits for the count to drain,
  // so an op either sees the flag or is waited for.
  g_in_flight.fetch_add(1, std::memory_order_seq_cst);
  if (g_shutdown.load(std::memory_order_seq_cst)) {
    g_in_flight.fetch_sub(1);
    return nullptr;
  }
  auto ctx = std::make_unique<Ctx>();
  // Admission may block (the job is over its share, or paused at share 0). An op called with
  // the GIL held (most bindings release it, not all) must not keep it while it waits: the job
  // agent's threads need it to read the control that lets the op go.
  PyThreadState* saved = PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  int rc = 0;
  if (h.device_timed) {
#ifdef ANTMAN_WITH_CUDA
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    rc = h.gate_begin(h.gate, stream, &ctx->gate_op);
#endif
  } else {
    rc = h.admit(h.opm, kTimingHost, &ctx->admitted_ns);
  }
  if (saved != nullptr) PyEval_RestoreThread(saved);
  if (rc != 0) {
    g_errors.fetch_add(1);
    g_in_flight.fetch_sub(1);
    return nullptr;  // not admitted: nothing to end (the op runs ungated, and is counted)
  }
  g_gated.fetch_add(1, std::memory_order_relaxed);
  ++t_gated_depth;  // OnEnd lowers it for this op: the one whose context is not null
  if (!t_counted) {
    t_counted = true;
    g_threads.fetch_add(1, std::memory_order_relaxed);
  }
  return ctx;
}

void OnEnd(const at::RecordFunction& /*fn*/, at::ObserverContext* base) {
  if (base == nullptr) return;  // not gated: nested, other device, or refused
  --t_gated_depth;
  auto* ctx = static_cast<Ctx*>(base);
  const Hook& h = g_hook;
  if (h.device_timed) {
    if (ctx->gate_op != nullptr && h.gate_end(h.gate, ctx->gate_op) != 0) g_errors.fetch_add(1);
  } else if (h.finish(h.opm, ctx->admitted_ns) != 0) {
    g_errors.fetch_add(1);
  }
  g_in_flight.fetch_sub(1);
}

// mode "device": CUDA ops, kernel time from events (needs a build with ANTMAN_WITH_CUDA);
// mode "host": CPU ops, busy from admission to the op's return (emulated device, tests).
void Install(const std::string& mode, int64_t opm, int64_t gate, int64_t admit, int64_t finish,
             int64_t gate_begin, int64_t gate_end) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_installed) throw std::runtime_error("tf-antman op hook: already installed");
  Hook h;
  h.opm = reinterpret_cast<void*>(opm);
  h.gate = reinterpret_cast<void*>(gate);
  h.admit = reinterpret_cast<AdmitFn>(admit);
  h.finish = reinterpret_cast<FinishFn>(finish);
  h.gate_begin = reinterpret_cast<GateBeginFn>(gate_begin);
  h.gate_end = reinterpret_cast<GateEndFn>(gate_end);
  if (mode == "device") {
#ifndef ANTMAN_WITH_CUDA
    throw std::invalid_argument("mode: \"device\" needs the hook built with CUDA");
#endif
    if (h.gate == nullptr || h.gate_begin == nullptr || h.gate_end == nullptr) {
      throw std::invalid_argument("gate, gate_begin, gate_end: must be non-zero in mode \"device\"");
    }
    h.device_type = c10::DeviceType::CUDA;
    h.device_timed = true;
  } else if (mode == "host") {
    if (h.opm == nullptr || h.admit == nullptr || h.finish == nullptr) {
      throw std::invalid_argument("opm, admit, finish: must be non-zero in mode \"host\"");
    }
    h.device_type = c10::DeviceType::CPU;
  } else {
    throw std::invalid_argument("mode: must be \"device\" or \"host\", got \"" + mode + "\"");
  }
  g_hook = h;  // before the callback exists: no op reads it concurrently
  g_handle = at::addGlobalCallback(at::RecordFunctionCallback(&OnStart, &OnEnd)
                                       .needsInputs(true)
                                       .scopes({at::RecordScope::FUNCTION}));
  at::disableCallback(g_handle);  // enabled only while the share is below 1
  g_installed = true;
  g_enabled = false;
}

// Called whenever the share changes: on below 1, off at 1. Other threads see the change at
// their next op (RecordFunction's global callbacks are versioned).
void SetEnabled(bool enabled) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_installed || enabled == g_enabled || (enabled && g_shutdown.load())) return;
  if (enabled) {
    at::reenableCallback(g_handle);
  } else {
    at::disableCallback(g_handle);
  }
  g_enabled = enabled;
}

// For good: no op is gated from now on. Waits (up to timeout_s) for the gated ops in flight to
// end, so that the op manager and the gate can be freed after it; returns how many are still in
// flight (0 unless one outlived the wait). The caller first lets ops waiting for admission go
// (share 1): an op held at share 0 would otherwise be waited for in vain.
int64_t Shutdown(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_shutdown.store(true, std::memory_order_seq_cst);
    if (g_installed && g_enabled) at::disableCallback(g_handle);
    g_enabled = false;
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 0);
  while (g_in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return g_in_flight.load();
}

py::dict Stats() {
  py::dict d;
  d["gated"] = g_gated.load();
  d["nested"] = g_nested.load();
  d["other_device"] = g_other_device.load();
  d["errors"] = g_errors.load();
  d["inspect_errors"] = g_inspect_errors.load();
  d["threads"] = g_threads.load();
  d["in_flight"] = g_in_flight.load();
  d["shutdown"] = g_shutdown.load();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    d["enabled"] = g_enabled;
  }
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tf-antman: gates PyTorch ops through the op manager (global RecordFunction callback)";
  m.def("install", &Install, py::arg("mode"), py::arg("opm"), py::arg("gate"), py::arg("admit"),
        py::arg("finish"), py::arg("gate_begin"), py::arg("gate_end"));
  m.def("set_enabled", &SetEnabled, py::arg("enabled"), py::call_guard<py::gil_scoped_release>());
  m.def("stats", &Stats);
  m.def("shutdown", &Shutdown, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>());
}
