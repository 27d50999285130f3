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
  // Called before regions that held live blocks go back (FreeRegion follows, with no lock
  // held): waits until no kernel can still use them. CUDA: cuCtxSynchronize on the primary
  // context; cuMemFree's own synchronisation is documented only as "may". Default: nothing.
  virtual void Quiesce() {}
  // Free and total memory of the source now (CUDA: cuMemGetInfo), false when unknown. Used to
  // cap growth after the source refused a region (another process holds the memory).
  virtual bool MemInfo(size_t* free_bytes, size_t* total_bytes) {
    (void)free_bytes;
    (void)total_bytes;
    return false;
  }
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_REGION_SOURCE_H_
