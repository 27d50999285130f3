#include "cc/tf/runtime.h"

#include "cc/tf/emulated_device.h"
#include "cc/tf/gpu_device.h"
#include "cc/tf/gpu_options.h"
#include "cc/tf/python_gil.h"

namespace antman {

Runtime& Runtime::Get() {
  static Runtime* rt = new Runtime();  // never destroyed: TF's devices outlive static teardown
  return *rt;
}

std::string Runtime::AddDeviceLocked(int key, int backend, int ordinal, uint64_t capacity,
                                     uint64_t limit, Device** out) {
  auto it = devices_.find(key);
  if (it != devices_.end()) {
    *out = &it->second;
    return "";
  }
  antman_mem_config mc{};
  mc.backend = backend;
  mc.device_ordinal = ordinal;
  mc.device_capacity = capacity;
  mc.limit = limit;
  mc.host_capacity = config_.host_capacity;
  char err[512] = {0};
  antman_mem* mem = nullptr;
  if (antman_mem_create(&mc, &mem, err, sizeof(err)) != 0) return err;
  OpManager::Options oo;
  oo.initial_share = share_;
  oo.blocking_hooks = PythonGilHooks();  // an op held back must not hold the GIL
  Device& d = devices_[key];
  d.mem = mem;
  d.op_manager = std::make_unique<OpManager>(oo);
  order_.push_back(key);
  *out = &d;
  return "";
}

std::string Runtime::Configure(const RuntimeConfig& config) {
  std::unique_lock<std::mutex> lock(mu_);
  if (configured_.load()) return "tf-antman runtime is already configured";
  if (config.backend != ANTMAN_BACKEND_EMULATED && config.backend != ANTMAN_BACKEND_CUDA) {
    return "backend " + std::to_string(config.backend) + " is not 0 (emulated) or 1 (cuda)";
  }
  std::string why = OpManager::ValidateShare(config.compute_share);
  if (!why.empty()) return why;
  config_ = config;
  share_ = config.compute_share;
  if (config.backend == ANTMAN_BACKEND_EMULATED) {
    Device* d = nullptr;
    why = AddDeviceLocked(0, ANTMAN_BACKEND_EMULATED, config.device_id, config_.device_capacity,
                          config_.limit, &d);
    if (!why.empty()) return why;
  }
  configured_ = true;
  lock.unlock();
  if (config.backend == ANTMAN_BACKEND_EMULATED) {
    RegisterEmulatedDeviceFactory();
    // No op may run on a real GPU outside the manager: TF gets no GPU device.
    RegisterHiddenGpuFactory();
  } else {
    RegisterGpuDeviceFactory();
  }
  return "";
}

std::string Runtime::CudaDevice(int ordinal, int64_t tf_limit, antman_mem** mem,
                                OpManager** manager, std::string* note) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!configured_.load() || config_.backend != ANTMAN_BACKEND_CUDA) {
    return "tf-antman is not configured for ANTMAN_DEVICE=cuda";
  }
  Device* d = nullptr;
  // Only the first TF device object of a GPU sizes its memory; later ones (a new Session with
  // other options) share it as it is.
  GpuMemoryPlan plan;
  if (devices_.count(ordinal) == 0) {
    plan = PlanGpuMemory(config_.device_capacity, config_.limit, tf_limit);
  }
  std::string why =
      AddDeviceLocked(ordinal, ANTMAN_BACKEND_CUDA, ordinal, plan.capacity, plan.limit, &d);
  if (note != nullptr) *note = why.empty() ? plan.note : "";
  if (!why.empty()) return why;
  *mem = d->mem;
  *manager = d->op_manager.get();
  return "";
}

antman_mem* Runtime::mem() const {
  std::lock_guard<std::mutex> lock(mu_);
  return order_.empty() ? nullptr : devices_.at(order_.front()).mem;
}

OpManager* Runtime::op_manager() const {
  std::lock_guard<std::mutex> lock(mu_);
  return order_.empty() ? nullptr : devices_.at(order_.front()).op_manager.get();
}

void Runtime::ForEachDevice(const std::function<void(antman_mem*, OpManager*)>& f) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (int key : order_) {
    const Device& d = devices_.at(key);
    f(d.mem, d.op_manager.get());
  }
}

int Runtime::device_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(order_.size());
}

bool Runtime::SetShare(double share) {
  if (!OpManager::ValidateShare(share).empty()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  share_ = share;
  for (int key : order_) devices_.at(key).op_manager->SetShare(share);
  return true;
}

}  // namespace antman
