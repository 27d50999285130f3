/* tf-antman memory core: C API.
 *
 * One `antman_mem` is the universal memory of one device: a limited BFC
 * allocator over device memory whose upper limit can change at run time, and a
 * host arena used when the device allocator is at its limit (paper §3.1.1,
 * §4.1). No TensorFlow types cross this boundary, so a second framework can
 * use the same core.
 *
 * Thread safety: every function may be called from any thread.
 * Units: bytes, nanoseconds.
 */
#ifndef TF_ANTMAN_CC_CORE_ANTMAN_MEMORY_H_
#define TF_ANTMAN_CC_CORE_ANTMAN_MEMORY_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ANTMAN_MEM_ABI_VERSION 1

typedef enum {
  /* Host RAM stands in for device memory, with a capacity budget. */
  ANTMAN_BACKEND_EMULATED = 0,
  /* CUDA driver API, loaded with dlopen at run time. */
  ANTMAN_BACKEND_CUDA = 1,
} antman_backend;

typedef struct {
  int backend;                  /* antman_backend */
  int device_ordinal;           /* CUDA device ordinal; emulated: an id only */
  uint64_t device_capacity;     /* emulated: budget (>0). CUDA: 0 = free memory */
  uint64_t limit;               /* initial upper limit; 0 = device_capacity */
  uint64_t host_capacity;       /* cap on host fallback bytes; 0 = no fallback */
  uint64_t min_region;          /* smallest region the BFC grows by; 0 = 2 MiB */
  /* Host regions with no live block for this long are unpinned and given back;
   * 0 = 10000 ms, else 1..86400000 ms. */
  uint64_t host_idle_release_ms;
} antman_mem_config;

typedef struct {
  uint64_t limit;               /* upper limit in force */
  uint64_t pending_limit;       /* requested, applied at next step boundary; 0 = none */
  uint64_t device_capacity;
  uint64_t in_use;              /* device bytes in live blocks (rounded sizes) */
  uint64_t reserved;            /* device bytes held from the driver in regions (in use +
                                   cached + queued for release at the next safe point) */
  uint64_t peak_in_use;         /* lifetime peak of in_use */
  uint64_t step_peak_in_use;    /* peak of in_use since the last step boundary */
  uint64_t step_min_in_use;     /* minimum of in_use since the last step boundary */
  uint64_t host_in_use;         /* bytes live in the host fallback arena */
  uint64_t host_peak;           /* lifetime peak of host_in_use */
  uint64_t step_host_peak;      /* peak of host_in_use since the last step boundary */
  uint64_t host_capacity;
  uint64_t host_fallbacks;      /* allocations served by host memory (count) */
  uint64_t host_bytes_served;   /* total bytes ever served by host memory */
  uint64_t device_allocs;       /* allocations served by device memory (count) */
  uint64_t device_bytes_served; /* total bytes ever served by device memory */
  uint64_t failed_allocs;       /* requests neither device nor host could serve */
  uint64_t regions;             /* device regions currently held */
  uint64_t shrink_regions_freed;  /* lifetime */
  uint64_t shrink_bytes_freed;    /* lifetime */
  uint64_t last_shrink_ns;        /* duration of the last shrink */
  uint64_t last_shrink_unfreed;   /* bytes above the target the last shrink could not free */
  uint64_t steps;                 /* step boundaries seen */
  uint64_t largest_region;        /* largest device region held now */
} antman_mem_stats;

/* Figures added after ABI version 1. Fields are only ever appended: a caller
 * passes sizeof of the struct it was compiled with and gets that many bytes. */
typedef struct {
  uint64_t device_pinned;          /* device bytes in regions holding a live block */
  uint64_t fit_release_regions;    /* cached device regions given back so that an
                                      allocation fits on the device (lifetime) */
  uint64_t fit_release_bytes;
  uint64_t fit_retry_allocs;       /* device allocations served only after such a release */
  uint64_t growth_returns;         /* regions returned because the limit fell while they
                                      were being fetched */
  uint64_t host_reserved;          /* bytes held in host (pinned) regions */
  uint64_t host_regions;
  uint64_t host_idle_release_regions;  /* host regions unpinned after idling (lifetime) */
  uint64_t host_idle_release_bytes;
  uint64_t host_idle_release_ns;   /* the idle time in force */
  /* Appended for the front-ends' statistics contracts (TF's AllocatorStats,
   * torch.cuda.memory_stats) and the safe-point releases. */
  uint64_t largest_alloc;          /* largest block served (device or host, size as held,
                                      >= the request) since create or the last reset_peaks */
  uint64_t peak_total_in_use;      /* peak of device + host bytes in live blocks since create
                                      or the last reset_peaks; >= total_in_use in the same read */
  uint64_t total_in_use;           /* device + host bytes in live blocks */
  uint64_t driver_refusals;        /* region requests the driver refused (lifetime) */
  uint64_t driver_cap;             /* device growth capped here after a refusal (held + the
                                      driver's free memory then), for a backoff; 0 = none */
  uint64_t deferred_release_bytes; /* free regions queued for the next safe point: still held
                                      from the driver (counted in reserved / host_reserved),
                                      no longer served */
  uint64_t deferred_release_regions;
  uint64_t deferred_released_bytes;  /* lifetime: queued bytes given back at safe points */
  uint64_t release_syncs;          /* device synchronisations before giving regions back */
  uint64_t last_release_sync_ns;   /* duration of the last device one */
  uint64_t device_only_failures;   /* antman_mem_alloc_device_only calls that got NULL */
} antman_mem_ext_stats;

