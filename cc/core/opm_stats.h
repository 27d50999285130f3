// OpManager::Stats as the C struct antman_opm_stats (antman_ops.h): the one copy, used by
// antman_opm_get_stats (libantman_core.so) and antman_rt_get_op_stats (libtf_antman.so), so the
// two C APIs report the same fields in the same layout.
#ifndef TF_ANTMAN_CC_CORE_OPM_STATS_H_
#define TF_ANTMAN_CC_CORE_OPM_STATS_H_

#include "cc/core/antman_ops.h"
#include "cc/core/op_manager.h"

namespace antman {

// Every field of *out, reserved ones zeroed.
void FillOpmStats(const OpManager::Stats& s, antman_opm_stats* out);

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_OPM_STATS_H_
