// Stream-ordered reuse over the memory core: the contract and the rules are in stream_ordered.h.
#include "cc/torch/stream_ordered.h"

#include <algorithm>
#include <utility>

namespace antman_torch {

namespace {

// A block of a stream's free list serves a request only if it wastes at most this much of it:
// the list holds blocks only until their stream's event completes, so a miss costs little,
// while a large block kept for a small request would be held as in use by the core.
bool FitsWell(size_t have, size_t want) {
  return have >= want && have - want <= std::max<size_t>(want / 4, 4096);
}

}  // namespace

StreamOrderedCache::StreamOrderedCache(BlockSource* source, StreamEvents* events)
    : source_(source), events_(events) {}

StreamOrderedCache::~StreamOrderedCache() {
  std::lock_guard<std::mutex> lock(mu_);
  DrainLocked();
}

void StreamOrderedCache::NoteStreamLocked(Stream stream) {
  if (!any_stream_) {
    any_stream_ = true;
    first_stream_ = stream;
  }
  if (streams_.find(stream) == streams_.end()) {
    streams_[stream].open.id = next_batch_++;
    stats_.streams = streams_.size();
  }
  if (stats_.multi_stream || stream == first_stream_) return;
  // Blocks the first stream freed went straight back to the core (stream order was enough while
  // it was the only one to allocate): its queued work may still use them, and this stream may
  // now be handed one. Wait once for that work; from here on frees are kept per stream.
  Event e = events_->Record(first_stream_);
  if (e != nullptr) {
    events_->Wait(e);
    events_->Release(e);
  } else {
    events_->Synchronize(first_stream_);
  }
  ++stats_.host_waits;
  stats_.multi_stream = true;
}

Event StreamOrderedCache::RecordOrSyncLocked(Stream stream) {
  Event e = events_->Record(stream);
  if (e == nullptr) {  // no event: make the stream's work done now instead
    events_->Synchronize(stream);
    ++stats_.host_waits;
  }
  return e;
}

void StreamOrderedCache::GiveBackLocked(void* ptr, size_t size) {
  --stats_.kept_blocks;
  stats_.kept_bytes -= size;
  source_->Free(ptr);
}

void StreamOrderedCache::SealLocked() {
  for (auto& [stream, ps] : streams_) {
    if (ps.open.ptrs.empty()) continue;
    Event e = RecordOrSyncLocked(stream);
    Batch batch = std::move(ps.open);
    ps.open = Batch{};
    ps.open.id = next_batch_++;
    if (e != nullptr) {
      batch.event = e;
      ps.sealed.push_back(std::move(batch));
      continue;
    }
    // Synchronised instead: the batch is done already.
    GiveBackBatchLocked(ps, batch);
  }
}

// A batch whose event completed (or whose stream was synchronised): its blocks still kept in
// the stream's free list go back to the source; those reused since are left alone.
void StreamOrderedCache::GiveBackBatchLocked(PerStream& ps, const Batch& batch) {
  for (void* p : batch.ptrs) {
    auto it = kept_.find(p);
    if (it == kept_.end() || it->second.batch != batch.id) continue;  // reused since
    auto range = ps.free_list.equal_range(it->second.size);
    for (auto f = range.first; f != range.second; ++f) {
      if (f->second == p) {
        ps.free_list.erase(f);
        break;
      }
    }
    const size_t size = it->second.size;
    kept_.erase(it);
    GiveBackLocked(p, size);
  }
}

void StreamOrderedCache::PollLocked() {
  for (auto& [stream, ps] : streams_) {
    // A stream's events complete in the order they were recorded: stop at the first not done.
    while (!ps.sealed.empty() && events_->Done(ps.sealed.front().event)) {
      Batch& batch = ps.sealed.front();
      GiveBackBatchLocked(ps, batch);
      events_->Release(batch.event);
      ps.sealed.pop_front();
    }
  }
  for (size_t i = 0; i < withheld_.size();) {
    Withheld& w = withheld_[i];
    auto& ev = w.events;
    for (size_t j = 0; j < ev.size();) {
      if (events_->Done(ev[j])) {
        events_->Release(ev[j]);
        ev[j] = ev.back();
        ev.pop_back();
      } else {
        ++j;
      }
    }
    if (!ev.empty()) {
      ++i;
      continue;
    }
    GiveBackLocked(w.ptr, w.size);
    withheld_[i] = std::move(withheld_.back());
    withheld_.pop_back();
  }
}

uint64_t StreamOrderedCache::DrainLocked() {
  const uint64_t before = stats_.kept_bytes;
  if (stats_.multi_stream) SealLocked();
  for (auto& [stream, ps] : streams_) {
    for (Batch& batch : ps.sealed) {
      events_->Wait(batch.event);
      ++stats_.host_waits;
    }
  }
  for (Withheld& w : withheld_) {
    for (Event e : w.events) {
      events_->Wait(e);
      ++stats_.host_waits;
    }
  }
  PollLocked();  // every event is done now: all of them go back
  return before - stats_.kept_bytes;
}

void* StreamOrderedCache::TakeKeptLocked(size_t bytes, Stream stream) {
  auto sit = streams_.find(stream);
  if (sit == streams_.end()) return nullptr;
  auto& fl = sit->second.free_list;
  auto it = fl.lower_bound(bytes);
  if (it == fl.end() || !FitsWell(it->first, bytes)) return nullptr;
  void* p = it->second;
  fl.erase(it);
  auto k = kept_.find(p);
  stats_.kept_bytes -= k->second.size;
  --stats_.kept_blocks;
  kept_.erase(k);  // its batch still lists it; the batch id check skips it there
  ++stats_.same_stream_reuses;
  return p;
}

void* StreamOrderedCache::Malloc(size_t bytes, Stream stream) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  NoteStreamLocked(stream);
  // Reuse on the block's own stream needs no event: seal (record events) and poll them only when
  // that misses, so a steady free-then-malloc loop makes no driver call here. Blocks waiting for
  // events go back on the next miss or at the step boundary (antman_torch_poll).
  void* p = stats_.multi_stream ? TakeKeptLocked(bytes, stream) : nullptr;
  size_t size = 0;
  if (p != nullptr) {
    size = source_->Size(p);
  } else {
    if (stats_.multi_stream) SealLocked();
    PollLocked();
    const bool kept_any = stats_.kept_blocks > 0;
    // With blocks kept back, device memory that is merely waiting for an event must not push
    // the request to the host fallback: ask for device memory only, and if refused, wait for
    // the kept blocks, give them back and ask again (host fallback allowed then).
    p = source_->Alloc(bytes, kept_any);
    if (p == nullptr && kept_any) {
      ++stats_.retries;
      DrainLocked();
      p = source_->Alloc(bytes, false);
    }
    if (p == nullptr) {
      ++stats_.failures;
      return nullptr;
    }
    size = source_->Size(p);
  }
  if (size < bytes) size = bytes;
  live_[p] = Block{size, bytes, stream, {}};
  ++stats_.live_blocks;
  stats_.live_bytes += size;
  stats_.live_requested += bytes;
  ++stats_.allocs;
  stats_.alloc_bytes += size;
  stats_.alloc_requested += bytes;
  CountLiveLocked();
  return p;
}

