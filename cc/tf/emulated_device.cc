// The emulated device: TF's CPU device standing in for a GPU. Its tensors are
// served by the universal memory of the C core (device budget in host RAM plus
// a separately counted host arena), and every op it runs passes the operator
// manager, so the same memory and compute mechanisms as on a GPU run in TF here.
// Every CPU device TF creates in the process (several logical CPUs included) is
// such a device on the one allocator and the one manager: one budget, one share.
//
// Installed as the "CPU" device factory at a priority above TF's own (60 for
// ThreadPoolDeviceFactory, 70 for GPUCompatibleCPUDeviceFactory in the
// GPU-capable wheel), at configuration time, which Python does before
// `import tensorflow` finishes; TF creates devices lazily afterwards (first
// eager op or first Session), so the factory is in place before device creation.
#include "cc/tf/emulated_device.h"

#include <memory>
#include <string>
#include <vector>

#include "cc/tf/allocator.h"
#include "cc/tf/op_classes.h"
#include "cc/tf/runtime.h"
#include "tensorflow/core/common_runtime/device_factory.h"
#include "tensorflow/core/common_runtime/threadpool_device.h"
#include "tensorflow/core/public/session_options.h"

namespace antman {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernel;
using tensorflow::OpKernelContext;

bool IsWaiting(const OpKernel* kernel) { return IsWaitingKernel(*kernel); }

class EmulatedDevice : public tensorflow::ThreadPoolDevice {
 public:
  EmulatedDevice(const tensorflow::SessionOptions& options, const std::string& name,
                 int64_t capacity, tsl::Allocator* allocator, OpManager* op_manager)
      : ThreadPoolDevice(options, name, tensorflow::Bytes(capacity), tensorflow::DeviceLocality(),
                         allocator),
        op_manager_(op_manager) {}

  // At share 100% the whole added cost is one relaxed load. Throttled, the op
  // is admitted by the manager and then runs right here, on TF's own thread:
  // the manager never runs it, so nothing can deadlock on the manager and TF's
  // threading and floating-point environment stay as they are.
  void Compute(OpKernel* op_kernel, OpKernelContext* context) override {
    if (op_manager_->unthrottled() || IsWaiting(op_kernel)) {
      ThreadPoolDevice::Compute(op_kernel, context);
      return;
    }
    OpManager::ScopedOp admitted(*op_manager_);
    ThreadPoolDevice::Compute(op_kernel, context);
  }

  // Busy from admission until TF's done callback (the kernel's own work; the
  // ops that only wait are not gated at all, see op_classes.h).
  void ComputeAsync(AsyncOpKernel* op_kernel, OpKernelContext* context,
                    AsyncOpKernel::DoneCallback done) override {
    if (op_manager_->unthrottled() || IsWaiting(op_kernel)) {
      ThreadPoolDevice::ComputeAsync(op_kernel, context, std::move(done));
      return;
    }
    OpManager* manager = op_manager_;
    int64_t admitted = manager->Admit();
    ThreadPoolDevice::ComputeAsync(op_kernel, context,
                                   [manager, admitted, done = std::move(done)]() {
                                     manager->Finish(admitted);
                                     done();
                                   });
  }

 private:
  OpManager* op_manager_;
};

class EmulatedDeviceFactory : public tensorflow::DeviceFactory {
 public:
  absl::Status ListPhysicalDevices(std::vector<std::string>* devices) override {
    devices->push_back("/physical_device:CPU:0");
    return absl::OkStatus();
  }

  absl::Status CreateDevices(const tensorflow::SessionOptions& options,
                             const std::string& name_prefix,
                             std::vector<std::unique_ptr<tensorflow::Device>>* devices) override {
    int n = 1;
    auto it = options.config.device_count().find("CPU");
    if (it != options.config.device_count().end()) n = it->second;
    Runtime& rt = Runtime::Get();
    if (n <= 0) return absl::OkStatus();  // device_count {"CPU": 0}: none, as TF's own factory
    if (!rt.configured() || rt.mem() == nullptr || rt.op_manager() == nullptr) {
      // Cannot happen (the factory is registered by Configure, after the memory and the manager
      // exist); if it did, a CPU device outside the budget must not appear silently.
      return absl::InternalError(
          "tf-antman: the emulated device factory ran before the runtime was configured");
    }
    // The job's emulated GPU is one device with one budget and one compute share, whatever
    // number of logical CPU devices TF is asked for (device_count {"CPU": n} in a Session's
    // ConfigProto, or tf.config.set_logical_device_configuration on the CPU, which the eager
    // context turns into the same device_count): every one of them is an EmulatedDevice on
    // the same allocator object and the same operator manager. The allocator is one object for
    // the process, so every device instance (eager context, each Session) draws on the same
    // budget and the limit bounds the job's total; the manager's busy time is the union of all
    // their ops, so the share holds for the job.
    static UniversalTfAllocator* allocator =
        new UniversalTfAllocator(rt.mem(), tsl::AllocatorMemoryType::kHostPageable);
    NoteTfAllocator(allocator);
    for (int i = 0; i < n; ++i) {
      std::string name = name_prefix + "/device:CPU:" + std::to_string(i);
      devices->push_back(std::make_unique<EmulatedDevice>(
          options, name, static_cast<int64_t>(rt.config().device_capacity), allocator,
          rt.op_manager()));
      rt.MarkDeviceCreated();
    }
    return absl::OkStatus();
  }
};

}  // namespace

void RegisterEmulatedDeviceFactory() {
  tensorflow::DeviceFactory::Register("CPU", std::make_unique<EmulatedDeviceFactory>(),
                                      kEmulatedFactoryPriority, /*is_pluggable_device=*/false);
}

}  // namespace antman
