// tf-antman's GPU device for TensorFlow 2.21: TF's own BaseGPUDevice (streams,
// kernels, copies, Eigen, XLA launch all unchanged) with two differences:
//   memory: device tensors come from the universal allocator over the CUDA
//           backend of the core (device memory up to the job's limit, pinned
//           device-mapped host memory past it);
//   compute: every op that works (op_classes.h) is admitted by the operator
//           manager before its launch and charged with device time after it.
//
// Installed as the "GPU" device factory above TF's GPUDeviceFactory (210) at
// configuration time, before TF creates devices. BaseGPUDeviceFactory does
// everything TF does (visible devices, virtual devices, peer access, ids,
// localities) and calls the private virtual CreateGPUDevice once per device;
// that is the one method overridden. The GPUBFCAllocator TF builds for each
// device before that call is never handed out and reserves nothing (a BFC
// allocates on first use; docs/gpu-path.md, "TF's own GPU allocator").
//
// This file needs GOOGLE_CUDA=1 (gpu_device.h refuses otherwise; the pinned
// wheel is a CUDA build) but no CUDA header or library: everything CUDA goes
// through TF's stream executor or the core's dlopen'ed driver, so the library
// loads on machines without a GPU.
#include "cc/tf/gpu_device.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cc/core/cuda_gate_internal.h"
#include "cc/tf/allocator.h"
#include "cc/tf/device_timer.h"
#include "cc/tf/gpu_options.h"
#include "cc/tf/op_classes.h"
#include "cc/tf/runtime.h"
#include "tensorflow/core/common_runtime/device_factory.h"
#include "tensorflow/core/common_runtime/gpu/gpu_device.h"
#include "tensorflow/core/common_runtime/gpu/gpu_event_mgr.h"
#include "tensorflow/core/common_runtime/gpu/gpu_id_manager.h"
#include "tensorflow/core/common_runtime/gpu/gpu_process_state.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/public/session_options.h"

namespace antman {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernel;
using tensorflow::OpKernelContext;

std::atomic<int> g_kind{0};
std::atomic<int> g_list_calls{0};
std::atomic<int> g_create_calls{0};
std::atomic<int> g_devices{0};
tensorflow::DeviceFactory* g_factory = nullptr;  // owned by TF's registry

// ANTMAN_DEVICE=cuda, and TF made no GPU device, so the job runs on TF's CPU device, which
// tf-antman does not manage. Either TF could not use the GPU (a wheel without its CUDA
// libraries, a CUDA it cannot load; TF says "Skipping registering GPU devices": it then lists
// no physical GPU either), or the job's configuration hid the GPUs TF sees
// (tf.config.set_visible_devices, a session's device_count). Said once per process, loudly:
// the job would otherwise look managed while its limit and share apply to nothing.
void WarnUnmanaged(int physical_gpus) {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  const char* const tail =
      ": this job runs on the CPU, and tf-antman's memory limit and compute share do not apply "
      "to it (docs/gpu-path.md)";
  if (physical_gpus > 0) {
    LOG(WARNING) << "tf-antman: ANTMAN_DEVICE=cuda, but TensorFlow created no GPU device: it sees "
                 << physical_gpus << " GPU(s), which the job's configuration hides "
                 << "(tf.config.set_visible_devices, a session's device_count)" << tail;
  } else {
    LOG(ERROR) << "tf-antman: ANTMAN_DEVICE=cuda, but TensorFlow created no GPU device and sees "
                  "no GPU (see its log above: a wheel without its CUDA libraries, e.g. not "
                  "tensorflow[and-cuda], or CUDA libraries it could not load)"
               << tail;
  }
}

bool IsWaiting(const OpKernel* kernel) { return IsWaitingKernel(*kernel); }

// Device time from TF's event manager: an event recorded on the compute stream
// after the launch, polled by TF's own thread (the mechanism TF uses to free
// tensors). It tells when the stream passed the op, not when its kernels
// started: StreamOccupancy derives the interval (device_timer.h). The fallback
// when the core's CUDA gate cannot be created (docs/gpu-path.md, "Device time").
class EventMgrTimer final : public DeviceTimer {
 public:
  EventMgrTimer(tensorflow::EventMgr* em, stream_executor::Stream* stream)
      : em_(em), stream_(stream) {}

  int64_t Before(void* /*stream*/) override { return SystemClock()->NowNs(); }

  void After(int64_t launch_ns, void* /*stream*/, Done done) override {
    em_->ThenExecute(stream_, [this, launch_ns, done = std::move(done)]() {
      StreamOccupancy::Interval busy = occupancy_.Complete(launch_ns, SystemClock()->NowNs());
      done(busy.start_ns, busy.end_ns);
    });
  }

