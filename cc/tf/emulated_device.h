#ifndef TF_ANTMAN_CC_TF_EMULATED_DEVICE_H_
#define TF_ANTMAN_CC_TF_EMULATED_DEVICE_H_

namespace antman {

// Above TF's CPU factories (ThreadPoolDeviceFactory 60, GPUCompatibleCPUDeviceFactory 70).
inline constexpr int kEmulatedFactoryPriority = 80;

void RegisterEmulatedDeviceFactory();

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_EMULATED_DEVICE_H_
