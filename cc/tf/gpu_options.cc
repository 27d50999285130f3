#include "cc/tf/gpu_options.h"

#include <algorithm>

#include "tensorflow/core/protobuf/config.pb.h"

namespace antman {
namespace {

constexpr char kTail[] = " (docs/gpu-path.md, \"TF's GPU options\")";

std::string Bytes(uint64_t n) { return std::to_string(n) + " bytes"; }

}  // namespace

std::string RefusedGpuOptions(const tensorflow::GPUOptions& gpu) {
  const auto& x = gpu.experimental();
  for (int i = 0; i < x.virtual_devices_size(); ++i) {
    const int n = x.virtual_devices(i).memory_limit_mb_size();
    if (n > 1) {
      return "tf-antman: several logical devices on one GPU are not supported: GPU " +
             std::to_string(i) + " of the visible list is split into " + std::to_string(n) +
             " (tf.config.set_logical_device_configuration, or GPUOptions.experimental."
             "virtual_devices); tf-antman keeps one memory per GPU, which logical devices' "
             "separate streams must not share. Use one logical device per GPU" + kTail;
    }
  }
  if (x.num_virtual_devices_per_gpu() > 1) {
    return "tf-antman: several logical devices on one GPU are not supported: "
           "GPUOptions.experimental.num_virtual_devices_per_gpu=" +
           std::to_string(x.num_virtual_devices_per_gpu()) + "; use 1" + kTail;
  }
  if (x.use_cuda_malloc_async()) {
    return "tf-antman: GPUOptions.experimental.use_cuda_malloc_async is not supported: tf-antman "
           "serves the GPU's memory itself, and TF's cudaMallocAsync allocator would take memory "
           "outside the job's limit; leave it unset" + std::string(kTail);
  }
  if (x.timestamped_allocator()) {
    return "tf-antman: GPUOptions.experimental.timestamped_allocator is not supported: tf-antman's "
           "allocator does not delay reuse by TF's freed-by timestamps, so a pending copy could "
           "overwrite memory in use; leave it unset" + std::string(kTail);
  }
  return "";
}

GpuMemoryPlan PlanGpuMemory(uint64_t antman_capacity, uint64_t antman_limit, int64_t tf_limit) {
  GpuMemoryPlan plan;
  plan.capacity = antman_capacity;
  plan.limit = antman_limit;
  if (tf_limit <= 0) return plan;  // TF gave none: the core's default (free memory), as before
  const uint64_t tf = static_cast<uint64_t>(tf_limit);
  const char* const why =
      " is above TensorFlow's memory limit for this GPU (its free memory less the system reserve "
      "TF keeps for CUDA libraries, or per_process_gpu_memory_fraction, or the logical device's "
      "memory_limit): ";
  if (antman_capacity > tf) {
    plan.note = "tf-antman: ANTMAN_DEVICE_MEMORY=" + Bytes(antman_capacity) + why + "using " +
                Bytes(tf) + kTail;
  }
  plan.capacity = antman_capacity == 0 ? tf : std::min(antman_capacity, tf);
  if (antman_limit > plan.capacity) {
    if (plan.note.empty() && antman_limit > tf) {
      plan.note = "tf-antman: ANTMAN_MEMORY_LIMIT=" + Bytes(antman_limit) + why + "using " +
                  Bytes(plan.capacity) + kTail;
    }
    plan.limit = plan.capacity;
  }
  return plan;
}

}  // namespace antman