 private:
  tensorflow::EventMgr* const em_;
  stream_executor::Stream* const stream_;
  StreamOccupancy occupancy_;
};

// Device time from the core's CUDA event gate (cc/core/cuda_gate.*) in its
// timing-only mode: start and end events around the launch on the compute
// stream, the kernels' own interval placed on the manager's clock by the
// gate's poller. DeviceOpGate admits and charges; the gate only times.
class CudaGateTimer final : public DeviceTimer {
 public:
  explicit CudaGateTimer(std::unique_ptr<CudaGate> gate) : gate_(std::move(gate)) {}

  int64_t Before(void* stream) override {
    CudaGate::Op* op = nullptr;
    std::string err;
    gate_->BeginTimed(stream, &op, &err);  // a failed begin still yields an op: done(0, 0)
    return static_cast<int64_t>(reinterpret_cast<intptr_t>(op));
  }

  void After(int64_t token, void* /*stream*/, Done done) override {
    auto* op = reinterpret_cast<CudaGate::Op*>(static_cast<intptr_t>(token));
    if (op == nullptr) {  // not expected; keep the manager's pending count right
      done(0, 0);
      return;
    }
    std::string err;
    gate_->EndTimed(op, std::move(done), &err);
  }

 private:
  std::unique_ptr<CudaGate> gate_;
};

// The exact timer when the driver allows it, else TF's event manager.
std::unique_ptr<DeviceTimer> MakeTimer(OpManager* manager, int ordinal, tensorflow::EventMgr* em,
                                       stream_executor::Stream* stream) {
  std::string err;
  const GateDriver* driver = LoadGateDriver(&err);
  if (driver != nullptr) {
    CudaGate::Options options;
    options.device_ordinal = ordinal;
    int code = 0;
    std::unique_ptr<CudaGate> gate = CudaGate::Create(manager, options, driver, &err, &code);
    if (gate != nullptr) return std::make_unique<CudaGateTimer>(std::move(gate));
  }
  LOG(WARNING) << "tf-antman: GPU " << ordinal << " times ops with TF's event manager "
               << "(stream occupancy), not CUDA events: " << err;
  return std::make_unique<EventMgrTimer>(em, stream);
}

// What outlives TF's device objects (one per eager context or Session): the
// allocator of each GPU and the timer and gate of each compute stream. Device
// time callbacks may still be pending when a Session closes.
struct GpuState {
  std::mutex mu;
  std::map<int, std::unique_ptr<UniversalTfAllocator>> allocators;  // by ordinal
  std::map<stream_executor::Stream*, std::unique_ptr<DeviceTimer>> timers;
  std::map<stream_executor::Stream*, std::unique_ptr<DeviceOpGate>> gates;
};
GpuState& State() {
  static GpuState* state = new GpuState();  // never destroyed, like TF's stream groups
  return *state;
}

// Serves nothing: used when the universal memory of a GPU could not be
// created, so the device fails at its first allocation with our reason in
// the message (TF embeds the allocator's name) instead of running on memory
// outside the job's limit.
class RefusingAllocator final : public tsl::Allocator {
 public:
  explicit RefusingAllocator(std::string why) : name_("antman_unavailable: " + std::move(why)) {}
  std::string Name() override { return name_; }
  void* AllocateRaw(size_t, size_t) override { return nullptr; }
  void DeallocateRaw(void*) override {}

 private:
  std::string name_;
};

class AntmanGpuDevice final : public tensorflow::BaseGPUDevice {
 public:
  AntmanGpuDevice(const tensorflow::SessionOptions& options, const std::string& name,
                  tensorflow::Bytes memory_limit, const tensorflow::DeviceLocality& locality,
                  tsl::TfDeviceId tf_device_id, const std::string& physical_device_desc,
                  tsl::Allocator* gpu_allocator, tsl::Allocator* cpu_allocator,
                  OpManager* op_manager, int ordinal)
      : BaseGPUDevice(options, name, memory_limit, locality, tf_device_id, physical_device_desc,
                      gpu_allocator, cpu_allocator, /*sync_every_op=*/false),
        gpu_options_(options.config.gpu_options()),
        force_gpu_compatible_(options.config.gpu_options().force_gpu_compatible()),
        op_manager_(op_manager),
        ordinal_(ordinal) {}

  // As TF's GPUDevice: host memory that DMA touches is TF's pinned host
  // allocator, other host memory the CPU allocator, device memory ours.
  tsl::Allocator* GetAllocator(tsl::AllocatorAttributes attr) override {
    if (attr.on_host()) {
      if (attr.gpu_compatible() || force_gpu_compatible_) {
        return tensorflow::GPUProcessState::singleton()->GetGpuHostAllocator(gpu_options_, 0);
      }
      return cpu_allocator_;
    }
    return gpu_allocator_;
  }

