#include "cc/core/bfc.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

namespace antman {
namespace {

constexpr size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
constexpr size_t kMaxSpareNodes = 256;
constexpr size_t kMaxSlackFraction = 16;

constexpr uint64_t RoundDown(uint64_t n, uint64_t to) { return n / to * to; }

// After the source refused a region, growth is capped at what the source said was free for this
// long, doubling on each further refusal up to the maximum (docs/memory-core.md, "When the
// device is short").
constexpr uint64_t kInitialCapBackoffNs = 100'000'000;   // 100 ms
constexpr uint64_t kMaxCapBackoffNs = 10'000'000'000;    // 10 s

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Describe(const char* what, const void* ptr, uint64_t a, uint64_t b) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s (at %p: %llu vs %llu)", what, ptr,
                static_cast<unsigned long long>(a), static_cast<unsigned long long>(b));
  return buf;
}

}  // namespace

uint64_t SteadyNowNs() { return NowNs(); }

Bfc::Bfc(RegionSource* source, BfcOptions options)
    : source_(source),
      min_region_(RoundUp(std::max<size_t>(options.min_region, kMinChunkBytes), kMinChunkBytes)),
      max_region_(std::max(min_region_, RoundUp(options.max_region, kMinChunkBytes))),
      clock_(options.clock != nullptr ? options.clock : &SteadyNowNs),
      limit_(options.limit),
      next_region_(min_region_) {}

Bfc::~Bfc() {
  for (auto& r : regions_) source_->FreeRegion(r->base, r->bytes);
  for (auto& v : deferred_) source_->FreeRegion(v.base, v.bytes);
}

int Bfc::BinFor(size_t size) {
  const uint64_t units = size / kMinChunkBytes;  // >= 1 for every chunk
  const int log2 = 63 - __builtin_clzll(units | 1);
  return std::min(log2, kNumBins - 1);
}

Bfc::ChunkHandle Bfc::NewChunk() {
  if (!spare_handles_.empty()) {
    const ChunkHandle h = spare_handles_.back();
    spare_handles_.pop_back();
    return h;
  }
  chunks_.emplace_back();
  return static_cast<ChunkHandle>(chunks_.size() - 1);
}

void Bfc::DeleteChunk(ChunkHandle h) {
  chunks_[h] = Chunk();
  spare_handles_.push_back(h);
}

void Bfc::InsertFree(ChunkHandle h) {
  Chunk& c = chunks_[h];
  const FreeKey key{c.size, reinterpret_cast<uintptr_t>(c.ptr), h};
  FreeSet& bin = bins_[BinFor(c.size)];
  if (spare_nodes_.empty()) {
    c.bin_entry = bin.insert(key).first;
    return;
  }
  FreeSet::node_type node = std::move(spare_nodes_.back());
  spare_nodes_.pop_back();
  node.value() = key;
  c.bin_entry = bin.insert(std::move(node)).position;
}

void Bfc::RemoveFree(ChunkHandle h) {
  Chunk& c = chunks_[h];
  FreeSet::node_type node = bins_[BinFor(c.size)].extract(c.bin_entry);
  c.bin_entry = FreeSet::iterator();
  if (spare_nodes_.size() < kMaxSpareNodes) spare_nodes_.push_back(std::move(node));
}

Bfc::ChunkHandle Bfc::FindFree(size_t need) const {
  // Within the first bin, lower_bound is the best fit; in later bins every chunk fits, so the
  // first is the best of that bin and better than any later bin's.
  for (int b = BinFor(need); b < kNumBins; ++b) {
    auto it = bins_[b].lower_bound({need, 0, kNoChunk});
    if (it != bins_[b].end()) return it->handle;
  }
  return kNoChunk;
}

