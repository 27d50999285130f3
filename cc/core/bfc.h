// A best-fit-with-coalescing allocator whose upper limit can change at run time (AntMan §3.1.1).
//
// Memory comes in regions from a RegionSource; each region is cut into chunks (multiples of
// 256 bytes) linked to their address neighbours. Free chunks sit in size-class bins, each an
// ordered set of (size, address), so a best fit is one lower_bound. A pointer is found through
// the region that holds it (binary search over the sorted regions) and that region's handle
// array, indexed by offset / 256, as in TensorFlow's BFC.
//
// The limit caps both the bytes in live blocks and `reserved` (bytes held in regions): an
// allocation that would put either above it fails, so the caller can fall back to host memory.
// Before failing, the allocator gives back its own wholly free cached regions and retries (when
// that makes room under the limit, or when the source itself ran out). Lowering the limit
// releases whole free regions; regions that still hold live blocks stop being served as soon as
// their last block is freed and are queued for the next safe point (never given back inside
// Free), so `reserved <= max(limit, pinned)` holds whenever the lock is free
// (`pinned`: bytes of regions holding at least one live block). The lock is never held across a
// RegionSource call.
#ifndef TF_ANTMAN_CC_CORE_BFC_H_
#define TF_ANTMAN_CC_CORE_BFC_H_

#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cc/core/region_source.h"

namespace antman {

inline constexpr size_t kMinChunkBytes = 256;
inline constexpr size_t kMaxAlignment = 4096;
inline constexpr size_t kDefaultMinRegion = size_t{2} << 20;
// Regions stop doubling here so that a shrink can give memory back in pieces of useful size.
inline constexpr size_t kDefaultMaxRegion = size_t{1} << 30;

// Monotonic nanoseconds; injectable so that tests drive the idle-release clock.
using ClockFn = uint64_t (*)();
uint64_t SteadyNowNs();

struct BfcOptions {
  uint64_t limit = 0;  // bytes; 0 means nothing may be reserved
  size_t min_region = kDefaultMinRegion;
  size_t max_region = kDefaultMaxRegion;
  ClockFn clock = nullptr;  // nullptr: SteadyNowNs
};

// All in bytes except the counters and last_shrink_ns.
struct BfcStats {
  uint64_t limit = 0;
  uint64_t in_use = 0;
  uint64_t reserved = 0;
  uint64_t peak_in_use = 0;
  uint64_t step_peak_in_use = 0;
  uint64_t step_min_in_use = 0;
  uint64_t allocs = 0;
  uint64_t bytes_served = 0;
  uint64_t failed_allocs = 0;
  uint64_t regions = 0;
  uint64_t largest_region = 0;
  uint64_t shrink_regions_freed = 0;
  uint64_t shrink_bytes_freed = 0;
  uint64_t last_shrink_ns = 0;
  uint64_t last_shrink_unfreed = 0;
  uint64_t pinned = 0;             // bytes of regions holding at least one live block
  uint64_t growing = 0;            // bytes of regions being fetched from the source now
  uint64_t releasing = 0;          // bytes of regions being returned to the source now
  uint64_t fit_release_regions = 0;  // cached regions given back so that an allocation fits
  uint64_t fit_release_bytes = 0;
  uint64_t fit_retry_allocs = 0;   // allocations served only after such a release
  uint64_t growth_returns = 0;     // regions returned because the limit fell while they grew
  uint64_t idle_release_regions = 0;
  uint64_t idle_release_bytes = 0;
  uint64_t deferred_bytes = 0;          // free regions queued for the next safe point (held)
  uint64_t deferred_regions = 0;
  uint64_t deferred_released_regions = 0;  // lifetime: queued regions given back at a safe point
  uint64_t deferred_released_bytes = 0;
  uint64_t release_syncs = 0;           // Quiesce calls before giving back used regions
  uint64_t last_release_sync_ns = 0;    // duration of the last one
  uint64_t driver_refusals = 0;         // AllocRegion calls the source refused (lifetime)
  uint64_t driver_cap = 0;              // growth cap after a refusal (0: none in force)
  uint64_t largest_alloc = 0;           // largest block served since the last ResetPeak
};

struct ShrinkResult {
  uint64_t bytes_freed = 0;
  uint64_t regions_freed = 0;
  uint64_t unfreed = 0;  // how far reserved stays above the target
};

class Bfc {
 public:
  Bfc(RegionSource* source, BfcOptions options);
  ~Bfc();  // returns every region to the source, live blocks included
  Bfc(const Bfc&) = delete;
  Bfc& operator=(const Bfc&) = delete;

