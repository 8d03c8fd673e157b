#pragma once
// A thread that advances staged operations while their caller computes.
// Internal to comm/ (Note [Stages advanced beside the caller] in
// hierarchical_communicator.h).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera {
namespace comm {
namespace detail {

class StageDriver {
 public:
  // Throws unless MPI runs with MPI_THREAD_MULTIPLE (the driver calls MPI
  // beside the caller): require_thread_multiple.
  explicit StageDriver(std::chrono::microseconds interval);
  ~StageDriver();
  StageDriver(const StageDriver&) = delete;
  StageDriver& operator=(const StageDriver&) = delete;

  // Calls `poll` every interval, on the driver's thread, until it returns
  // true or throws (the operation's owner sees the error in its own wait).
  // The thread sleeps while nothing is pending.
  void add(std::function<bool()> poll);
  std::chrono::microseconds interval() const { return interval_; }
  // Polls made so far (tests see the thread run).
  int64_t polls() const { return polls_.load(std::memory_order_relaxed); }

 private:
  void run();

  std::chrono::microseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::function<bool()>> pending_;  // guarded by mutex_
  bool stop_ = false;                           // guarded by mutex_
  std::atomic<int64_t> polls_{0};
  std::thread thread_;
};

}  // namespace detail
}  // namespace comm
}  // namespace tessera