Bfc::ChunkHandle Bfc::Split(ChunkHandle h, size_t offset) {
  const ChunkHandle n = NewChunk();  // may move chunks_: index only after this
  Chunk& c = chunks_[h];
  Chunk& nc = chunks_[n];
  nc.ptr = c.ptr + offset;
  nc.size = c.size - offset;
  nc.prev = h;
  nc.next = c.next;
  nc.in_use = false;
  nc.region = c.region;
  if (c.next != kNoChunk) chunks_[c.next].prev = n;
  c.next = n;
  c.size = offset;
  nc.region->handles[(nc.ptr - nc.region->base) / kMinChunkBytes] = n;
  return n;
}

void Bfc::Merge(ChunkHandle a, ChunkHandle b) {
  Chunk& ca = chunks_[a];
  const Chunk& cb = chunks_[b];
  ca.size += cb.size;
  ca.next = cb.next;
  if (cb.next != kNoChunk) chunks_[cb.next].prev = a;
  cb.region->handles[(cb.ptr - cb.region->base) / kMinChunkBytes] = kNoChunk;
  DeleteChunk(b);
}

void Bfc::NoteInUseChanged() {
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  step_peak_ = std::max(step_peak_, in_use_);
  step_min_ = std::min(step_min_, in_use_);
}

void* Bfc::Carve(ChunkHandle h, size_t rounded, size_t alignment, size_t* chunk) {
  RemoveFree(h);
  const uintptr_t start = reinterpret_cast<uintptr_t>(chunks_[h].ptr);
  const uintptr_t aligned = RoundUp(start, alignment);
  if (aligned != start) {
    // The head stays free; its left neighbour was not free, so no coalescing is due.
    const ChunkHandle rest = Split(h, aligned - start);
    InsertFree(h);
    h = rest;
  }
  // A small remainder stays inside the block (at most 1/16 of it): splitting it off would put a
  // sliver into the bins and cost two tree operations now and a merge later, on the hot path.
  // Not when that slack would put in_use above the limit (the caller checked in_use + rounded).
  const size_t remainder = chunks_[h].size - rounded;
  if (remainder >= std::max(kMinChunkBytes, rounded / kMaxSlackFraction) ||
      (remainder > 0 && in_use_ + chunks_[h].size > limit_)) {
    InsertFree(Split(h, rounded));
  }
  Chunk& c = chunks_[h];
  if (c.region->live++ == 0) pinned_ += c.region->bytes;
  c.in_use = true;
  in_use_ += c.size;
  largest_alloc_ = std::max<uint64_t>(largest_alloc_, c.size);
  if (chunk != nullptr) *chunk = c.size;
  ++allocs_;
  bytes_served_ += c.size;
  NoteInUseChanged();
  return c.ptr;
}

Bfc::Region* Bfc::FindRegion(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  auto it = std::upper_bound(regions_.begin(), regions_.end(), p,
                             [](const char* q, const std::unique_ptr<Region>& r) {
                               return q < r->base;
                             });
  if (it == regions_.begin()) return nullptr;
  Region* r = std::prev(it)->get();
  return p < r->base + r->bytes ? r : nullptr;
}

Bfc::ChunkHandle Bfc::ChunkAt(const void* ptr) const {
  const Region* r = FindRegion(ptr);
  if (r == nullptr) return kNoChunk;
  const size_t offset = static_cast<const char*>(ptr) - r->base;
  if (offset % kMinChunkBytes != 0) return kNoChunk;
  return r->handles[offset / kMinChunkBytes];
}

void Bfc::AddRegion(char* base, size_t bytes) {
  auto region = std::make_unique<Region>();
  region->base = base;
  region->bytes = bytes;
  region->handles.assign(bytes / kMinChunkBytes, kNoChunk);
  const ChunkHandle h = NewChunk();
  Chunk& c = chunks_[h];
  c.ptr = base;
  c.size = bytes;
  c.region = region.get();
  region->handles[0] = h;
  region->free_since_ns = clock_();
  auto at = std::upper_bound(regions_.begin(), regions_.end(), base,
                             [](const char* q, const std::unique_ptr<Region>& r) {
                               return q < r->base;
                             });
  regions_.insert(at, std::move(region));
  reserved_ += bytes;
  InsertFree(h);
}

