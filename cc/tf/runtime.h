// The process-wide tf-antman runtime: one emulated or CUDA device per process,
// its universal memory and its operator manager. Python configures it through
// the C functions in c_api.cc before TensorFlow creates its devices.
#ifndef TF_ANTMAN_CC_TF_RUNTIME_H_
#define TF_ANTMAN_CC_TF_RUNTIME_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/core/op_manager.h"

namespace antman {

struct RuntimeConfig {
  int backend = ANTMAN_BACKEND_EMULATED;
  int device_id = 0;
  uint64_t device_capacity = 0;
  uint64_t limit = 0;
  uint64_t host_capacity = 0;
  double compute_share = 1.0;
};

class Runtime {
 public:
  static Runtime& Get();

  // Creates the memory core and the operator manager; registers the device
  // factory for the backend. Returns an empty string or the error.
  std::string Configure(const RuntimeConfig& config);
  bool configured() const { return mem_ != nullptr; }
  const RuntimeConfig& config() const { return config_; }

  antman_mem* mem() const { return mem_; }
  OpManager* op_manager() const { return op_manager_.get(); }

  // Counted by the device factory: proof that TF built its device on our pieces.
  void MarkDeviceCreated() { devices_created_.fetch_add(1); }
  int devices_created() const { return devices_created_.load(); }

 private:
  Runtime() = default;
  RuntimeConfig config_;
  antman_mem* mem_ = nullptr;
  std::unique_ptr<OpManager> op_manager_;
  std::atomic<int> devices_created_{0};
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_RUNTIME_H_
