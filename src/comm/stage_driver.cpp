#include "stage_driver.h"

#include "mpi_types.h"
#include "progress_thread.h"

#include <c10/util/Exception.h>
#include <mpi.h>

#include <utility>

namespace tessera {
namespace comm {
namespace detail {

StageDriver::StageDriver(std::chrono::microseconds interval) : interval_(interval) {
  TORCH_CHECK(interval.count() > 0, "stage driver: the interval between polls must be > 0 microseconds, got ",
              interval.count());
  require_thread_multiple(interval, "a stage driver for the reductions by host");
  thread_ = std::thread([this] { run(); });
}

StageDriver::~StageDriver() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void StageDriver::add(std::function<bool()> poll) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(poll));
  }
  wake_.notify_one();
}

void StageDriver::run() {
  std::vector<std::function<bool()>> polling;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stop_ || !pending_.empty(); });
      if (stop_) return;
      for (auto& p : pending_) polling.push_back(std::move(p));
      pending_.clear();
    }
    // A pending operation at MPI_Finalize is its owner's error; polling it
    // then would be this thread's.
    const bool finalized = mpi_finalized();
    std::vector<std::function<bool()>> again;
    for (auto& poll : polling) {
      bool done = true;
      if (!finalized) {
        try {
          done = poll();
        } catch (...) {
        }
      }
      if (!done) again.push_back(std::move(poll));
    }
    polls_.fetch_add(static_cast<int64_t>(polling.size()), std::memory_order_relaxed);
    // Drop the finished polls (and any work they held last) outside the lock.
    polling.clear();
    if (again.empty()) continue;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& p : again) pending_.push_back(std::move(p));
    }
    again.clear();
    std::this_thread::sleep_for(interval_);
  }
}

}  // namespace detail
}  // namespace comm
}  // namespace tessera