uint64_t Bfc::GrowthLimit() const {
  if (driver_cap_ == 0 || clock_() >= cap_until_ns_) return limit_;
  return std::min(limit_, driver_cap_);
}

uint64_t Bfc::Room() const {
  // Regions being fetched, being returned or queued for return all still count: the source
  // holds them.
  const uint64_t held = reserved_ + growing_ + releasing_ + deferred_bytes_;
  const uint64_t limit = GrowthLimit();
  return limit > held ? RoundDown(limit - held, kMinChunkBytes) : 0;
}

void Bfc::NoteRefusal(bool free_known, uint64_t free_bytes) {
  // Held now plus free now is what this process could hold at most while the others keep
  // theirs; it does not change when we free or take memory, only when they do. Without an
  // answer from the source, what is held now.
  const uint64_t held = reserved_ + growing_ + releasing_ + deferred_bytes_;
  driver_cap_ = std::max<uint64_t>(held + (free_known ? free_bytes : 0), 1);
  cap_backoff_ns_ = cap_backoff_ns_ == 0 ? kInitialCapBackoffNs
                                         : std::min(cap_backoff_ns_ * 2, kMaxCapBackoffNs);
  cap_until_ns_ = clock_() + cap_backoff_ns_;
}

void* Bfc::Allocate(size_t alignment, size_t bytes, size_t* chunk) {
  if (bytes == 0) return nullptr;
  if (alignment == 0) alignment = kMinChunkBytes;
  if ((alignment & (alignment - 1)) != 0 || alignment > kMaxAlignment) return nullptr;
  std::unique_lock<std::mutex> lock(mu_);
  if (bytes > (SIZE_MAX >> 2)) {
    ++failed_allocs_;
    return nullptr;
  }
  alignment = std::max(alignment, kMinChunkBytes);
  const size_t rounded = RoundUp(bytes, kMinChunkBytes);
  // Regions and chunks are 256-aligned, so a chunk this large always holds an aligned block.
  const size_t need = rounded + (alignment - kMinChunkBytes);
  bool released = false;  // at most one release of cached regions per call
  // Each pass either serves the block, fails, or changes something (a region added, cached
  // regions released, a region returned after the limit fell); the bound only guards against a
  // limit that keeps falling while regions grow.
  for (int pass = 0; pass < 8; ++pass) {
    // The limit bounds the bytes the job holds in live blocks (paper §4.1: "triggers
    // out-of-memory when total bytes exceed the upper limit"), not only growth: after a shrink
    // that could not release regions with live blocks, their free chunks must not keep serving
    // the job above its new limit, or a lowered limit would not push the next step's tensors to
    // the host.
    if (in_use_ + rounded > limit_) break;
    const ChunkHandle h = FindFree(need);
    if (h != kNoChunk) {
      fit_retry_allocs_ += released;
      return Carve(h, rounded, alignment, chunk);
    }
    const uint64_t room = Room();
    // Room once the regions on their way back have arrived.
    const uint64_t growth_limit = GrowthLimit();
    const uint64_t kept = reserved_ + growing_ + deferred_bytes_;
    const uint64_t room_after = growth_limit > kept ? growth_limit - kept : 0;
    if (need > room && releasing_ > 0 && need <= room_after) {
      // Regions are on their way back to the source (another thread's shrink): their room is
      // ours in a moment. Waiting beats placing a tensor in host memory for its whole life.
      const uint64_t seen = release_completions_;
      release_done_.wait(lock, [&] { return release_completions_ != seen; });
      continue;
    }
    if (need > room) {
      // The room is held by cached regions that no live block uses (e.g. too small for this
      // request): give them back and grow instead of spilling to host memory (the paper's
      // "greatest effort to allocate on GPU").
      if (!released && ReleaseForRoom(need, &lock)) {
        released = true;
        continue;
      }
      break;
    }
    bool free_known = false;
    uint64_t free_bytes = 0;
    const Growth g = Grow(need, room, &lock, &free_known, &free_bytes);
    if (g == Growth::kSourceEmpty) {
      // The device itself is short (other processes, fragmentation of the driver's heap). Growth
      // is capped by what the driver says is free, for a backoff period, so that the misses
      // that follow fail fast (host fallback) instead of asking the driver again and flushing
      // the cache each time (the "flush storm" of issue 29).
      NoteRefusal(free_known, free_bytes);
      // Our own cached regions may be what is missing, as in TensorFlow's BFC: given back once
      // (at most once per backoff period, as the cap keeps later misses from the driver).
      if (!released && ReleaseAllForSource(&lock)) {
        released = true;
        continue;
      }
      break;
    }
    // kAdded: the next pass carves from the new region (the lock was held since it was added);
    // kReturned: the limit fell while growing, so the request is judged again under it.
  }
  ++failed_allocs_;
  return nullptr;
}