  // nullptr for bytes == 0, a bad alignment, or when no free chunk fits and growing would put
  // reserved above the limit (or the source has no memory). *chunk (may be null) gets the
  // block's size as held (>= bytes).
  void* Allocate(size_t alignment, size_t bytes, size_t* chunk = nullptr);
  // false if ptr is not a live block of this allocator (nothing is changed then). Never returns
  // memory to the source: a region left wholly free above the limit is queued for the next safe
  // point (ReleaseDeferred, SetLimit, ReleaseCached). *chunk (may be null) gets the block's size.
  bool Free(void* ptr, size_t* chunk = nullptr);
  // Whether ptr lies inside one of this allocator's regions (interior pointers included).
  bool Contains(const void* ptr) const;
  // Chunk size of the live block starting at ptr; 0 if there is none.
  size_t AllocatedSize(const void* ptr) const;

  // New limit in force now; when reserved is above it, frees whole free regions. When the limit
  // is lowered, waits until every region that was being fetched under an older limit has been
  // either taken in (within the new limit) or returned, so that once SetLimit returns no memory
  // is held from the source above max(limit, pinned). Must not be called from inside a
  // RegionSource call of this allocator.
  ShrinkResult SetLimit(uint64_t limit);
  // Frees every wholly free region, whatever the limit.
  ShrinkResult ReleaseCached();
  // Frees the wholly free regions that have had no live block for at least idle_ns.
  ShrinkResult ReleaseIdle(uint64_t idle_ns);
  // Gives back the regions Free queued (a safe point: the step boundary), after Quiesce.
  ShrinkResult ReleaseDeferred();
  // Starts a new step window for step_peak_in_use / step_min_in_use.
  void ResetStepStats();
  // peak_in_use = in_use now; largest_alloc = 0.
  void ResetPeak();

  BfcStats GetStats() const;
  // Empty string if all invariants hold, else the first violation found.
  std::string CheckInvariants() const;

 private:
  using ChunkHandle = int32_t;
  static constexpr ChunkHandle kNoChunk = -1;
  static constexpr int kNumBins = 21;

  struct FreeKey {
    size_t size;
    uintptr_t ptr;
    ChunkHandle handle;  // not part of the order
    bool operator<(const FreeKey& o) const {
      return size != o.size ? size < o.size : ptr < o.ptr;
    }
  };
  using FreeSet = std::set<FreeKey>;
  struct Region;
  struct Chunk {
    char* ptr = nullptr;
    size_t size = 0;
    ChunkHandle prev = kNoChunk;
    ChunkHandle next = kNoChunk;
    bool in_use = false;
    Region* region = nullptr;
    FreeSet::iterator bin_entry;  // valid while the chunk is free: erase without a search
  };
  struct Region {
    char* base;
    size_t bytes;
    std::vector<ChunkHandle> handles;  // chunk starting at base + i*256, or kNoChunk
    uint32_t live = 0;                 // live blocks in this region
    uint64_t free_since_ns = 0;        // when live last became 0 (or the region was added)
  };
  struct Victim {
    void* base;
    size_t bytes;
    std::unique_ptr<Region> region;  // destroyed after the lock is dropped
  };

  static int BinFor(size_t size);
  ChunkHandle NewChunk();
  void DeleteChunk(ChunkHandle h);
  void InsertFree(ChunkHandle h);
  void RemoveFree(ChunkHandle h);
  ChunkHandle FindFree(size_t need) const;
  // Splits h at offset; the new chunk (returned) takes the tail. Neither is put in a bin.
  ChunkHandle Split(ChunkHandle h, size_t offset);
  // Merges b (the next neighbour of a) into a.
  void Merge(ChunkHandle a, ChunkHandle b);
  void* Carve(ChunkHandle h, size_t rounded, size_t alignment, size_t* chunk);
  Region* FindRegion(const void* ptr) const;
  ChunkHandle ChunkAt(const void* ptr) const;
  void AddRegion(char* base, size_t bytes);
  enum class Growth { kAdded, kReturned, kSourceEmpty };

