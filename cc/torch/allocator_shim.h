/* tf-antman memory for PyTorch: the C functions torch.cuda.memory.CUDAPluggableAllocator calls.
 *
 * PyTorch loads this library by path and calls
 *     void* antman_torch_malloc(ssize_t size, int device, cudaStream_t stream);
 *     void  antman_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
 * for every CUDA tensor allocation of the process. Each device served has its own memory core
 * (cc/core/antman_memory.h): a limited BFC allocator over device memory whose limit can change
 * at run time, and a host arena (pinned, device-mapped memory on CUDA) used when the device is at
 * its limit, so a job over its limit slows down instead of failing with out-of-memory.
 *
 * The library also exports the memory core's C API (antman_mem_*) so that the Python binding
 * (tf_antman/torch/_shim.py) reads statistics and changes limits on the very cores it serves
 * with: antman_torch_mem(device) gives the core of a device. No torch or CUDA headers are needed
 * to build it; cudaStream_t is taken as an opaque pointer.
 *
 * Streams: the allocator is stream-unaware, like TensorFlow's BFC: a freed block is reused by
 * the next allocation, which is safe when the job's kernels run on one stream (PyTorch's default
 * stream) in order. Work on several streams must keep a tensor alive until every stream that
 * uses it is done (docs/pytorch.md).
 *
 * Thread safety: every function may be called from any thread. Devices are registered once at
 * start (antman_torch_mem_create) before the allocator is installed in PyTorch.
 */
#ifndef TF_ANTMAN_CC_TORCH_ALLOCATOR_SHIM_H_
#define TF_ANTMAN_CC_TORCH_ALLOCATOR_SHIM_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#include "cc/core/antman_memory.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature below changes. */
#define ANTMAN_TORCH_ABI_VERSION 1
/* Device ordinals served: [0, ANTMAN_TORCH_MAX_DEVICES). */
#define ANTMAN_TORCH_MAX_DEVICES 64
/* Alignment of every block handed to PyTorch (cudaMalloc's own guarantee). */
#define ANTMAN_TORCH_ALIGNMENT 256

int antman_torch_abi_version(void);

/* Creates the memory core of config->device_ordinal. Returns 0, or non-zero with a message in
 * err that names the bad field: 1 invalid config or device already registered, 2 the backend
 * could not be brought up (e.g. no CUDA driver). */
int antman_torch_mem_create(const antman_mem_config* config, char* err, size_t errlen);
/* The core serving `device`, or NULL if none was created. */
antman_mem* antman_torch_mem(int device);

/* PyTorch's alloc function. size <= 0 returns NULL (PyTorch passes 0 for empty tensors). A
 * device without a core, or a request neither device nor host memory can serve, returns NULL
 * and counts in antman_torch_failures(); the first few are reported on stderr with the sizes. */
void* antman_torch_malloc(ssize_t size, int device, void* stream);
/* PyTorch's free function. NULL is ignored; size and stream are not needed (the core knows the
 * block); a pointer the device's core does not hold is reported on stderr and ignored. */
void antman_torch_free(void* ptr, ssize_t size, int device, void* stream);

/* Requests that antman_torch_malloc refused (no core for the device, or out of memory). */
uint64_t antman_torch_failures(void);

/* Destroys every core (for tests: PyTorch never calls it; blocks still live are lost). */
void antman_torch_reset_for_tests(void);

#ifdef __cplusplus
}
#endif

#endif /* TF_ANTMAN_CC_TORCH_ALLOCATOR_SHIM_H_ */
