#include "cc/tf/runtime.h"

#include <mutex>

#include "cc/tf/emulated_device.h"
#include "cc/tf/python_gil.h"

namespace antman {
namespace {
std::mutex g_mu;
}  // namespace

Runtime& Runtime::Get() {
  static Runtime* rt = new Runtime();  // never destroyed: TF's devices outlive static teardown
  return *rt;
}

std::string Runtime::Configure(const RuntimeConfig& config) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (mem_ != nullptr) return "tf-antman runtime is already configured";
  if (config.backend != ANTMAN_BACKEND_EMULATED) {
    // The CUDA device glue needs TF's GPU device headers and a GPU; see docs/gpu-path.md.
    return "only the emulated backend can be installed into TensorFlow by this build "
           "(ANTMAN_DEVICE=emulated); the CUDA memory core is tested standalone";
  }
  antman_mem_config mc{};
  mc.backend = config.backend;
  mc.device_ordinal = config.device_id;
  mc.device_capacity = config.device_capacity;
  mc.limit = config.limit;
  mc.host_capacity = config.host_capacity;
  char err[512] = {0};
  antman_mem* mem = nullptr;
  if (antman_mem_create(&mc, &mem, err, sizeof(err)) != 0) return err;
  OpManager::Options oo;
  oo.initial_share = config.compute_share;
  oo.blocking_hooks = PythonGilHooks();  // an op held back must not hold the GIL
  op_manager_ = std::make_unique<OpManager>(oo);
  mem_ = mem;
  config_ = config;
  RegisterEmulatedDeviceFactory();
  return "";
}

}  // namespace antman
