// C functions that tf_antman/_native.py binds with ctypes. Kept flat (plain
// integers, doubles and the core's stats struct) so no Python extension module
// and no TensorFlow type crosses this boundary.
#include <cstring>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/tf/allocator.h"
#include "cc/tf/runtime.h"

#define ANTMAN_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
void CopyError(const std::string& msg, char* err, size_t errlen) {
  if (err == nullptr || errlen == 0) return;
  std::strncpy(err, msg.c_str(), errlen - 1);
  err[errlen - 1] = '\0';
}
antman_mem* Mem() { return antman::Runtime::Get().mem(); }
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
  if (Mem() == nullptr) return 1;
  antman_mem_request_limit(Mem(), limit);
  return 0;
}

ANTMAN_EXPORT uint64_t antman_rt_set_limit_now(uint64_t limit, uint64_t* unfreed) {
  if (Mem() == nullptr) return 0;
  return antman_mem_set_limit(Mem(), limit, unfreed);
}

ANTMAN_EXPORT uint64_t antman_rt_release_cached() {
  return Mem() == nullptr ? 0 : antman_mem_release_cached(Mem());
}

ANTMAN_EXPORT int antman_rt_step_boundary() {
  if (Mem() == nullptr) return 1;
  antman_mem_step_boundary(Mem());
  return 0;
}

ANTMAN_EXPORT int antman_rt_check_invariants(char* err, size_t errlen) {
  if (Mem() == nullptr) return 1;
  return antman_mem_check_invariants(Mem(), err, errlen);
}

ANTMAN_EXPORT int antman_rt_set_share(double share) {
  antman::OpManager* m = antman::Runtime::Get().op_manager();
  if (m == nullptr) return 1;
  return m->SetShare(share) ? 0 : 2;  // 2: outside [0, 1] or NaN, nothing changed
}

// Flat copy of OpManager::Stats for ctypes.
struct antman_op_stats {
  int64_t busy_ns;
  int64_t idle_inserted_ns;
  int64_t ops_total;
  int64_t ops_delayed;
  int64_t ops_queued_now;
  double share;
  double achieved_share_window;
  int64_t window_ns;
  int32_t paused;
};

ANTMAN_EXPORT int antman_rt_get_op_stats(antman_op_stats* out) {
  antman::OpManager* m = antman::Runtime::Get().op_manager();
  if (m == nullptr) return 1;
  antman::OpManager::Stats s = m->stats();
  out->busy_ns = s.busy_ns;
  out->idle_inserted_ns = s.idle_inserted_ns;
  out->ops_total = s.ops_total;
  out->ops_delayed = s.ops_delayed;
  out->ops_queued_now = s.ops_queued_now;
  out->share = s.share;
  out->achieved_share_window = s.achieved_share_window;
  out->window_ns = s.window_ns;
  out->paused = s.paused ? 1 : 0;
  return 0;
}
