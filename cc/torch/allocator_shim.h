/* tf-antman memory for PyTorch: the C functions torch.cuda.memory.CUDAPluggableAllocator calls.
 *
 * PyTorch loads this library by path and calls
 *     void* antman_torch_malloc(ssize_t size, int device, cudaStream_t stream);
 *     void  antman_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
 * for every CUDA tensor allocation of the process. antman_torch_malloc throws a C++ exception
 * when it cannot serve a request (below): only C++ callers built with exceptions may call it;
 * C and ctypes callers use antman_torch_try_malloc, which returns NULL instead.
 *
 * Each device served has its own memory core (cc/core/antman_memory.h): a limited BFC allocator
 * over device memory whose limit can change at run time, and a host arena (pinned, device-mapped
 * memory on CUDA) used when the device is at its limit, so a job over its limit slows down
 * instead of failing with out-of-memory.
 *
 * The library also exports the memory core's C API (antman_mem_*) so that the Python binding
 * (tf_antman/torch/_shim.py) reads statistics and changes limits on the very cores it serves
 * with: antman_torch_mem(device) gives the core of a device. No torch or CUDA headers are needed
 * to build it; cudaStream_t is taken as an opaque pointer.
 *
 * Streams: PyTorch's contract is honoured by a stream-ordered cache between PyTorch and each
 * core (stream_ordered.h): a freed block is reused at once on its own stream, on another only
 * after events on every stream that used it (antman_torch_record_stream) have completed.
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
#include "cc/torch/torch_stats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature or the contract of a function below changes. 2: antman_torch_malloc
 * throws instead of returning NULL; antman_torch_try_malloc added. 3: stream-ordered reuse
 * (malloc uses its stream), record_stream, empty_cache, poll, get_stats, reset_peaks,
 * reset_accumulated. */
#define ANTMAN_TORCH_ABI_VERSION 3
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

/* Marks the functions that never throw, for C++ callers (nothing in C). */
#ifdef __cplusplus
#define ANTMAN_TORCH_NOEXCEPT noexcept
#else
#define ANTMAN_TORCH_NOEXCEPT
#endif

/* PyTorch's alloc function. size <= 0 returns NULL (PyTorch passes 0 for empty tensors). A
 * device without a core, or a request neither device nor host memory can serve, is counted in
 * antman_torch_failures() (the first few are reported on stderr with the sizes) and THROWS a
 * std::runtime_error whose message starts "tf-antman: CUDA out of memory." and gives the bytes
 * asked for, the device and its limit, use and host fallback (or, for a device without a core,
 * "tf-antman: no memory core for CUDA device N"). Never NULL for size > 0: PyTorch's
 * CUDAPluggableAllocator::allocate wraps whatever comes back in a tensor without checking, so
 * NULL would make a tensor at address 0 and the next kernel would fault with an illegal memory
 * access, which poisons CUDA for the whole process. The exception instead goes up through PyTorch, which turns
 * it into a Python RuntimeError the job can catch. Not callable from C or ctypes: an exception
 * there ends the process (std::terminate); those use antman_torch_try_malloc. */
void* antman_torch_malloc(ssize_t size, int device, void* stream);
/* antman_torch_malloc without the exception: NULL where it would throw (same counting and
 * report; an exception from inside the core is caught and NULL too). For C and ctypes callers (tf_antman/torch/_shim.py, the tests); never give it to
 * PyTorch. */
void* antman_torch_try_malloc(ssize_t size, int device, void* stream) ANTMAN_TORCH_NOEXCEPT;
/* PyTorch's free function. NULL is ignored; size and stream are not needed (the core knows the
 * block); a pointer the device's core does not hold is reported on stderr and ignored. */
void antman_torch_free(void* ptr, ssize_t size, int device, void* stream);

/* Tensor.record_stream: `stream` uses the live block at ptr. 0, or 1 if device or ptr is unknown. */
int antman_torch_record_stream(void* ptr, int device, void* stream);
/* torch.cuda.empty_cache(): waits for the events of freed blocks streams may still use, gives
 * them back to the core, and releases the core's free cached regions. Returns the bytes of the
 * blocks given back. */
uint64_t antman_torch_empty_cache(int device);
/* Gives back to the core, without waiting, freed blocks whose streams are done (step boundary). */
void antman_torch_poll(int device);
/* PyTorch's DeviceStats of the device (torch_stats.h). 0, or 1 (zeroed) without a core. */
int antman_torch_get_stats(int device, antman_torch_device_stats* out);
/* torch.cuda.reset_peak_memory_stats / reset_accumulated_memory_stats. */
void antman_torch_reset_peaks(int device);
void antman_torch_reset_accumulated(int device);

/* Requests refused by antman_torch_malloc or antman_torch_try_malloc (no core for the device, or
 * out of memory). */
uint64_t antman_torch_failures(void);

/* Destroys every core (for tests: PyTorch never calls it; blocks still live are lost). */
void antman_torch_reset_for_tests(void);

#ifdef __cplusplus
}
#endif

#endif /* TF_ANTMAN_CC_TORCH_ALLOCATOR_SHIM_H_ */