  // At share 100% the added cost is one relaxed load. Throttled, the op is
  // admitted (waiting for time, or for room among the launches pending on the
  // device), launched right here on TF's thread, and charged when the device
  // has run it.
  void Compute(OpKernel* op_kernel, OpKernelContext* context) override {
    if (op_manager_ == nullptr || op_manager_->unthrottled() || IsWaiting(op_kernel)) {
      BaseGPUDevice::Compute(op_kernel, context);
      return;
    }
    DeviceOpGate* gate = Gate();
    gate->Run(stream_handle_.load(std::memory_order_relaxed), [&] { BaseGPUDevice::Compute(op_kernel, context); });
  }

  // An async kernel has launched its work when it calls `done`.
  void ComputeAsync(AsyncOpKernel* op_kernel, OpKernelContext* context,
                    AsyncOpKernel::DoneCallback done) override {
    if (op_manager_ == nullptr || op_manager_->unthrottled() || IsWaiting(op_kernel)) {
      BaseGPUDevice::ComputeAsync(op_kernel, context, std::move(done));
      return;
    }
    DeviceOpGate* gate = Gate();
    void* stream = stream_handle_.load(std::memory_order_relaxed);
    DeviceOpGate::Admitted admitted = gate->Admit(stream);
    BaseGPUDevice::ComputeAsync(op_kernel, context,
                                [gate, admitted, stream, done = std::move(done)]() {
                                  gate->Launched(admitted, stream);
                                  done();
                                });
  }

 private:
  // The compute stream exists only after Init(), which TF calls after
  // CreateGPUDevice returns: resolve the gate on first use.
  DeviceOpGate* Gate() {
    DeviceOpGate* gate = gate_.load(std::memory_order_acquire);
    if (gate != nullptr) return gate;
    stream_executor::Stream* stream = compute_stream();
    GpuState& state = State();
    std::lock_guard<std::mutex> lock(state.mu);
    std::unique_ptr<DeviceOpGate>& slot = state.gates[stream];
    if (slot == nullptr) {
      std::unique_ptr<DeviceTimer> timer = MakeTimer(
          op_manager_, ordinal_,
          tensorflow::EventMgrFactory::Singleton()->GetEventMgr(executor(), gpu_options_), stream);
      slot = std::make_unique<DeviceOpGate>(op_manager_, timer.get());
      state.timers[stream] = std::move(timer);
    }
    stream_handle_.store(stream->platform_specific_handle().stream, std::memory_order_relaxed);
    gate_.store(slot.get(), std::memory_order_release);
    return slot.get();
  }

  const tensorflow::GPUOptions gpu_options_;
  const bool force_gpu_compatible_;
  OpManager* const op_manager_;
  const int ordinal_;  // CUDA ordinal (CUDA_VISIBLE_DEVICES numbering)
  std::atomic<DeviceOpGate*> gate_{nullptr};
  std::atomic<void*> stream_handle_{nullptr};  // the CUstream, for a timer that records CUDA events
};

class AntmanGpuDeviceFactory final : public tensorflow::BaseGPUDeviceFactory {
 public:
  absl::Status ListPhysicalDevices(std::vector<std::string>* devices) override {
    g_list_calls.fetch_add(1);
    return BaseGPUDeviceFactory::ListPhysicalDevices(devices);
  }

  absl::Status CreateDevices(const tensorflow::SessionOptions& options,
                             const std::string& name_prefix,
                             std::vector<std::unique_ptr<tensorflow::Device>>* devices) override {
    g_create_calls.fetch_add(1);
    // Before TF builds anything for the GPUs: options tf-antman cannot honour are refused in one
    // line (the error of the first op, or of the Session's creation).
    std::string refused = RefusedGpuOptions(options.config.gpu_options());
    if (!refused.empty()) return absl::InvalidArgumentError(refused);
    absl::Status status = BaseGPUDeviceFactory::CreateDevices(options, name_prefix, devices);
    {
      // A GPU whose memory could not be created fails device creation with the reason (the
      // error of the first op or of the Session), rather than later at its first allocation
      // (BaseGPUDevice's scratch buffers fail with a message that does not name the allocator).
      std::lock_guard<std::mutex> lock(State().mu);
      if (status.ok() && !no_memory_.empty()) {
        status = absl::FailedPreconditionError(no_memory_);
      }
      no_memory_.clear();
    }
    if (status.ok() && g_devices.load() == 0) {
      std::vector<std::string> physical;  // TF's own listing, not counted as a list call of ours
      const bool listed = BaseGPUDeviceFactory::ListPhysicalDevices(&physical).ok();
      WarnUnmanaged(listed ? static_cast<int>(physical.size()) : 0);
    }
    return status;
  }

