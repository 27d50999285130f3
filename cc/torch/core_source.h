// The memory core of one device (cc/core/antman_memory.h) as the BlockSource of the
// stream-ordered cache (stream_ordered.h).
#ifndef TF_ANTMAN_CC_TORCH_CORE_SOURCE_H_
#define TF_ANTMAN_CC_TORCH_CORE_SOURCE_H_

#include <cstddef>

#include "cc/core/antman_memory.h"
#include "cc/torch/stream_ordered.h"

namespace antman_torch {

// Alignment of every block handed to PyTorch (cudaMalloc's own guarantee).
constexpr size_t kBlockAlignment = 256;

class CoreSource : public BlockSource {
 public:
  explicit CoreSource(antman_mem* mem) : mem_(mem) {}
  void* Alloc(size_t bytes, bool device_only) override {
    // The core serves from its host fallback once the device is at its limit; a caller that
    // still has device blocks coming back asks for device memory only first (stream_ordered.h).
    return device_only ? antman_mem_alloc_device_only(mem_, kBlockAlignment, bytes)
                       : antman_mem_alloc(mem_, kBlockAlignment, bytes);
  }
  void Free(void* ptr) override { antman_mem_free(mem_, ptr); }
  size_t Size(const void* ptr) override { return antman_mem_allocated_size(mem_, ptr); }

 private:
  antman_mem* mem_;
};

}  // namespace antman_torch

#endif  // TF_ANTMAN_CC_TORCH_CORE_SOURCE_H_
