// A RegionSource for tests: real host memory, a byte budget, injectable failures, a record of
// every call, and a hook run inside AllocRegion/FreeRegion (to prove no lock is held there).
#ifndef TF_ANTMAN_CC_CORE_TEST_REGION_SOURCE_H_
#define TF_ANTMAN_CC_CORE_TEST_REGION_SOURCE_H_

#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "cc/core/region_source.h"

namespace antman_test {

class TestRegionSource : public antman::RegionSource {
 public:
  // offset: bytes added to every region's 4096-aligned base, to make alignment work visible.
  explicit TestRegionSource(size_t capacity = 0, size_t offset = 0)
      : capacity_(capacity), offset_(offset) {}
  ~TestRegionSource() override {
    for (auto& [p, bytes] : live_) std::free(static_cast<char*>(p) - offset_);
  }

  void* AllocRegion(size_t bytes) override {
    if (on_call) on_call();
    std::lock_guard<std::mutex> lock(mu_);
    attempts_.push_back(bytes);
    if (capacity_ != 0 && used_ + held_by_others_ + bytes > capacity_) return nullptr;
    const size_t total = (bytes + offset_ + 4095) / 4096 * 4096;
    char* base = static_cast<char*>(std::aligned_alloc(4096, total));
    if (base == nullptr) return nullptr;
    void* p = base + offset_;
    live_[p] = bytes;
    used_ += bytes;
    return p;
  }
  void FreeRegion(void* ptr, size_t bytes) override {
    if (on_call) on_call();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end() || it->second != bytes) {
      ++bad_frees_;
      return;
    }
    live_.erase(it);
    used_ -= bytes;
    ++frees_;
    std::free(static_cast<char*>(ptr) - offset_);
  }

  void Quiesce() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++quiesces_;
  }
  // Answers only for a source with a capacity: free = capacity - used - held_by_others.
  bool MemInfo(size_t* free_bytes, size_t* total_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ == 0) return false;
    const size_t taken = used_ + held_by_others_;
    *free_bytes = capacity_ > taken ? capacity_ - taken : 0;
    *total_bytes = capacity_;
    return true;
  }
  // Memory another process holds: AllocRegion refuses it too.
  void set_held_by_others(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    held_by_others_ = bytes;
  }

  bool Holds(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [base, bytes] : live_) {
      if (p >= base && p < static_cast<const char*>(base) + bytes) return true;
    }
    return false;
  }
  size_t live_regions() const { std::lock_guard<std::mutex> l(mu_); return live_.size(); }
  size_t used() const { std::lock_guard<std::mutex> l(mu_); return used_; }
  size_t frees() const { std::lock_guard<std::mutex> l(mu_); return frees_; }
  size_t bad_frees() const { std::lock_guard<std::mutex> l(mu_); return bad_frees_; }
  size_t quiesces() const { std::lock_guard<std::mutex> l(mu_); return quiesces_; }
  std::vector<size_t> attempts() const { std::lock_guard<std::mutex> l(mu_); return attempts_; }

  std::function<void()> on_call;

 private:
  const size_t capacity_;
  const size_t offset_;
  mutable std::mutex mu_;
  std::map<void*, size_t> live_;
  std::vector<size_t> attempts_;
  size_t used_ = 0;
  size_t frees_ = 0;
  size_t bad_frees_ = 0;
  size_t quiesces_ = 0;
  size_t held_by_others_ = 0;
};

}  // namespace antman_test

#endif  // TF_ANTMAN_CC_CORE_TEST_REGION_SOURCE_H_
