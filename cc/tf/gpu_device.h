// tf-antman's "GPU" device factory for TensorFlow 2.21 (docs/gpu-path.md).
#ifndef TF_ANTMAN_CC_TF_GPU_DEVICE_H_
#define TF_ANTMAN_CC_TF_GPU_DEVICE_H_

namespace antman {

// Above TF's own GPUDeviceFactory (210).
inline constexpr int kGpuFactoryPriority = 220;

// ANTMAN_DEVICE=cuda: TF's GPU devices, with memory from the universal
// allocator over the CUDA backend and every op gated with device time.
void RegisterGpuDeviceFactory();
// ANTMAN_DEVICE=emulated: a "GPU" factory that lists and creates nothing, so
// no op of this process runs on a real GPU outside the operator manager.
void RegisterHiddenGpuFactory();

// What the registered factory did, for tests and device_info().
struct GpuFactoryStats {
  int kind;           // 0 none registered by us, 1 cuda, 2 hidden
  int registered;     // 1 if TF's factory for "GPU" is ours now
  int list_calls;     // ListPhysicalDevices calls it served
  int create_calls;   // CreateDevices calls it served
  int devices;        // GPU devices it created
};
GpuFactoryStats GetGpuFactoryStats();

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_GPU_DEVICE_H_