void StreamOrderedCache::CountLiveLocked() {
  stats_.peak_live_blocks = std::max(stats_.peak_live_blocks, stats_.live_blocks);
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  stats_.peak_live_requested = std::max(stats_.peak_live_requested, stats_.live_requested);
}

bool StreamOrderedCache::Free(void* ptr) {
  if (ptr == nullptr) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block b = std::move(it->second);
  live_.erase(it);
  --stats_.live_blocks;
  stats_.live_bytes -= b.size;
  stats_.live_requested -= b.requested;
  ++stats_.frees;
  stats_.free_bytes += b.size;
  stats_.free_requested += b.requested;
  if (!b.uses.empty()) {
    // Kernels on the recorded streams (and, once several streams allocate, on its own) may
    // still touch it: nobody gets it before events after them complete.
    Withheld w{ptr, b.size, {}};
    for (Stream u : b.uses) {
      Event e = RecordOrSyncLocked(u);
      if (e != nullptr) w.events.push_back(e);
    }
    if (stats_.multi_stream) {
      Event e = RecordOrSyncLocked(b.stream);
      if (e != nullptr) w.events.push_back(e);
    }
    if (w.events.empty()) {  // every stream synchronised instead
      source_->Free(ptr);
      return true;
    }
    ++stats_.kept_blocks;
    stats_.kept_bytes += b.size;
    withheld_.push_back(std::move(w));
    return true;
  }
  if (!stats_.multi_stream) {
    source_->Free(ptr);  // one allocating stream: its own order protects the next user
    return true;
  }
  PerStream& ps = streams_[b.stream];
  ps.free_list.emplace(b.size, ptr);
  ps.open.ptrs.push_back(ptr);
  kept_[ptr] = Kept{b.stream, b.size, ps.open.id};
  ++stats_.kept_blocks;
  stats_.kept_bytes += b.size;
  return true;
}

bool StreamOrderedCache::RecordStream(void* ptr, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block& b = it->second;
  if (stream != b.stream && std::find(b.uses.begin(), b.uses.end(), stream) == b.uses.end()) {
    b.uses.push_back(stream);
  }
  return true;
}

void StreamOrderedCache::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  PollLocked();
}

uint64_t StreamOrderedCache::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  return DrainLocked();
}

StreamCacheStats StreamOrderedCache::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void StreamOrderedCache::ResetPeaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_live_blocks = stats_.live_blocks;
  stats_.peak_live_bytes = stats_.live_bytes;
  stats_.peak_live_requested = stats_.live_requested;
}

void StreamOrderedCache::ResetAccumulated() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.allocs = stats_.frees = 0;
  stats_.alloc_bytes = stats_.free_bytes = 0;
  stats_.alloc_requested = stats_.free_requested = 0;
}

}  // namespace antman_torch
