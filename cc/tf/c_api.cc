// C functions that tf_antman/_native.py binds with ctypes. Kept flat (plain
// integers, doubles and the core's stats struct) so no Python extension module
// and no TensorFlow type crosses this boundary.
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/core/antman_ops.h"
#include "cc/core/opm_stats.h"
#include "cc/tf/allocator.h"
#include "cc/tf/gpu_device.h"
#include "cc/tf/gpu_options.h"
#include "cc/tf/op_classes.h"
#include "cc/tf/runtime.h"
#include "tensorflow/core/protobuf/config.pb.h"

#define ANTMAN_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
void CopyError(const std::string& msg, char* err, size_t errlen) {
  if (err == nullptr || errlen == 0) return;
  std::strncpy(err, msg.c_str(), errlen - 1);
  err[errlen - 1] = '\0';
}
// Statistics are the first device's; control calls apply to every device of
// the process (the emulated device, or each GPU TF created so far).
antman_mem* Mem() { return antman::Runtime::Get().mem(); }
void EachMem(const std::function<void(antman_mem*)>& f) {
  antman::Runtime::Get().ForEachDevice([&](antman_mem* mem, antman::OpManager*) { f(mem); });
}
}  // namespace

ANTMAN_EXPORT int antman_rt_abi_version() { return ANTMAN_MEM_ABI_VERSION; }

ANTMAN_EXPORT int antman_rt_configure(int backend, int device_id, uint64_t device_capacity,
                                      uint64_t limit, uint64_t host_capacity,
                                      double compute_share, char* err, size_t errlen) {
  antman::RuntimeConfig c;
  c.backend = backend;
  c.device_id = device_id;
  c.device_capacity = device_capacity;
  c.limit = limit;
  c.host_capacity = host_capacity;
  c.compute_share = compute_share;
  std::string msg = antman::Runtime::Get().Configure(c);
  CopyError(msg, err, errlen);
  return msg.empty() ? 0 : 1;
}

ANTMAN_EXPORT int antman_rt_devices_created() { return antman::Runtime::Get().devices_created(); }

ANTMAN_EXPORT int antman_rt_get_mem_stats(antman_mem_stats* out) {
  if (Mem() == nullptr) return 1;
  antman_mem_get_stats(Mem(), out);
  return 0;
}

ANTMAN_EXPORT int antman_rt_request_limit(uint64_t limit) {
  if (!antman::Runtime::Get().configured()) return 1;
  antman::Runtime::Get().SetLimitForNewDevices(limit);
  EachMem([&](antman_mem* m) { antman_mem_request_limit(m, limit); });
  return 0;
}

// Bytes freed on all devices; *unfreed gets the largest excess left on one.
ANTMAN_EXPORT uint64_t antman_rt_set_limit_now(uint64_t limit, uint64_t* unfreed) {
  uint64_t freed = 0;
  uint64_t worst = 0;
  if (antman::Runtime::Get().configured()) antman::Runtime::Get().SetLimitForNewDevices(limit);
  EachMem([&](antman_mem* m) {
    uint64_t left = 0;
    freed += antman_mem_set_limit(m, limit, &left);
    worst = std::max(worst, left);
  });
  if (unfreed != nullptr) *unfreed = worst;
  return freed;
}

ANTMAN_EXPORT uint64_t antman_rt_release_cached() {
  uint64_t freed = 0;
  EachMem([&](antman_mem* m) { freed += antman_mem_release_cached(m); });
  return freed;
}

ANTMAN_EXPORT int antman_rt_step_boundary() {
  if (Mem() == nullptr) return 1;
  EachMem([](antman_mem* m) { antman_mem_step_boundary(m); });
  return 0;
}

ANTMAN_EXPORT int antman_rt_check_invariants(char* err, size_t errlen) {
  if (Mem() == nullptr) return 1;
  int rc = 0;
  EachMem([&](antman_mem* m) {
    if (rc == 0) rc = antman_mem_check_invariants(m, err, errlen);
  });
  return rc;
}

// Devices with universal memory so far (emulated: 1; CUDA: GPUs TF created).
ANTMAN_EXPORT int antman_rt_device_count() { return antman::Runtime::Get().device_count(); }

// What tf-antman's "GPU" factory did (cc/tf/gpu_device.h): kind 0 none, 1 cuda,
// 2 hidden; registered 1 when TF's factory for "GPU" is ours.
ANTMAN_EXPORT void antman_rt_gpu_factory_stats(int* kind, int* registered, int* list_calls,
                                               int* create_calls, int* devices) {
  antman::GpuFactoryStats s = antman::GetGpuFactoryStats();
  *kind = s.kind;
  *registered = s.registered;
  *list_calls = s.list_calls;
  *create_calls = s.create_calls;
  *devices = s.devices;
}

// Is `op_type` one of the kernels the manager lets through uncharged
// (cc/tf/op_classes.h)? For the consistency test against TF's op registry.
ANTMAN_EXPORT int antman_rt_is_waiting_op(const char* op_type) {
  return op_type != nullptr && antman::IsWaitingOpType(op_type) ? 1 : 0;
}

