// What tf-antman's GPU device takes from TensorFlow's GPU options, and what it
// refuses (docs/gpu-path.md, "TF's GPU options"). Kept apart from
// gpu_device.cc so that tests drive it with TF's own option protos on a
// machine without a GPU (c_api.cc: antman_rt_check_gpu_options,
// antman_rt_plan_gpu_memory).
#ifndef TF_ANTMAN_CC_TF_GPU_OPTIONS_H_
#define TF_ANTMAN_CC_TF_GPU_OPTIONS_H_

#include <cstdint>
#include <string>

namespace tensorflow {
class GPUOptions;
}  // namespace tensorflow

namespace antman {

// "" or one line naming the first GPU option tf-antman cannot honour:
//  - several logical devices on one GPU (virtual_devices[i] with more than one
//    memory_limit_mb, i.e. tf.config.set_logical_device_configuration with
//    several configurations for a GPU, or num_virtual_devices_per_gpu > 1):
//    each logical device has its own streams, and one memory per GPU shared by
//    them would hand a block freed on one stream to another while a kernel
//    still uses it;
//  - experimental.use_cuda_malloc_async: TF's cudaMallocAsync allocator, which
//    preallocates outside the job's limit (TF_GPU_ALLOCATOR=cuda_malloc_async
//    is refused by tf_antman/device_select.py);
//  - experimental.timestamped_allocator: TF then passes freed_by_func to the
//    device allocator and reuses memory only after the timestamp it returns;
//    the universal allocator ignores it, so a copy could overwrite memory
//    still in use.
std::string RefusedGpuOptions(const tensorflow::GPUOptions& gpu);

// The universal memory of one GPU, from the job's settings and TF's own limit.
struct GpuMemoryPlan {
  uint64_t capacity = 0;  // 0: the GPU's free memory (only when TF gave no limit)
  uint64_t limit = 0;     // 0: the capacity
  std::string note;       // "" or one line: an ANTMAN_* setting TF's limit overrides
};

// antman_capacity: ANTMAN_DEVICE_MEMORY (0 unset); antman_limit: ANTMAN_MEMORY_LIMIT or a limit
// requested before the device existed (0 unset); tf_limit: what TF's BaseGPUDeviceFactory
// computed for the device (its GPUBFCAllocator's bytes_limit: the GPU's free memory less
// MinSystemMemory or TF_DEVICE_MIN_SYS_MEMORY_IN_MB / gpu_system_memory_size_in_mb, or
// per_process_gpu_memory_fraction of the total, or a logical device's memory_limit; <= 0 unknown).
// The capacity is TF's limit, lowered by ANTMAN_DEVICE_MEMORY; neither ANTMAN_* value may
// raise it (the note says so), so the reserve TF keeps for cuBLAS, cuDNN, NCCL and CUDA
// graphs stays free.
GpuMemoryPlan PlanGpuMemory(uint64_t antman_capacity, uint64_t antman_limit, int64_t tf_limit);

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_GPU_OPTIONS_H_
