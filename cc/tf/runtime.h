// The process-wide tf-antman runtime: the devices of the process (one emulated
// device, or one per TensorFlow GPU), each with its universal memory and its
// operator manager. Python configures it through the C functions in c_api.cc
// before TensorFlow creates its devices.
#ifndef TF_ANTMAN_CC_TF_RUNTIME_H_
#define TF_ANTMAN_CC_TF_RUNTIME_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/core/antman_memory.h"
#include "cc/core/op_manager.h"

namespace antman {

struct RuntimeConfig {
  int backend = ANTMAN_BACKEND_EMULATED;
  int device_id = 0;
  // Emulated: the device's capacity. CUDA: per GPU; 0 = its free memory when
  // TF creates the device.
  uint64_t device_capacity = 0;
  uint64_t limit = 0;  // 0 = device_capacity
  uint64_t host_capacity = 0;
  double compute_share = 1.0;
};

class Runtime {
 public:
  static Runtime& Get();

  // Records the configuration and registers the device factories for the
  // backend: emulated creates its one device's memory and manager now and
  // hides TF's GPUs; CUDA creates them per GPU when TF creates that device.
  // Returns an empty string or the error.
  std::string Configure(const RuntimeConfig& config);
  bool configured() const { return configured_.load(); }
  const RuntimeConfig& config() const { return config_; }

  // The first device's (the emulated device, or the first GPU TF created);
  // nullptr while there is none.
  antman_mem* mem() const;
  OpManager* op_manager() const;

  // The memory and manager of CUDA device `ordinal` (CUDA_VISIBLE_DEVICES
  // numbering), created on first use and kept for the life of the process:
  // every TF device object for that GPU (eager context, each Session) draws on
  // the same budget. `tf_limit` is TF's own memory limit for the device (<= 0
  // unknown): the memory's capacity follows PlanGpuMemory (gpu_options.h); a
  // note about an ANTMAN_* setting it overrides goes to `note` once per GPU.
  // Returns "" or why the memory could not be created.
  std::string CudaDevice(int ordinal, int64_t tf_limit, antman_mem** mem, OpManager** manager,
                         std::string* note);

  // Calls `f` for every device created so far, in creation order.
  void ForEachDevice(const std::function<void(antman_mem*, OpManager*)>& f) const;
  int device_count() const;

  // Applies to every device now and to devices created later.
  bool SetShare(double share);
  // The initial limit of devices created from now on (a limit requested
  // before TF created the GPUs must not be lost).
  void SetLimitForNewDevices(uint64_t limit) {
    std::lock_guard<std::mutex> lock(mu_);
    config_.limit = limit;
  }
  double share() const {
    std::lock_guard<std::mutex> lock(mu_);
    return share_;
  }

  // Counted by the device factories: proof that TF built its device on our pieces.
  void MarkDeviceCreated() { devices_created_.fetch_add(1); }
  int devices_created() const { return devices_created_.load(); }

 private:
  struct Device {
    antman_mem* mem;
    std::unique_ptr<OpManager> op_manager;
  };
  Runtime() = default;
  std::string AddDeviceLocked(int key, int backend, int ordinal, uint64_t capacity,
                              uint64_t limit, Device** out);

  mutable std::mutex mu_;
  RuntimeConfig config_;
  std::atomic<bool> configured_{false};
  double share_ = 1.0;
  // Keyed by ordinal (emulated: 0); creation order kept for "first device".
  std::map<int, Device> devices_;
  std::vector<int> order_;
  std::atomic<int> devices_created_{0};
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_RUNTIME_H_