Bfc::Growth Bfc::Grow(size_t need, uint64_t room, std::unique_lock<std::mutex>* lock,
                      bool* free_known, uint64_t* free_bytes) {
  const size_t planned =
      static_cast<size_t>(std::min<uint64_t>(std::max(next_region_, need), room));
  // Counted against the limit while unlocked, so concurrent growers cannot overshoot it.
  growing_ += planned;
  const uint64_t epoch = limit_epoch_;
  ++growers_current_;
  lock->unlock();

  size_t size = planned;
  uint64_t refusals = 0;
  void* base = source_->AllocRegion(size);
  refusals += base == nullptr;
  while (base == nullptr && size > need) {
    size = std::max(need, RoundUp(size / 2, kMinChunkBytes));
    base = source_->AllocRegion(size);
    refusals += base == nullptr;
  }
  if (base == nullptr && free_known != nullptr) {
    size_t free_now = 0;
    size_t total = 0;
    *free_known = source_->MemInfo(&free_now, &total);
    *free_bytes = *free_known ? free_now : 0;
  }
  if (base != nullptr && reinterpret_cast<uintptr_t>(base) % kMinChunkBytes != 0) {
    std::fprintf(stderr, "antman bfc: region source returned a misaligned region %p\n", base);
    source_->FreeRegion(base, size);
    base = nullptr;
  }

  lock->lock();
  growing_ -= planned;
  driver_refusals_ += refusals;
  if (base == nullptr) {
    EndGrowth(epoch);
    return Growth::kSourceEmpty;
  }
  // A SetLimit may have lowered the limit while the lock was dropped: the region must still fit
  // under the limit in force now, or it goes back (SetLimit waits for this).
  if (reserved_ + growing_ + releasing_ + size > limit_) {
    ++growth_returns_;
    releasing_ += size;
    lock->unlock();
    source_->FreeRegion(base, size);
    lock->lock();
    releasing_ -= size;
    ++release_completions_;
    release_done_.notify_all();
    EndGrowth(epoch);
    return Growth::kReturned;
  }
  if (size >= next_region_) next_region_ = std::min(next_region_ * 2, max_region_);
  // A growth the driver served with no cap in force: the next refusal starts a fresh backoff.
  if (driver_cap_ == 0 || clock_() >= cap_until_ns_) {
    driver_cap_ = 0;
    cap_backoff_ns_ = 0;
  }
  AddRegion(static_cast<char*>(base), size);
  EndGrowth(epoch);
  return Growth::kAdded;
}

void Bfc::EndGrowth(uint64_t epoch) {
  if (epoch == limit_epoch_) {
    --growers_current_;
    return;
  }
  if (--growers_old_ == 0) growth_done_.notify_all();
}

