// The C API of the op manager (cc/core/antman_ops.h): every argument is
// checked at this edge, then the call is forwarded to antman::OpManager.
#include "cc/core/antman_ops.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/core/c_api_internal.h"
#include "cc/core/cuda_gate.h"
#include "cc/core/op_manager.h"
#include "cc/core/opm_stats.h"

namespace antman {
namespace {

thread_local std::string tl_last_error;

int NullHandle() {
  return SetLastError(ANTMAN_ERR_INVALID, "opm: must not be NULL");
}

int NullOut(const char* field) {
  return SetLastError(ANTMAN_ERR_INVALID, std::string(field) + ": must not be NULL");
}

}  // namespace

int SetLastError(int code, const std::string& message) {
  tl_last_error = message;
  return code;
}

void CopyError(char* err, size_t errlen, const std::string& message) {
  if (err == nullptr || errlen == 0) return;
  std::snprintf(err, errlen, "%s", message.c_str());
}

void FillOpmStats(const OpManager::Stats& s, antman_opm_stats* out) {
  *out = antman_opm_stats{};
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
}

}  // namespace antman

using antman::OpManager;
using antman::SetLastError;

extern "C" {

void antman_core_get_abi(antman_core_abi* out) {
  if (out == nullptr) return;
  out->mem = ANTMAN_MEM_ABI_VERSION;
  out->ops = ANTMAN_OPS_ABI_VERSION;
  out->gate = ANTMAN_GATE_ABI_VERSION;
}

const char* antman_core_last_error(void) { return antman::tl_last_error.c_str(); }

void antman_opm_default_config(antman_opm_config* out) {
  if (out == nullptr) return;
  OpManager::Options d;
  out->initial_share = d.initial_share;
  out->window_ns = d.window_ns;
  out->max_credit_ns = d.max_credit_ns;
  out->max_pending_device_ops = d.max_pending_device_ops;
  out->device_burst_ns = d.device_burst_ns;
}

int antman_opm_create(const antman_opm_config* config, antman_opm** out, char* err,
                      size_t errlen) {
  auto fail = [&](int code, const std::string& message) {
    antman::CopyError(err, errlen, message);
    return SetLastError(code, message);
  };
  if (out == nullptr) return fail(ANTMAN_ERR_INVALID, "out: must not be NULL");
  *out = nullptr;
  if (config == nullptr) return fail(ANTMAN_ERR_INVALID, "config: must not be NULL");
  OpManager::Options options;
  options.initial_share = config->initial_share;
  options.window_ns = config->window_ns;
  options.max_credit_ns = config->max_credit_ns;
  options.max_pending_device_ops = config->max_pending_device_ops;
  options.device_burst_ns = config->device_burst_ns;
  const std::string invalid = OpManager::Validate(options);
  if (!invalid.empty()) return fail(ANTMAN_ERR_INVALID, invalid);
  auto opm = std::make_unique<antman_opm>();
  opm->manager = std::make_unique<OpManager>(options);
  *out = opm.release();
  return ANTMAN_OK;
}

void antman_opm_destroy(antman_opm* opm) { delete opm; }

int antman_opm_set_share(antman_opm* opm, double share) {
  if (opm == nullptr) return antman::NullHandle();
  const std::string invalid = OpManager::ValidateShare(share);
  if (!invalid.empty()) return SetLastError(ANTMAN_ERR_INVALID, invalid);
  opm->manager->SetShare(share);
  return ANTMAN_OK;
}

int antman_opm_unthrottled(const antman_opm* opm) {
  return opm != nullptr && opm->manager->unthrottled() ? 1 : 0;
}

int antman_opm_admit(antman_opm* opm, int timing, int64_t* admitted_ns) {
  if (opm == nullptr) return antman::NullHandle();
  if (admitted_ns == nullptr) return antman::NullOut("admitted_ns");
  if (timing != ANTMAN_TIMING_HOST && timing != ANTMAN_TIMING_DEVICE) {
    return SetLastError(ANTMAN_ERR_INVALID,
                        "timing: " + std::to_string(timing) +
                            " is not one of 0 (ANTMAN_TIMING_HOST), 1 (ANTMAN_TIMING_DEVICE)");
  }
  *admitted_ns = opm->manager->Admit(timing == ANTMAN_TIMING_HOST ? OpManager::Timing::kHost
                                                                   : OpManager::Timing::kDevice);
  return ANTMAN_OK;
}

int antman_opm_finish(antman_opm* opm, int64_t admitted_ns) {
  if (opm == nullptr) return antman::NullHandle();
  if (admitted_ns < 0 && admitted_ns != ANTMAN_OPM_NESTED) {
    return SetLastError(ANTMAN_ERR_INVALID,
                        "admitted_ns: " + std::to_string(admitted_ns) +
                            " is not a time returned by antman_opm_admit (>= 0, or -1 nested)");
  }
  opm->manager->Finish(admitted_ns);
  return ANTMAN_OK;
}

int antman_opm_launched(antman_opm* opm, int64_t* provisional_ns) {
  if (opm == nullptr) return antman::NullHandle();
  if (provisional_ns == nullptr) return antman::NullOut("provisional_ns");
  *provisional_ns = opm->manager->Launched();
  return ANTMAN_OK;
}

int antman_opm_device_done(antman_opm* opm, int64_t provisional_ns, int64_t start_ns,
                           int64_t end_ns) {
  if (opm == nullptr) return antman::NullHandle();
  if (provisional_ns < 0) {
    return SetLastError(ANTMAN_ERR_INVALID, "provisional_ns: " + std::to_string(provisional_ns) +
                                                " is outside the accepted range [0, 2^63)");
  }
  if (start_ns < 0) {
    return SetLastError(ANTMAN_ERR_INVALID, "start_ns: " + std::to_string(start_ns) +
                                                " is outside the accepted range [0, 2^63)");
  }
  if (end_ns < start_ns) {
    return SetLastError(ANTMAN_ERR_INVALID, "end_ns: " + std::to_string(end_ns) +
                                                " is outside the accepted range [start_ns = " +
                                                std::to_string(start_ns) + ", 2^63)");
  }
  // A time the clock has not reached is no device time: as a profile sample it
  // could be near 2^63 and no later admission would outlive its charge.
  const int64_t now = opm->manager->NowNs();
  if (end_ns > now) {
    return SetLastError(ANTMAN_ERR_INVALID, "end_ns: " + std::to_string(end_ns) +
                                                " is later than the manager's clock now (" +
                                                std::to_string(now) +
                                                "): device times are on antman_opm_now_ns's clock");
  }
  opm->manager->DeviceDone(provisional_ns, start_ns, end_ns);
  return ANTMAN_OK;
}

int64_t antman_opm_now_ns(const antman_opm* opm) {
  return opm != nullptr ? opm->manager->NowNs() : -1;
}

int antman_opm_get_stats(const antman_opm* opm, antman_opm_stats* out) {
  if (opm == nullptr) return antman::NullHandle();
  if (out == nullptr) return antman::NullOut("out");
  antman::FillOpmStats(opm->manager->stats(), out);
  return ANTMAN_OK;
}

}  // extern "C"