 private:
  std::string no_memory_;  // the first GPU without memory in this CreateDevices; State().mu

  // `tf_gpu_allocator` is the GPUBFCAllocator TF made for this device: unused.
  std::unique_ptr<tensorflow::BaseGPUDevice> CreateGPUDevice(
      const tensorflow::SessionOptions& options, const std::string& name,
      tensorflow::Bytes tf_memory_limit, const tensorflow::DeviceLocality& locality,
      tsl::TfDeviceId tf_device_id, const std::string& physical_device_desc,
      tsl::Allocator* /*tf_gpu_allocator*/, tsl::Allocator* cpu_allocator) override {
    tsl::PlatformDeviceId platform_id;
    absl::Status id_status = tensorflow::GpuIdManager::TfToPlatformDeviceId(tf_device_id,
                                                                            &platform_id);
    antman_mem* mem = nullptr;
    OpManager* op_manager = nullptr;
    // TF's own limit for this device (its allocator's bytes_limit, from its memory options and
    // system reserve) is the memory's capacity unless ANTMAN_DEVICE_MEMORY is lower.
    std::string note;
    std::string why = id_status.ok() ? Runtime::Get().CudaDevice(platform_id.value(),
                                                                 tf_memory_limit.value(), &mem,
                                                                 &op_manager, &note)
                                     : std::string(id_status.message());
    if (!note.empty()) LOG(WARNING) << note;
    tsl::Allocator* allocator = nullptr;
    int64_t limit = tf_memory_limit.value();
    GpuState& state = State();
    {
      std::lock_guard<std::mutex> lock(state.mu);
      if (why.empty()) {
        std::unique_ptr<UniversalTfAllocator>& a = state.allocators[platform_id.value()];
        if (a == nullptr) {
          a = std::make_unique<UniversalTfAllocator>(mem, tsl::AllocatorMemoryType::kDevice);
          NoteTfAllocator(a.get());
        }
        allocator = a.get();
        antman_mem_stats stats;
        antman_mem_get_stats(mem, &stats);
        limit = static_cast<int64_t>(stats.limit);
      } else {
        LOG(ERROR) << "tf-antman: " << name << " has no memory under tf-antman: " << why;
        if (no_memory_.empty()) {
          no_memory_ = "tf-antman: " + name + " has no memory under tf-antman: " + why;
        }
        // Kept as a second guard should the device be used anyway.
        allocator = new RefusingAllocator(why);  // leaked: TF's device keeps a raw pointer
      }
    }
    g_devices.fetch_add(1);
    Runtime::Get().MarkDeviceCreated();
    return std::make_unique<AntmanGpuDevice>(options, name, tensorflow::Bytes(limit), locality,
                                             tf_device_id, physical_device_desc, allocator,
                                             cpu_allocator, op_manager,
                                             id_status.ok() ? platform_id.value() : 0);
  }
};

class HiddenGpuFactory final : public tensorflow::DeviceFactory {
 public:
  absl::Status ListPhysicalDevices(std::vector<std::string>* /*devices*/) override {
    g_list_calls.fetch_add(1);
    return absl::OkStatus();
  }
  absl::Status CreateDevices(const tensorflow::SessionOptions& /*options*/,
                             const std::string& /*name_prefix*/,
                             std::vector<std::unique_ptr<tensorflow::Device>>* /*devices*/)
      override {
    g_create_calls.fetch_add(1);
    return absl::OkStatus();
  }
};

void Register(std::unique_ptr<tensorflow::DeviceFactory> factory, int kind) {
  g_factory = factory.get();
  g_kind = kind;
  tensorflow::DeviceFactory::Register("GPU", std::move(factory), kGpuFactoryPriority,
                                      /*is_pluggable_device=*/false);
}

}  // namespace

void RegisterGpuDeviceFactory() { Register(std::make_unique<AntmanGpuDeviceFactory>(), 1); }

void RegisterHiddenGpuFactory() { Register(std::make_unique<HiddenGpuFactory>(), 2); }

GpuFactoryStats GetGpuFactoryStats() {
  GpuFactoryStats s;
  s.kind = g_kind.load();
  s.registered = g_factory != nullptr &&
                 tensorflow::DeviceFactory::GetFactory("GPU") == g_factory ? 1 : 0;
  s.list_calls = g_list_calls.load();
  s.create_calls = g_create_calls.load();
  s.devices = g_devices.load();
  return s;
}

}  // namespace antman
