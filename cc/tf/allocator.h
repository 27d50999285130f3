// A tsl::Allocator over the universal memory of the C core.
#ifndef TF_ANTMAN_CC_TF_ALLOCATOR_H_
#define TF_ANTMAN_CC_TF_ALLOCATOR_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "cc/core/antman_memory.h"
#include "tensorflow/core/framework/allocator.h"

namespace antman {

inline constexpr char kAllocatorName[] = "antman_universal";

// TF's allocator contract (tsl/framework/allocator.h), as TF's own BFC allocator keeps it:
//  - AllocateRaw with AllocationAttributes: retry_on_failure=false (cuDNN/cuFFT scratch, XLA
//    autotuning and redzone buffers, which fall back to a smaller algorithm on NULL) is served
//    from device memory or refused, never from the host arena: a slow host buffer would be
//    measured and cached as that algorithm's speed;
//  - GetStats: bytes_in_use and peak_bytes_in_use both count device and host blocks, from one
//    read (current <= peak), largest_alloc_size, num_allocs since the last ClearStats;
//  - ClearStats restarts the peaks (tf.config.experimental.reset_memory_stats);
//  - GetMemoryType: kDevice on a GPU, kHostPageable on the emulated device (host RAM).
// freed_by_func is not honoured: GPUOptions.experimental.timestamped_allocator is refused
// (gpu_options.h).
class UniversalTfAllocator : public tsl::Allocator {
 public:
  UniversalTfAllocator(antman_mem* mem, tsl::AllocatorMemoryType type)
      : mem_(mem), type_(type) {}

  // After a failed allocation on this thread, the name carries the core's
  // statistics once: TF embeds Name() in its ResourceExhausted message, so the
  // user sees limits and host usage right where the OOM is reported.
  std::string Name() override;
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  void* AllocateRaw(size_t alignment, size_t num_bytes,
                    const tsl::AllocationAttributes& attr) override;
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return true; }
  size_t RequestedSize(const void* ptr) const override;
  size_t AllocatedSize(const void* ptr) const override;
  std::optional<tsl::AllocatorStats> GetStats() override;
  bool ClearStats() override;
  tsl::AllocatorMemoryType GetMemoryType() const override { return type_; }

 private:
  antman_mem* mem_;
  const tsl::AllocatorMemoryType type_;
  std::atomic<uint64_t> allocs_at_clear_{0};  // num_allocs counts from the last ClearStats
};

// The TF allocator of the first device created (the emulated device's, or the first GPU's), for
// the C API's statistics and test hooks; nullptr before.
UniversalTfAllocator* FirstTfAllocator();
void NoteTfAllocator(UniversalTfAllocator* allocator);

// One line with the figures a user needs to understand an out-of-memory error.
std::string DescribeMemory(antman_mem* mem);

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_ALLOCATOR_H_
