/* tf-antman CUDA event gate: C API (libantman_core.so).
 *
 * Gates kernel launches on CUDA streams through an op manager and charges the
 * manager with the time the *device* spent on them, not the time the launch
 * call took (a launch returns long before its kernels run).
 *
 *     antman_gate_op* op;
 *     antman_gate_begin(gate, stream, &op);  // admit (may block), event before
 *     ... enqueue the op's kernels on `stream` ...
 *     antman_gate_end(gate, op);             // event after; never skip it
 *
 * begin: returns at once with op = NULL while the manager is unthrottled
 *        (share 1: nothing is recorded, end(NULL) does nothing). Otherwise it
 *        admits a device-timed op (blocks while the job is over its share, is
 *        paused, or has max_pending_device_ops launches not completed),
 *        charges the profiled op time provisionally and records a start event
 *        on `stream`.
 * end:   records an end event on `stream` and queues the op. Call it after
 *        the op's last launch: the time of this call bounds what is charged.
 * Charged: device time only, [max(start event, end call + launch lag), end
 *        event) on the manager's clock. The launch lag (ext stats) is measured
 *        with probe events at each anchor: the time from a call that queues
 *        work on an idle stream to the device starting it. An idle stream stamps the start event at begin, so
 *        the op's host work (argument handling, host allocations, a
 *        synchronising free) and the launches would otherwise count as busy;
 *        from the end call on, the stream holds only this op's queued work.
 *        Exact when the device runs behind the host; for an op whose kernels
 *        finish before its end call it undercounts them (host time is never
 *        charged). antman_gate_ext_stats.host_gap_ns sums what was left out.
 * Capture: begin checks cuStreamIsCapturing first; on a stream capturing into
 *        a CUDA graph (or the legacy stream while a blocking stream captures)
 *        the op is let through uncharged (op = NULL, counted in ops_captured):
 *        no event is recorded or queried there. The gate's own threads query
 *        and synchronise in CU_STREAM_CAPTURE_MODE_RELAXED, so they do not
 *        invalidate a capture running elsewhere in the process.
 * A poller thread of the gate waits for the queued ops' end events in the
 * order end was called (poll: cuEventQuery every poll_interval_ns) and calls
 * device_done with the kernel interval [start event, end event) placed on the
 * manager's clock. The stream's earlier work is not charged to the op: the
 * start event completes only when that work has. Events come from a pool and
 * are reused.
 *
 * Clocks: event timestamps are mapped onto the manager's clock through an
 * anchor, an event recorded on a private stream and synchronized, whose host
 * time is known to within the sync's round trip (antman_gate_stats reports
 * it). cuEventElapsedTime is a float in ms (24-bit mantissa: ~60 ns at 1 s,
 * ~1 ms at 3 h), so begin re-anchors when the anchor is older than
 * anchor_interval_ns (one record + sync on the launching thread, about once a
 * second while throttled). An op's duration is read between its own two events
 * and does not depend on the anchor.
 *
 * Context: the device's primary context (the one the CUDA runtime, PyTorch and
 * TensorFlow use); `stream` must belong to it (NULL = its legacy default
 * stream). The driver is loaded with dlopen: without one, create fails with
 * ANTMAN_ERR_DEVICE and a message, it does not crash the process.
 * Lifetime: the manager must outlive the gate. destroy waits until every ended
 * op has completed on the device and been charged; it is the gate's last call
 * (no thread may be in begin or call end after it: stop them first).
 * Thread safety: any thread; begin/end pairs may come from many threads.
 * Errors: as in antman_ops.h (ANTMAN_OK, ANTMAN_ERR_*, antman_core_last_error).
 * A device error seen on an op's events (a failed kernel) returns the op's
 * provisional charge, is counted in stats.errors and does not stop the gate.
 */
#ifndef TF_ANTMAN_CC_CORE_CUDA_GATE_H_
#define TF_ANTMAN_CC_CORE_CUDA_GATE_H_

#include <stddef.h>
#include <stdint.h>

#include "cc/core/antman_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ANTMAN_GATE_ABI_VERSION 1

typedef struct {
  int32_t device_ordinal;     /* CUDA device ordinal, [0, devices visible) */
  int32_t reserved0;          /* 0 */
  int64_t poll_interval_ns;   /* [1000, 100000000]; default 20000 (20 us) */
  int64_t anchor_interval_ns; /* [1000000, 60000000000]; default 1 s */
} antman_gate_config;

typedef struct {
  int64_t ops_begun;          /* begin calls that recorded events */
  int64_t ops_completed;      /* ops charged with their device interval */
  int64_t ops_pending;        /* ended, not completed yet */
  int64_t errors;             /* ops whose events reported a device error */
  int64_t device_busy_ns;     /* sum of the charged kernel intervals */
  int64_t anchors;            /* anchors taken (1 at create) */
  int64_t anchor_uncertainty_ns; /* round trip of the current anchor's sync */
  int64_t events_created;     /* pool size: events ever created */
} antman_gate_stats;

/* Figures added after ABI version 1. Fields are only ever appended: a caller
 * passes sizeof of the struct it was compiled with and gets that many bytes. */
typedef struct {
  int64_t ops_captured;  /* begin calls on a stream capturing into a CUDA graph:
                            let through, not admitted, not charged, no event */
  int64_t host_gap_ns;   /* time between an op's start event and its end call
                            (plus the launch lag) that was not charged (host
                            work; see below) */
  int64_t launch_lag_ns; /* the current anchor's launch lag: how long after a
                            call that queues work on an idle stream the device
                            starts it, placed by the anchor (may be negative
                            by at most half the anchor's uncertainty; 0
                            where not trusted) */
  int64_t launch_lag_untrusted; /* anchors whose lag was not trusted: their or
                            their probes' round trip above 12 us (the GPU
                            time-slicing with another process), taken as 0 */
} antman_gate_ext_stats;

typedef struct antman_gate antman_gate;
typedef struct antman_gate_op antman_gate_op;

void antman_gate_default_config(antman_gate_config* out);
int antman_gate_create(antman_opm* opm, const antman_gate_config* config,
                       antman_gate** out, char* err, size_t errlen);
void antman_gate_destroy(antman_gate* gate);

/* stream: a CUstream / cudaStream_t of the gate's device, or NULL. */
int antman_gate_begin(antman_gate* gate, void* stream, antman_gate_op** op);
int antman_gate_end(antman_gate* gate, antman_gate_op* op);
/* Waits until every ended op has been charged. */
int antman_gate_drain(antman_gate* gate);
int antman_gate_get_stats(antman_gate* gate, antman_gate_stats* out);
/* Fills min(size, sizeof(antman_gate_ext_stats)) bytes of *out; returns that
 * count (0 for a NULL gate or out). */
size_t antman_gate_get_ext_stats(antman_gate* gate, antman_gate_ext_stats* out,
                                 size_t size);

#ifdef __cplusplus
}
#endif

#endif /* TF_ANTMAN_CC_CORE_CUDA_GATE_H_ */
