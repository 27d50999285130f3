// C functions that tf_antman/_native.py binds with ctypes. Kept flat (plain
// integers, doubles and the core's stats struct) so no Python extension module
// and no TensorFlow type crosses this boundary.
#include <cstring>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/tf/allocator.h"
#include "cc/tf/op_classes.h"
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
  int64_t ops_waiting_now;
  int64_t ops_in_flight;
  double share;
  double achieved_share_window;
  int64_t window_ns;
  int32_t paused;
  int64_t op_ns_ewma;
  int64_t credit_ns;
};

ANTMAN_EXPORT int antman_rt_get_op_stats(antman_op_stats* out) {
  antman::OpManager* m = antman::Runtime::Get().op_manager();
  if (m == nullptr) return 1;
  antman::OpManager::Stats s = m->stats();
  out->busy_ns = s.busy_ns;
  out->idle_inserted_ns = s.idle_inserted_ns;
  out->ops_total = s.ops_total;
  out->ops_delayed = s.ops_delayed;
  out->ops_waiting_now = s.ops_waiting_now;
  out->ops_in_flight = s.ops_in_flight;
  out->share = s.share;
  out->achieved_share_window = s.achieved_share_window;
  out->window_ns = s.window_ns;
  out->paused = s.paused ? 1 : 0;
  out->op_ns_ewma = s.op_ns_ewma;
  out->credit_ns = s.credit_ns;
  return 0;
}
