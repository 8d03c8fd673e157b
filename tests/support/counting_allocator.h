#pragma once
// A CPU allocator that counts live and peak bytes of tensor storage, for
// tests that measure memory (activations, construction).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>

namespace tessera {
namespace test {

// Wraps the CPU allocator and counts live and peak bytes. The data pointer is
// also the context (raw_allocate() requires it), so blocks are found by
// address. allocate() is declared twice: LibTorch 1.13's is const, 2.x's is not.
class CountingAllocator : public c10::Allocator {
 public:
  // Created once around the default allocator and never destroyed: tensors it
  // allocated may outlive the test that installed it.
  static CountingAllocator& instance() {
    static auto* counter = new CountingAllocator(c10::GetDefaultCPUAllocator());
    return *counter;
  }
  c10::DataPtr allocate(size_t n) const { return count(n); }
  c10::DataPtr allocate(size_t n) { return count(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }

  int64_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  // The largest single allocation since the last reset_peak().
  int64_t largest() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return largest_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
    largest_ = 0;
    watched_peak_ = watched_live_;
  }
  // Live bytes in blocks of at least `min_bytes`, and their peak since
  // reset_peak(): a model's large buffers (parameter and gradient buckets)
  // apart from the many small activations of a step.
  void watch(int64_t min_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    watch_ = min_bytes;
    watched_live_ = 0;
    for (const auto& [data, block] : blocks_)
      if (block.bytes >= watch_) watched_live_ += block.bytes;
    watched_peak_ = watched_live_;
  }
  int64_t watched_live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return watched_live_;
  }
  int64_t watched_peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return watched_peak_;
  }
  c10::Allocator* base() const { return base_; }
  // Allocations made so far: a mark for live_since().
  uint64_t mark() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return next_;
  }
  // "bytes x count, ..." of the blocks allocated after `mark` and still live:
  // what a test that expected nothing there finds.
  std::string live_since(uint64_t mark) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<int64_t, int> sizes;
    for (const auto& [data, block] : blocks_)
      if (block.order >= mark) ++sizes[block.bytes];
    std::string out;
    for (const auto& [bytes, n] : sizes)
      out += (out.empty() ? "" : ", ") + std::to_string(bytes) + " x " + std::to_string(n);
    return out.empty() ? "none" : out;
  }

 private:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
    uint64_t order;
  };
  static void release(void* data) {
    if (data == nullptr) return;
    CountingAllocator& self = instance();
    c10::DataPtr inner;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(self.mutex_);
    auto it = self.blocks_.find(data);
    if (it == self.blocks_.end()) return;
    self.live_ -= it->second.bytes;
    if (it->second.bytes >= self.watch_) self.watched_live_ -= it->second.bytes;
    inner = std::move(it->second.inner);
    self.blocks_.erase(it);
  }
  c10::DataPtr count(size_t n) const {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    const c10::Device device = inner.device();
    std::lock_guard<std::mutex> lock(mutex_);
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_, live_);
    largest_ = std::max(largest_, static_cast<int64_t>(n));
    if (static_cast<int64_t>(n) >= watch_) {
      watched_live_ += static_cast<int64_t>(n);
      watched_peak_ = std::max(watched_peak_, watched_live_);
    }
    blocks_[data] = Block{std::move(inner), static_cast<int64_t>(n), next_++};
    return {data, data, &release, device};
  }
  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::map<void*, Block> blocks_;
  mutable int64_t live_ = 0, peak_ = 0, largest_ = 0;
  mutable int64_t watch_ = std::numeric_limits<int64_t>::max(), watched_live_ = 0, watched_peak_ = 0;
  mutable uint64_t next_ = 0;
};

// Installs the counter as the CPU allocator while it lives.
struct CountingScope {
  CountingScope() { c10::SetCPUAllocator(&CountingAllocator::instance()); }
  ~CountingScope() { c10::SetCPUAllocator(CountingAllocator::instance().base()); }
};

}  // namespace test
}  // namespace tessera