bool Bfc::ReleaseForRoom(size_t need, std::unique_lock<std::mutex>* lock) {
  const uint64_t limit = GrowthLimit();
  const uint64_t others = growing_ + releasing_ + deferred_bytes_;
  if (limit < others + need) return false;
  const uint64_t target = limit - others - need;  // reserved must come down to this
  uint64_t free_bytes = 0;
  for (const auto& r : regions_) free_bytes += r->live == 0 ? r->bytes : 0;
  if (free_bytes == 0 || reserved_ - free_bytes > target) return false;
  std::vector<Victim> victims = TakeFreeRegions(target);
  const ShrinkResult r = ReleaseUnlocked(std::move(victims), lock);
  fit_release_regions_ += r.regions_freed;
  fit_release_bytes_ += r.bytes_freed;
  return r.regions_freed > 0;
}

bool Bfc::ReleaseAllForSource(std::unique_lock<std::mutex>* lock) {
  std::vector<Victim> victims = TakeFreeRegions(0);
  if (victims.empty()) return false;
  const ShrinkResult r = ReleaseUnlocked(std::move(victims), lock);
  fit_release_regions_ += r.regions_freed;
  fit_release_bytes_ += r.bytes_freed;
  return true;
}

bool Bfc::Free(void* ptr, size_t* chunk) {
  if (ptr == nullptr) return false;
  std::unique_lock<std::mutex> lock(mu_);
  ChunkHandle h = ChunkAt(ptr);
  if (h == kNoChunk || !chunks_[h].in_use) return false;
  Chunk& c = chunks_[h];
  if (chunk != nullptr) *chunk = c.size;
  Region* region = c.region;
  c.in_use = false;
  in_use_ -= c.size;
  NoteInUseChanged();
  const ChunkHandle next = c.next;
  if (next != kNoChunk && !chunks_[next].in_use) {
    RemoveFree(next);
    Merge(h, next);
  }
  const ChunkHandle prev = chunks_[h].prev;
  if (prev != kNoChunk && !chunks_[prev].in_use) {
    RemoveFree(prev);
    Merge(prev, h);
    h = prev;
  }
  InsertFree(h);
  if (--region->live == 0) {
    pinned_ -= region->bytes;
    region->free_since_ns = clock_();
    // Above the limit only because this region held live data (a shrink had to keep it): now
    // that it is free it is no longer served, so reserved <= max(limit, pinned) still holds,
    // but it goes back to the source only at the next safe point (the step boundary, a
    // SetLimit, a cache release): a driver free here, inside the framework's free callback in
    // the middle of backward, synchronises the device (issues 29, 30).
    if (reserved_ > limit_) {
      deferred_.push_back(Unlink(region));
      deferred_bytes_ += deferred_.back().bytes;
      regions_.erase(std::remove(regions_.begin(), regions_.end(), nullptr), regions_.end());
    }
  }
  return true;
}

ShrinkResult Bfc::ReleaseDeferredLocked(std::unique_lock<std::mutex>* lock) {
  if (deferred_.empty()) return {};
  std::vector<Victim> victims = std::move(deferred_);
  deferred_.clear();
  uint64_t bytes = 0;
  for (const Victim& v : victims) bytes += v.bytes;
  deferred_bytes_ -= bytes;  // ReleaseUnlocked counts them as releasing until the source has them
  const ShrinkResult r = ReleaseUnlocked(std::move(victims), lock);
  deferred_released_regions_ += r.regions_freed;
  deferred_released_bytes_ += r.bytes_freed;
  shrink_regions_freed_ += r.regions_freed;
  shrink_bytes_freed_ += r.bytes_freed;
  return r;
}

ShrinkResult Bfc::ReleaseDeferred() {
  std::unique_lock<std::mutex> lock(mu_);
  return ReleaseDeferredLocked(&lock);
}

bool Bfc::Contains(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return FindRegion(ptr) != nullptr;
}

size_t Bfc::AllocatedSize(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  const ChunkHandle h = ChunkAt(ptr);
  return h != kNoChunk && chunks_[h].in_use ? chunks_[h].size : 0;
}

