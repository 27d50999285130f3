// Stream-ordered reuse of PyTorch's CUDA blocks over the (stream-unaware) memory core.
//
// PyTorch's contract for a CUDA allocator (c10/cuda/CUDACachingAllocator.cpp, read for torch
// 2.14.1): a block freed by the host may still be read or written by kernels queued on the
// stream it was allocated on, and on every stream `Tensor.record_stream` named. So a freed block
// may be handed out again at once only to an allocation on its own stream (stream order makes
// the new kernels run after the old ones); to another stream only once events recorded after the
// free, on every stream that used it, have completed. PyTorch's own allocator keeps per-stream
// pools for this; the memory core's BFC (cc/core) hands any free block to the next request, so
// this layer sits between PyTorch and the core:
//
//   - one stream only (PyTorch's default: every allocation on the same stream) and no
//     record_stream: a freed block goes back to the core at once (stream order is enough). No
//     event, no query: the cost of the common case is a map lookup;
//   - the first allocation on a second stream waits once, on the host, for the first stream's
//     queued work (an event recorded then synchronised), since blocks freed to the core before
//     that may still be in use there; from then on the cache is "multi-stream":
//   - a block freed with no other stream recorded is kept in its stream's free list, reusable at
//     once by that stream; the frees of a stream are sealed together by one event at the next
//     allocation (of any stream), and a batch whose event has completed goes back to the core,
//     where any stream may take it;
//   - a block with record_stream uses is kept back from everyone until events recorded at its
//     free on each of those streams (and, in multi-stream mode, on its own) have completed;
//   - when the core cannot serve a request from device memory while blocks are kept back, every
//     kept-back block's event is waited for and they go back to the core, then the request is
//     retried (with the core's host fallback): as PyTorch's allocator synchronises its events
//     before it reports out of memory.
//
// Events are only ever queried (never waited for) except in those two places and in Drain()
// (empty_cache). Framework-free: StreamEvents and BlockSource are interfaces, implemented over
// the CUDA driver and the memory core by allocator_shim.cc and by a model in the tests
// (stream_ordered_test.cc, which runs kernels of several streams asynchronously and fails on any
// block handed out while a kernel of another stream may still touch it).
//
// CUDA graph capture is not served here: the PyTorch extension refuses it at capture start
// (docs/pytorch.md), so nothing in this file runs while a capture is underway.
//
// Thread safety: every member function may be called from any thread (one mutex).
#ifndef TF_ANTMAN_CC_TORCH_STREAM_ORDERED_H_
#define TF_ANTMAN_CC_TORCH_STREAM_ORDERED_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace antman_torch {

using Stream = void*;  // cudaStream_t / CUstream, never dereferenced here
using Event = void*;   // CUevent

// What the cache needs of CUDA streams and events.
class StreamEvents {
 public:
  virtual ~StreamEvents() = default;
  // Records an event after the work queued on `stream` so far; nullptr if that failed.
  virtual Event Record(Stream stream) = 0;
  // True once every piece of work before the record has completed. An error other than "not
  // ready" also reads true: the driver has nothing left to run for it (a sticky error poisons
  // the whole context anyway).
  virtual bool Done(Event event) = 0;
  // Blocks the calling thread until the event has completed.
  virtual void Wait(Event event) = 0;
  // Blocks until all work queued on the stream has completed (used when Record failed).
  virtual void Synchronize(Stream stream) = 0;
  // The event is no longer needed (pooled or destroyed).
  virtual void Release(Event event) = 0;
};

// Where blocks come from and go back to: the memory core of one device.
class BlockSource {
 public:
  virtual ~BlockSource() = default;
  // nullptr if it cannot serve; device_only: refuse rather than serve from the host fallback.
  virtual void* Alloc(size_t bytes, bool device_only) = 0;
  virtual void Free(void* ptr) = 0;
  // Bytes really held for ptr (>= what was asked).
  virtual size_t Size(const void* ptr) = 0;
};