  // Bytes a new region may take under the limit now (multiple of 256).
  uint64_t Room() const;
  // Fetches a region of at least `need` bytes with the lock dropped and adds it, unless the limit
  // was lowered meanwhile and it no longer fits (then it is returned to the source).
  // On kSourceEmpty, *free_known / *free_bytes: the source's MemInfo read after the refusal.
  Growth Grow(size_t need, uint64_t room, std::unique_lock<std::mutex>* lock,
              bool* free_known = nullptr, uint64_t* free_bytes = nullptr);
  void EndGrowth(uint64_t epoch);
  // Gives back wholly free regions so that a region of `need` bytes fits under the limit; false
  // (nothing released) when even releasing all of them would not make room.
  bool ReleaseForRoom(size_t need, std::unique_lock<std::mutex>* lock);
  // After the source ran out: gives back every wholly free region; false if there was none.
  bool ReleaseAllForSource(std::unique_lock<std::mutex>* lock);
  // The limit growth is judged against: the limit, or lower while a driver cap is in force.
  uint64_t GrowthLimit() const;
  // The source refused `need` bytes: cap growth at what is held plus what the source says is
  // free (free_known: MemInfo answered), for a backoff period that doubles on each refusal.
  void NoteRefusal(bool free_known, uint64_t free_bytes);
  // Moves the queued regions to the source (lock dropped); counted as deferred releases.
  ShrinkResult ReleaseDeferredLocked(std::unique_lock<std::mutex>* lock);
  Victim Unlink(Region* r);
  // Unlinks whole free regions until reserved_ <= target; the caller frees them unlocked.
  std::vector<Victim> TakeFreeRegions(uint64_t target);
  // Returns victims to the source with the lock dropped (counted in releasing_ meanwhile).
  ShrinkResult ReleaseUnlocked(std::vector<Victim> victims, std::unique_lock<std::mutex>* lock);
  ShrinkResult Shrink(uint64_t target, std::unique_lock<std::mutex>* lock);
  void NoteInUseChanged();

  RegionSource* const source_;
  const size_t min_region_;
  const size_t max_region_;
  const ClockFn clock_;

  mutable std::mutex mu_;
  uint64_t limit_;
  size_t next_region_;
  uint64_t reserved_ = 0;
  uint64_t growing_ = 0;    // regions being fetched from the source right now
  uint64_t releasing_ = 0;  // regions being returned to the source right now
  uint64_t pinned_ = 0;     // bytes of regions with a live block
  // Growers are counted per limit epoch; lowering the limit starts a new epoch and waits for the
  // growers of older ones (growers_old_) to finish.
  uint64_t limit_epoch_ = 0;
  uint64_t growers_current_ = 0;
  uint64_t growers_old_ = 0;
  std::condition_variable growth_done_;
  uint64_t release_completions_ = 0;  // bumped each time regions have gone back to the source
  std::condition_variable release_done_;
  uint64_t fit_release_regions_ = 0;
  uint64_t fit_release_bytes_ = 0;
  uint64_t fit_retry_allocs_ = 0;
  uint64_t growth_returns_ = 0;
  uint64_t idle_release_regions_ = 0;
  uint64_t idle_release_bytes_ = 0;
  uint64_t in_use_ = 0;
  uint64_t peak_in_use_ = 0;
  uint64_t step_peak_ = 0;
  uint64_t step_min_ = 0;
  uint64_t allocs_ = 0;
  uint64_t bytes_served_ = 0;
  uint64_t failed_allocs_ = 0;
  uint64_t shrink_regions_freed_ = 0;
  uint64_t shrink_bytes_freed_ = 0;
  uint64_t last_shrink_ns_ = 0;
  uint64_t last_shrink_unfreed_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<ChunkHandle> spare_handles_;
  std::vector<std::unique_ptr<Region>> regions_;  // sorted by base
  std::vector<Victim> deferred_;  // wholly free regions above the limit, for the next safe point
  uint64_t deferred_bytes_ = 0;   // their bytes: still held from the source (counted in Room)
  uint64_t deferred_released_regions_ = 0;
  uint64_t deferred_released_bytes_ = 0;
  uint64_t release_syncs_ = 0;
  uint64_t last_release_sync_ns_ = 0;
  uint64_t driver_refusals_ = 0;
  uint64_t driver_cap_ = 0;         // 0: none
  uint64_t cap_until_ns_ = 0;       // clock_() time the cap lapses
  uint64_t cap_backoff_ns_ = 0;     // next backoff (0: the initial one)
  uint64_t largest_alloc_ = 0;
  FreeSet bins_[kNumBins];
  // Set nodes kept from erased entries and reused by the next insert: the hot path then does
  // no heap allocation for its bins.
  std::vector<FreeSet::node_type> spare_nodes_;
};

}  // namespace antman

#endif  // TF_ANTMAN_CC_CORE_BFC_H_