Bfc::Victim Bfc::Unlink(Region* r) {
  const ChunkHandle h = r->handles[0];
  RemoveFree(h);
  DeleteChunk(h);
  reserved_ -= r->bytes;
  for (auto& owned : regions_) {
    if (owned.get() == r) return {r->base, r->bytes, std::move(owned)};  // leaves a null slot
  }
  return {nullptr, 0, nullptr};  // not reached: r is one of regions_
}

std::vector<Bfc::Victim> Bfc::TakeFreeRegions(uint64_t target) {
  std::vector<Victim> victims;
  if (reserved_ <= target) return victims;
  std::vector<Region*> candidates;
  for (const auto& r : regions_) {
    if (r->live == 0) candidates.push_back(r.get());
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Region* a, const Region* b) { return a->bytes < b->bytes; });
  while (reserved_ > target && !candidates.empty()) {
    // The smallest region that covers the excess alone, else the largest: few device calls
    // and little overshoot below the target.
    const uint64_t excess = reserved_ - target;
    auto it = std::lower_bound(candidates.begin(), candidates.end(), excess,
                               [](const Region* r, uint64_t n) { return r->bytes < n; });
    if (it == candidates.end()) it = std::prev(it);
    Region* r = *it;
    candidates.erase(it);
    victims.push_back(Unlink(r));
  }
  regions_.erase(std::remove(regions_.begin(), regions_.end(), nullptr), regions_.end());
  return victims;
}

ShrinkResult Bfc::ReleaseUnlocked(std::vector<Victim> victims, std::unique_lock<std::mutex>* lock) {
  ShrinkResult result;
  for (const Victim& v : victims) result.bytes_freed += v.bytes;
  result.regions_freed = victims.size();
  if (victims.empty()) return result;
  // Until the source has them back they still count against the limit (Room()).
  releasing_ += result.bytes_freed;
  lock->unlock();
  // Every region here once held blocks that kernels may still be using (a block is freed when
  // its last kernel is enqueued, not when it ran): wait for them before the memory goes back.
  const uint64_t sync_start = NowNs();
  source_->Quiesce();
  const uint64_t sync_ns = NowNs() - sync_start;
  for (Victim& v : victims) source_->FreeRegion(v.base, v.bytes);
  victims.clear();  // handle arrays can be large: drop them unlocked too
  lock->lock();
  ++release_syncs_;
  last_release_sync_ns_ = sync_ns;
  releasing_ -= result.bytes_freed;
  ++release_completions_;
  release_done_.notify_all();
  return result;
}

ShrinkResult Bfc::Shrink(uint64_t target, std::unique_lock<std::mutex>* lock) {
  const uint64_t start = NowNs();
  std::vector<Victim> victims = TakeFreeRegions(target);
  const uint64_t unfreed = reserved_ > target ? reserved_ - target : 0;
  ShrinkResult result = ReleaseUnlocked(std::move(victims), lock);
  result.unfreed = unfreed;
  shrink_regions_freed_ += result.regions_freed;
  shrink_bytes_freed_ += result.bytes_freed;
  last_shrink_ns_ = NowNs() - start;
  last_shrink_unfreed_ = result.unfreed;
  return result;
}

ShrinkResult Bfc::SetLimit(uint64_t limit) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool lowered = limit < limit_;
  limit_ = limit;
  ShrinkResult result;
  if (lowered) {
    // Growers that planned under the old limit re-check against this one when they re-lock.
    growers_old_ += growers_current_;
    growers_current_ = 0;
    ++limit_epoch_;
  }
  // Taken in the same critical section as the new limit, so nobody sees reserved above it
  // while free regions could still be released. A SetLimit is a safe point (the coordinator's
  // or the step boundary's thread, not a free callback): queued regions go back too.
  if (reserved_ > limit) result = Shrink(limit, &lock);
  if (!deferred_.empty()) {
    const ShrinkResult d = ReleaseDeferredLocked(&lock);
    result.bytes_freed += d.bytes_freed;
    result.regions_freed += d.regions_freed;
  }
  if (lowered) growth_done_.wait(lock, [this] { return growers_old_ == 0; });
  return result;
}

