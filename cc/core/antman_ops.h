/* tf-antman op manager: C API (libantman_core.so).
 *
 * One `antman_opm` limits the share of time a job keeps one device busy by
 * delaying the *start* of its operators (paper §3.1.2, §4.1); it never runs an
 * op. C++ class: cc/core/op_manager.h; algorithm: docs/op-manager.md.
 *
 * Host-timed op (the op's busy time is measured on the host):
 *     int64_t t;
 *     antman_opm_admit(m, ANTMAN_TIMING_HOST, &t);   // blocks until the op may start
 *     ... run the op ...
 *     antman_opm_finish(m, t);
 * Device-timed op (a GPU launch; its kernel time is known later):
 *     antman_opm_admit(m, ANTMAN_TIMING_DEVICE, &t);
 *     antman_opm_launched(m, &provisional);          // charges the profiled op time now
 *     ... launch; later, from the device's own timestamps ...
 *     antman_opm_device_done(m, provisional, start_ns, end_ns);
 * On a CUDA stream, cc/core/cuda_gate.h does the device-timed sequence for you.
 * While antman_opm_unthrottled(m) is 1 (share 1) callers may skip the manager.
 *
 * Errors: a function that returns int returns ANTMAN_OK (0) on success, else a
 * non-zero ANTMAN_ERR_* code; antman_core_last_error() then gives a message
 * naming the bad field and its accepted range (per thread, valid until the
 * thread's next failing call). A bad argument is an error, never a crash.
 * Thread safety: every function may be called from any thread.
 * Units: nanoseconds on the manager's clock (CLOCK_MONOTONIC, the same as
 * std::chrono::steady_clock), shares as fractions in [0, 1].
 */
#ifndef TF_ANTMAN_CC_CORE_ANTMAN_OPS_H_
#define TF_ANTMAN_CC_CORE_ANTMAN_OPS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct below or a signature changes. */
#define ANTMAN_OPS_ABI_VERSION 2  /* 2: antman_opm_config.device_burst_ns */

#define ANTMAN_OK 0
#define ANTMAN_ERR_INVALID 1 /* a bad argument; the message names it */
#define ANTMAN_ERR_DEVICE 2  /* the device or its driver failed or is absent */

/* antman_opm_admit's admitted time for an op admitted inside another host
 * op of the same manager on the same thread (see op_manager.h, kNested). */
#define ANTMAN_OPM_NESTED (-1)

typedef enum {
  ANTMAN_TIMING_HOST = 0,   /* busy from admission to antman_opm_finish */
  ANTMAN_TIMING_DEVICE = 1, /* busy while the device runs it (device_done) */
} antman_timing;

/* ABI versions of the C APIs this library serves; a binding checks all three
 * before it binds anything else. */
typedef struct {
  int32_t mem;  /* ANTMAN_MEM_ABI_VERSION  (cc/core/antman_memory.h) */
  int32_t ops;  /* ANTMAN_OPS_ABI_VERSION  (this file) */
  int32_t gate; /* ANTMAN_GATE_ABI_VERSION (cc/core/cuda_gate.h) */
} antman_core_abi;
void antman_core_get_abi(antman_core_abi* out);

/* Message of this thread's last failing call ("" if none). */
const char* antman_core_last_error(void);

typedef struct {
  double initial_share;           /* [0, 1]; 1 admits every op at once */
  int64_t window_ns;              /* (0, 2^63): span of achieved_share_window */
  int64_t max_credit_ns;          /* [0, 2^63): busy time a job may bank */
  int64_t max_pending_device_ops; /* [1, 2^63): launched, not completed */
  int64_t device_burst_ns;        /* [0, 1e9]: a device-timed job out of its
                                     share waits until it has banked this much
                                     (at most max_credit_ns), then runs back to
                                     back: fewer GPU context switches */
} antman_opm_config;

/* Mirrors OpManager::Stats. */
typedef struct {
  int64_t busy_ns;          /* union of the busy time of finished ops */
  int64_t idle_inserted_ns; /* time the head of the line waited for tokens */
  int64_t ops_total;        /* ops finished (host) or completed (device) */
  int64_t ops_delayed;      /* admissions that had to wait */
  int64_t ops_waiting_now;  /* callers blocked in admit */
  int64_t ops_in_flight;    /* host ops not finished + device ops not done */
  double share;             /* target share now */
  double achieved_share_window; /* busy / wall over the last window_ns */
  int64_t window_ns;
  int32_t paused;           /* 1 when share == 0 */
  int32_t reserved0;        /* 0; keeps the layout explicit */
  int64_t op_ns_ewma;       /* profiled op busy time */
  int64_t credit_ns;        /* banked busy time; negative = idle owed */
} antman_opm_stats;

typedef struct antman_opm antman_opm;

/* The defaults of OpManager::Options: share 1, window 1 s, credit 5 ms,
 * 256 pending device ops, device bursts of 2 ms. */
void antman_opm_default_config(antman_opm_config* out);

/* Returns ANTMAN_OK and sets *out, or ANTMAN_ERR_INVALID with the message in
 * err (NUL-terminated, truncated to errlen) and in antman_core_last_error(). */
int antman_opm_create(const antman_opm_config* config, antman_opm** out,
                      char* err, size_t errlen);
/* Releases callers blocked in admit (admitted unthrottled), waits until none
 * is left inside it, and frees the manager. It must be the handle's last call:
 * a caller it released must not call finish (or anything) on it afterwards, so
 * stop the threads that use a manager before destroying it. A gate using it
 * must be destroyed first. NULL is ignored. */
void antman_opm_destroy(antman_opm* opm);

/* share in [0, 1]; 0 holds every new op at its admission (pause). */
int antman_opm_set_share(antman_opm* opm, double share);
/* 1 while the share is 1 (callers may skip the manager), else 0; NULL: 0. */
int antman_opm_unthrottled(const antman_opm* opm);

/* Blocks until the op may start; *admitted_ns gets the admission time or
 * ANTMAN_OPM_NESTED. timing: an antman_timing. */
int antman_opm_admit(antman_opm* opm, int timing, int64_t* admitted_ns);
/* Ends a host-timed op: admitted_ns as returned by admit. */
int antman_opm_finish(antman_opm* opm, int64_t admitted_ns);
/* After admit(ANTMAN_TIMING_DEVICE) and the launch: charges the profiled op
 * time provisionally; *provisional_ns goes to device_done. The op holds one of
 * max_pending_device_ops slots from its admission to device_done. */
int antman_opm_launched(antman_opm* opm, int64_t* provisional_ns);
/* The device ran the op over [start_ns, end_ns) on the manager's clock
 * (0 <= start_ns <= end_ns <= antman_opm_now_ns() at the call; start_ns ==
 * end_ns: nothing ran, e.g. a failed launch). Replaces the provisional charge
 * and returns the op's pending slot, taken by admit(ANTMAN_TIMING_DEVICE). */
int antman_opm_device_done(antman_opm* opm, int64_t provisional_ns,
                           int64_t start_ns, int64_t end_ns);
/* The manager's clock now, in ns; -1 for NULL. */
int64_t antman_opm_now_ns(const antman_opm* opm);
int antman_opm_get_stats(const antman_opm* opm, antman_opm_stats* out);

#ifdef __cplusplus
}
#endif

#endif /* TF_ANTMAN_CC_CORE_ANTMAN_OPS_H_ */
