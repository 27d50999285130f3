// A tsl::Allocator over the universal memory of the C core.
#ifndef TF_ANTMAN_CC_TF_ALLOCATOR_H_
#define TF_ANTMAN_CC_TF_ALLOCATOR_H_

#include <string>

#include "cc/core/antman_memory.h"
#include "tensorflow/core/framework/allocator.h"

namespace antman {

inline constexpr char kAllocatorName[] = "antman_universal";

class UniversalTfAllocator : public tsl::Allocator {
 public:
  explicit UniversalTfAllocator(antman_mem* mem) : mem_(mem) {}

  // After a failed allocation on this thread, the name carries the core's
  // statistics once: TF embeds Name() in its ResourceExhausted message, so the
  // user sees limits and host usage right where the OOM is reported.
  std::string Name() override;
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return true; }
  size_t RequestedSize(const void* ptr) const override;
  size_t AllocatedSize(const void* ptr) const override;
  std::optional<tsl::AllocatorStats> GetStats() override;

 private:
  antman_mem* mem_;
};

// One line with the figures a user needs to understand an out-of-memory error.
std::string DescribeMemory(antman_mem* mem);

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_ALLOCATOR_H_