// The i-th name of that list, or NULL past its end.
ANTMAN_EXPORT const char* antman_rt_waiting_op(int i) {
  const char* const* names = antman::WaitingOpTypes();
  for (int k = 0; names[k] != nullptr; ++k) {
    if (k == i) return names[k];
  }
  return nullptr;
}

// The GPU device factory's refusal of TF's GPU options (gpu_options.h), for a serialized
// tensorflow.ConfigProto: 0 accepted, 1 refused (the line in `out`), 2 not a ConfigProto.
ANTMAN_EXPORT int antman_rt_check_gpu_options(const void* config_proto, size_t len, char* out,
                                              size_t outlen) {
  tensorflow::ConfigProto config;
  if (config_proto == nullptr || !config.ParseFromArray(config_proto, static_cast<int>(len))) {
    CopyError("config_proto: not a serialized tensorflow.ConfigProto", out, outlen);
    return 2;
  }
  const std::string why = antman::RefusedGpuOptions(config.gpu_options());
  CopyError(why, out, outlen);
  return why.empty() ? 0 : 1;
}

// The capacity and initial limit a GPU's memory gets (gpu_options.h, PlanGpuMemory).
ANTMAN_EXPORT void antman_rt_plan_gpu_memory(uint64_t antman_capacity, uint64_t antman_limit,
                                             int64_t tf_limit, uint64_t* capacity,
                                             uint64_t* limit, char* note, size_t notelen) {
  const antman::GpuMemoryPlan plan =
      antman::PlanGpuMemory(antman_capacity, antman_limit, tf_limit);
  if (capacity != nullptr) *capacity = plan.capacity;
  if (limit != nullptr) *limit = plan.limit;
  CopyError(plan.note, note, notelen);
}

// TF's view of the first device's memory (its tsl::Allocator, allocator.h): out[0..6] =
// num_allocs, bytes_in_use, peak_bytes_in_use, largest_alloc_size, bytes_reserved, bytes_limit,
// memory type (tsl::AllocatorMemoryType). 0, or 1 when no device exists yet.
ANTMAN_EXPORT int antman_rt_tf_allocator_stats(int64_t* out) {
  antman::UniversalTfAllocator* a = antman::FirstTfAllocator();
  if (a == nullptr || out == nullptr) return 1;
  const tsl::AllocatorStats s = a->GetStats().value_or(tsl::AllocatorStats());
  out[0] = s.num_allocs;
  out[1] = s.bytes_in_use;
  out[2] = s.peak_bytes_in_use;
  out[3] = s.largest_alloc_size;
  out[4] = s.bytes_reserved;
  out[5] = s.bytes_limit.value_or(0);
  out[6] = static_cast<int64_t>(a->GetMemoryType());
  return 0;
}

// Test hook, TF's allocator driven as a kernel would: allocates `bytes` through the first
// device's tsl::Allocator with AllocationAttributes(retry_on_failure), says where the block
// landed and frees it. 0 device, 1 host arena, 2 refused (NULL), -1 no device yet.
ANTMAN_EXPORT int antman_rt_tf_allocate_probe(uint64_t bytes, int retry_on_failure) {
  antman::UniversalTfAllocator* a = antman::FirstTfAllocator();
  antman_mem* mem = Mem();
  if (a == nullptr || mem == nullptr) return -1;
  tsl::AllocationAttributes attr;
  attr.retry_on_failure = retry_on_failure != 0;
  tsl::Allocator* base = a;  // as TF calls it, through the base class
  void* p = base->AllocateRaw(tsl::Allocator::kAllocatorAlignment, bytes, attr);
  if (p == nullptr) return 2;
  const int host = antman_mem_is_host(mem, p);
  base->DeallocateRaw(p);
  return host == 1 ? 1 : 0;
}

ANTMAN_EXPORT int antman_rt_set_share(double share) {
  antman::Runtime& rt = antman::Runtime::Get();
  if (!rt.configured()) return 1;
  return rt.SetShare(share) ? 0 : 2;  // 2: outside [0, 1] or NaN, nothing changed
}

// The first device's operator manager, in the core's C struct (cc/core/antman_ops.h), filled
// as libantman_core.so's antman_opm_get_stats fills it (cc/core/opm_stats.h).
ANTMAN_EXPORT int antman_rt_get_op_stats(antman_opm_stats* out) {
  antman::Runtime& rt = antman::Runtime::Get();
  antman::OpManager* m = rt.op_manager();
  if (m == nullptr) {
    if (!rt.configured()) return 1;
    *out = antman_opm_stats{};  // CUDA before TF created a GPU: nothing ran yet
    out->share = rt.share();
    out->paused = rt.share() == 0.0 ? 1 : 0;
    return 0;
  }
  antman::FillOpmStats(m->stats(), out);
  return 0;
}