ShrinkResult Bfc::ReleaseCached() {
  std::unique_lock<std::mutex> lock(mu_);
  ShrinkResult result;
  if (reserved_ != 0) result = Shrink(0, &lock);
  const ShrinkResult d = ReleaseDeferredLocked(&lock);
  result.bytes_freed += d.bytes_freed;
  result.regions_freed += d.regions_freed;
  return result;
}

ShrinkResult Bfc::ReleaseIdle(uint64_t idle_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t now = clock_();
  std::vector<Victim> victims;
  for (auto& r : regions_) {
    if (r->live == 0 && now - r->free_since_ns >= idle_ns) victims.push_back(Unlink(r.get()));
  }
  if (victims.empty()) return {};
  regions_.erase(std::remove(regions_.begin(), regions_.end(), nullptr), regions_.end());
  const ShrinkResult result = ReleaseUnlocked(std::move(victims), &lock);
  idle_release_regions_ += result.regions_freed;
  idle_release_bytes_ += result.bytes_freed;
  return result;
}

void Bfc::ResetStepStats() {
  std::lock_guard<std::mutex> lock(mu_);
  step_peak_ = in_use_;
  step_min_ = in_use_;
}

void Bfc::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_in_use_ = in_use_;
  largest_alloc_ = 0;
}

BfcStats Bfc::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  BfcStats s;
  s.limit = limit_;
  s.in_use = in_use_;
  s.reserved = reserved_;
  s.peak_in_use = peak_in_use_;
  s.step_peak_in_use = step_peak_;
  s.step_min_in_use = step_min_;
  s.allocs = allocs_;
  s.bytes_served = bytes_served_;
  s.failed_allocs = failed_allocs_;
  s.regions = regions_.size();
  for (const auto& r : regions_) s.largest_region = std::max<uint64_t>(s.largest_region, r->bytes);
  s.shrink_regions_freed = shrink_regions_freed_;
  s.shrink_bytes_freed = shrink_bytes_freed_;
  s.last_shrink_ns = last_shrink_ns_;
  s.last_shrink_unfreed = last_shrink_unfreed_;
  s.pinned = pinned_;
  s.growing = growing_;
  s.releasing = releasing_;
  s.fit_release_regions = fit_release_regions_;
  s.fit_release_bytes = fit_release_bytes_;
  s.fit_retry_allocs = fit_retry_allocs_;
  s.growth_returns = growth_returns_;
  s.idle_release_regions = idle_release_regions_;
  s.idle_release_bytes = idle_release_bytes_;
  s.deferred_bytes = deferred_bytes_;
  s.deferred_regions = deferred_.size();
  s.deferred_released_regions = deferred_released_regions_;
  s.deferred_released_bytes = deferred_released_bytes_;
  s.release_syncs = release_syncs_;
  s.last_release_sync_ns = last_release_sync_ns_;
  s.driver_refusals = driver_refusals_;
  s.driver_cap = driver_cap_ != 0 && clock_() < cap_until_ns_ ? driver_cap_ : 0;
  s.largest_alloc = largest_alloc_;
  return s;
}