typedef struct antman_mem antman_mem;

/* Returns 0 and sets *out on success; otherwise a non-zero code and a message
 * in err (NUL-terminated, truncated to errlen). */
int antman_mem_create(const antman_mem_config* config, antman_mem** out,
                      char* err, size_t errlen);
void antman_mem_destroy(antman_mem* mem);

/* A NULL mem (or a NULL out below) is a caller's bug, never a crash: calls
 * return NULL / 0 / -1 as for "nothing", free and the limit calls do nothing,
 * get_stats zeroes *out, check_invariants returns 1 with a message. */

/* Device memory first; host arena when the device allocator is at its limit.
 * NULL when neither can serve (the caller reports out of memory). alignment is
 * a power of two <= 4096. bytes == 0 returns NULL. */
void* antman_mem_alloc(antman_mem* mem, size_t alignment, size_t bytes);
void antman_mem_free(antman_mem* mem, void* ptr);
/* Device memory or NULL, never the host arena: for requests that must fail
 * fast rather than land in host memory (TF's retry_on_failure=false, cuDNN /
 * cuFFT scratch, autotuning). Same limit and rules as antman_mem_alloc's
 * device part; free it with antman_mem_free. */
void* antman_mem_alloc_device_only(antman_mem* mem, size_t alignment, size_t bytes);

/* 1 if ptr was served by the host arena, 0 if by device memory, -1 unknown. */
int antman_mem_is_host(antman_mem* mem, const void* ptr);
/* Size the allocator really holds for ptr (>= requested); 0 if unknown. */
size_t antman_mem_allocated_size(antman_mem* mem, const void* ptr);

/* Applies a new limit now: growth is immediate; a shrink releases whole free
 * regions until reserved <= max(in_use rounded to regions, limit). Returns the
 * bytes freed; *unfreed (may be NULL) gets how far reserved stays above limit. */
uint64_t antman_mem_set_limit(antman_mem* mem, uint64_t limit, uint64_t* unfreed);
/* Records a limit to apply at the next step boundary (last request wins). */
void antman_mem_request_limit(antman_mem* mem, uint64_t limit);
/* Releases every free cached region now; returns bytes freed. */
uint64_t antman_mem_release_cached(antman_mem* mem);
/* End of a mini-batch, the allocator's safe point: applies a pending limit,
 * gives back to the driver the regions frees queued and host regions idle for
 * host_idle_release_ms (after one device synchronisation, timed in
 * last_release_sync_ns), then resets per-step stats. No other call frees
 * driver memory except set_limit, release_cached (both prompt) and an
 * allocation that must release its own cache to fit (fit_release_*). */
void antman_mem_step_boundary(antman_mem* mem);
/* Peaks (peak_in_use, host_peak, peak_total_in_use) restart from the current
 * values and largest_alloc from 0 (torch.cuda.reset_peak_memory_stats, TF's
 * ClearStats). Step statistics are not touched. */
void antman_mem_reset_peaks(antman_mem* mem);

void antman_mem_get_stats(antman_mem* mem, antman_mem_stats* out);
/* Fills min(size, sizeof(antman_mem_ext_stats)) bytes of *out; returns that count. */
size_t antman_mem_get_ext_stats(antman_mem* mem, antman_mem_ext_stats* out, size_t size);

/* Checks allocator invariants (no overlapping blocks, free neighbours
 * coalesced, accounting equal to the sum of live blocks). 0 if all hold,
 * otherwise non-zero with a description in err. For tests; takes the locks. */
int antman_mem_check_invariants(antman_mem* mem, char* err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* TF_ANTMAN_CC_CORE_ANTMAN_MEMORY_H_ */
