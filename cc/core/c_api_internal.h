// Shared by the C API files of libantman_core.so (antman_ops.cc, cuda_gate.cc).
#ifndef TF_ANTMAN_CC_CORE_C_API_INTERNAL_H_
#define TF_ANTMAN_CC_CORE_C_API_INTERNAL_H_

#include <cstddef>
#include <memory>
#include <string>

#include "cc/core/op_manager.h"

struct antman_opm {
  std::unique_ptr<antman::OpManager> manager;
};

namespace antman {

// Sets this thread's antman_core_last_error() and returns `code`.
int SetLastError(int code, const std::string& message);
// Copies `message` into a caller's buffer (NUL-terminated, truncated).
void CopyError(char* err, size_t errlen, const std::string& message);

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_C_API_INTERNAL_H_