std::string Bfc::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t reserved = 0;
  uint64_t in_use = 0;
  uint64_t pinned = 0;
  size_t free_chunks = 0;
  size_t live_handles = 0;
  const Region* previous = nullptr;
  for (const auto& rp : regions_) {
    const Region& r = *rp;
    if (reinterpret_cast<uintptr_t>(r.base) % kMinChunkBytes != 0 || r.bytes % kMinChunkBytes != 0)
      return Describe("region not 256-aligned", r.base, r.bytes, kMinChunkBytes);
    if (previous != nullptr && previous->base + previous->bytes > r.base)
      return Describe("regions overlap", r.base, previous->bytes, r.base - previous->base);
    previous = &r;
    reserved += r.bytes;
    size_t chunks_here = 0;
    uint32_t live_here = 0;
    char* expect = r.base;
    ChunkHandle prev = kNoChunk;
    for (ChunkHandle h = r.handles[0]; h != kNoChunk; h = chunks_[h].next) {
      const Chunk& c = chunks_[h];
      ++chunks_here;
      if (c.region != &r) return Describe("chunk in the wrong region", c.ptr, 0, 0);
      if (c.ptr != expect) return Describe("chunks not contiguous", c.ptr, 0, expect - r.base);
      if (c.prev != prev) return Describe("broken prev link", c.ptr, c.prev, prev);
      if (c.size < kMinChunkBytes || c.size % kMinChunkBytes != 0)
        return Describe("bad chunk size", c.ptr, c.size, kMinChunkBytes);
      if (r.handles[(c.ptr - r.base) / kMinChunkBytes] != h)
        return Describe("handle array does not point at chunk", c.ptr, h, 0);
      if (c.in_use) {
        in_use += c.size;
        ++live_here;
      } else {
        ++free_chunks;
        if (prev != kNoChunk && !chunks_[prev].in_use)
          return Describe("free neighbours not coalesced", c.ptr, c.size, chunks_[prev].size);
        const auto& bin = bins_[BinFor(c.size)];
        auto it = bin.find({c.size, reinterpret_cast<uintptr_t>(c.ptr), h});
        if (it == bin.end() || it->handle != h || it != c.bin_entry)
          return Describe("free chunk missing from its bin", c.ptr, c.size, 0);
      }
      expect = c.ptr + c.size;
      if (expect > r.base + r.bytes) return Describe("chunk runs past region", c.ptr, c.size, 0);
      prev = h;
    }
    if (expect != r.base + r.bytes)
      return Describe("chunks do not cover region", r.base, expect - r.base, r.bytes);
    if (live_here != r.live) return Describe("region live count wrong", r.base, r.live, live_here);
    if (r.live > 0) pinned += r.bytes;
    size_t handles_here = 0;
    for (ChunkHandle h : r.handles) handles_here += h != kNoChunk;
    if (handles_here != chunks_here)
      return Describe("stale entries in handle array", r.base, handles_here, chunks_here);
    live_handles += chunks_here;
  }
  size_t binned = 0;
  for (const auto& bin : bins_) binned += bin.size();
  if (binned != free_chunks) return Describe("bins hold extra entries", nullptr, binned, free_chunks);
  if (live_handles + spare_handles_.size() != chunks_.size())
    return Describe("chunk handles leaked", nullptr, live_handles + spare_handles_.size(),
                    chunks_.size());
  if (reserved != reserved_) return Describe("reserved != sum of regions", nullptr, reserved_, reserved);
  if (in_use != in_use_) return Describe("in_use != sum of live chunks", nullptr, in_use_, in_use);
  if (pinned != pinned_) return Describe("pinned != sum of regions with live blocks", nullptr, pinned_, pinned);
  uint64_t deferred = 0;
  for (const Victim& v : deferred_) deferred += v.bytes;
  if (deferred != deferred_bytes_)
    return Describe("deferred bytes != sum of queued regions", nullptr, deferred_bytes_, deferred);
  // The limit: growth never passes it, a shrink and the free of a pinned region's last block
  // bring reserved back under it, and live blocks never pass it.
  if (reserved_ > std::max(limit_, pinned_))
    return Describe("reserved above max(limit, pinned)", nullptr, reserved_, std::max(limit_, pinned_));
  if (peak_in_use_ < in_use_ || step_peak_ < in_use_ || step_min_ > in_use_)
    return Describe("peak/min statistics inconsistent", nullptr, peak_in_use_, in_use_);
  return "";
}

}  // namespace antman