// Figures of the layer itself (PyTorch's view: a block kept back is free to PyTorch, though the
// core still counts it in use).
struct StreamCacheStats {
  uint64_t live_blocks = 0;        // handed to PyTorch and not freed
  uint64_t live_bytes = 0;         // their sizes as held (rounded)
  uint64_t live_requested = 0;     // their sizes as asked
  uint64_t peak_live_blocks = 0;   // peaks since creation or ResetPeaks()
  uint64_t peak_live_bytes = 0;
  uint64_t peak_live_requested = 0;
  uint64_t allocs = 0;             // cumulative since creation or ResetAccumulated()
  uint64_t frees = 0;
  uint64_t alloc_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t alloc_requested = 0;
  uint64_t free_requested = 0;
  uint64_t kept_blocks = 0;        // freed, kept back from other streams (not in the core)
  uint64_t kept_bytes = 0;
  uint64_t same_stream_reuses = 0; // allocations served from their stream's free list
  uint64_t host_waits = 0;         // events waited for on the host (switch, retry, drain)
  uint64_t retries = 0;            // requests the core refused until kept-back blocks came back
  uint64_t failures = 0;           // requests neither could serve
  uint64_t streams = 0;            // streams that allocated
  bool multi_stream = false;
};

class StreamOrderedCache {
 public:
  // Both must outlive the cache.
  StreamOrderedCache(BlockSource* source, StreamEvents* events);
  // Blocks still kept back go back to the core after their events (waited for).
  ~StreamOrderedCache();
  StreamOrderedCache(const StreamOrderedCache&) = delete;
  StreamOrderedCache& operator=(const StreamOrderedCache&) = delete;

  // A block of at least `bytes` (> 0) for work on `stream`; nullptr if neither a kept block
  // nor the core can serve it.
  void* Malloc(size_t bytes, Stream stream);
  // Returns false for a pointer this cache did not hand out (ignored).
  bool Free(void* ptr);
  // `stream` uses the live block at ptr (Tensor.record_stream); false if ptr is unknown.
  bool RecordStream(void* ptr, Stream stream);
  // Gives back to the core, without waiting, every kept block whose events have completed.
  void Poll();
  // Waits for every kept block's events and gives them all back to the core (empty_cache).
  // Returns the bytes given back.
  uint64_t Drain();

  StreamCacheStats Stats();
  void ResetPeaks();        // peaks := current
  void ResetAccumulated();  // cumulative counters := 0

 private:
  struct Block {
    size_t size = 0;       // as held
    size_t requested = 0;  // as asked
    Stream stream = nullptr;
    std::vector<Stream> uses;  // other streams (record_stream)
  };
  struct Kept {  // a freed block in its stream's free list
    Stream stream = nullptr;
    size_t size = 0;
    uint64_t batch = 0;
  };
  struct Batch {
    uint64_t id = 0;
    Event event = nullptr;  // nullptr: still open (no event recorded yet)
    std::vector<void*> ptrs;
  };
  struct PerStream {
    std::multimap<size_t, void*> free_list;  // reusable at once on this stream
    Batch open;
    std::deque<Batch> sealed;  // in record order: they complete in that order
  };
  struct Withheld {  // freed with record_stream uses: nobody may take it yet
    void* ptr = nullptr;
    size_t size = 0;
    std::vector<Event> events;
  };

  void NoteStreamLocked(Stream stream);
  void SealLocked();
  void PollLocked();
  uint64_t DrainLocked();
  void GiveBackLocked(void* ptr, size_t size);
  void GiveBackBatchLocked(PerStream& ps, const Batch& batch);
  void* TakeKeptLocked(size_t bytes, Stream stream);
  Event RecordOrSyncLocked(Stream stream);
  void CountLiveLocked();

  BlockSource* source_;
  StreamEvents* events_;
  std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::unordered_map<void*, Kept> kept_;
  std::unordered_map<Stream, PerStream> streams_;
  std::vector<Withheld> withheld_;
  Stream first_stream_ = nullptr;
  bool any_stream_ = false;
  uint64_t next_batch_ = 1;
  StreamCacheStats stats_;
};

}  // namespace antman_torch

#endif  // TF_ANTMAN_CC_TORCH_STREAM_ORDERED_H_
