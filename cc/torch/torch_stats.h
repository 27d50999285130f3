/* PyTorch's allocator statistics (c10::CachingDeviceAllocator::DeviceStats, torch 2.14.1;
 * c10::cuda::CUDACachingAllocator::DeviceStats before) filled from the memory core's figures, so
 * that torch.cuda.memory_stats() and the calls built on it (memory_allocated,
 * max_memory_allocated, memory_reserved, reset_peak_memory_stats) report tf-antman's cores
 * under PyTorch's keys. C-compatible: libantman_torch.so exports it (antman_torch_get_stats).
 * The mapping, field by field, with why: docs/pytorch.md, "Memory statistics". */
#ifndef TF_ANTMAN_CC_TORCH_TORCH_STATS_H_
#define TF_ANTMAN_CC_TORCH_TORCH_STATS_H_

#include <stdint.h>

#include "cc/core/antman_memory.h"

#ifdef __cplusplus
extern "C" {
#endif

/* PyTorch's Stat: current value, its peak since the last reset, cumulative increases and
 * decreases since the last reset of accumulated stats. */
typedef struct {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} antman_torch_stat;

/* PyTorch's DeviceStats for its "all" pool (tf-antman has no small/large pools). */
typedef struct {
  antman_torch_stat allocation;           /* blocks handed to PyTorch */
  antman_torch_stat segment;              /* regions the core holds (device + host) */
  antman_torch_stat active;               /* live blocks + freed blocks streams may still use */
  antman_torch_stat inactive_split;       /* always 0: the core's splits are not reported */
  antman_torch_stat allocated_bytes;      /* bytes of live blocks, as held */
  antman_torch_stat reserved_bytes;       /* bytes of the core's regions (device + host) */
  antman_torch_stat active_bytes;
  antman_torch_stat inactive_split_bytes; /* always 0 */
  antman_torch_stat requested_bytes;      /* bytes of live blocks, as asked */
  int64_t num_alloc_retries;              /* requests served only after memory was given back */
  int64_t num_ooms;                       /* requests neither device nor host could serve */
  int64_t num_sync_all_streams;           /* host waits for streams' events */
  int64_t num_device_alloc;               /* always 0: the core counts blocks, not driver calls */
  int64_t num_device_free;                /* always 0 */
} antman_torch_device_stats;

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include "cc/torch/stream_ordered.h"

namespace antman_torch {

// Pure: PyTorch's view of one device from the cache's and the core's figures.
antman_torch_device_stats MapTorchStats(const StreamCacheStats& cache, const antman_mem_stats& core,
                                        const antman_mem_ext_stats& ext);

}  // namespace antman_torch
#endif

#endif /* TF_ANTMAN_CC_TORCH_TORCH_STATS_H_ */
