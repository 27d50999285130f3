// Region sources for one device: device memory and host memory for the fallback arena.
#ifndef TF_ANTMAN_CC_CORE_BACKEND_H_
#define TF_ANTMAN_CC_CORE_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "cc/core/antman_memory.h"
#include "cc/core/region_source.h"

namespace antman {

struct Backend {
  std::unique_ptr<RegionSource> device;
  std::unique_ptr<RegionSource> host;
  uint64_t device_capacity = 0;  // resolved: never 0
};

// Both return false with a message in *err when the backend cannot be brought up. The config has
// already been validated.
bool MakeEmulatedBackend(const antman_mem_config& config, Backend* out, std::string* err);
bool MakeCudaBackend(const antman_mem_config& config, Backend* out, std::string* err);
// The same with the driver library at `library` (tests load a fake driver this way).
bool MakeCudaBackendFrom(const char* library, const antman_mem_config& config, Backend* out,
                         std::string* err);
// Empty when the device can serve the host fallback arena (unified addressing and mapped host
// memory), or when there is no host arena; else the start-up error.
std::string CheckHostMappingSupport(int ordinal, int unified_addressing, int can_map_host,
                                    uint64_t host_capacity);

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_BACKEND_H_
