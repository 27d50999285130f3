// Where an allocator gets its big blocks ("regions") from: device memory, pinned host memory,
// or host RAM standing in for a device. Kept apart from the allocator so the same BFC code runs
// over CUDA, over the emulated backend and over test doubles.
#ifndef TF_ANTMAN_CC_CORE_REGION_SOURCE_H_
#define TF_ANTMAN_CC_CORE_REGION_SOURCE_H_

#include <cstddef>

namespace antman {

class RegionSource {
 public:
  virtual ~RegionSource() = default;
  // nullptr when the memory is not available. May be slow (a device call): callers must not hold
  // their locks across it. The result must be at least 256-byte aligned.
  virtual void* AllocRegion(size_t bytes) = 0;
  // ptr and bytes exactly as returned by / passed to AllocRegion.
  virtual void FreeRegion(void* ptr, size_t bytes) = 0;
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_REGION_SOURCE_H_
