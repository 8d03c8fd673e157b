#pragma once
// A thread that keeps MPI's nonblocking operations moving. Internal to comm/.
//
// Note [A progress thread]
// Open MPI moves a nonblocking collective or message (the gradient buckets
// ShardedModule posts during backward, the prefetched gathers, the ring
// across hosts) only inside MPI calls on the process; between the autograd
// hooks that poll them nothing moves, so a reduction posted early finishes
// no earlier than one posted late. With TESSERA_PROGRESS_US=N (N > 0),
// each MPI family (a world and everything split from it) runs one thread
// that calls MPI_Iprobe on a private duplicate of the world every N
// microseconds: a probe that never matches, which runs MPI's progress
// engine for every pending request of the process. It needs
// MPI_THREAD_MULTIPLE (MpiRuntime asks for it); it touches none of
// tessera's own state, so the requests stay owned by the thread that posted
// them. The thread sleeps between probes: on ranks that share few cores it
// takes little of the compute it is to hide behind. It must not probe once
// MPI is finalized, and a family may outlive MPI_Finalize (a static
// communicator): an attribute on MPI_COMM_SELF, whose delete callback MPI
// runs first thing in MPI_Finalize, stops it there.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace tessera {
namespace comm {
namespace detail {

// Throws, saying what to do, unless MPI runs with MPI_THREAD_MULTIPLE:
// `what` (a thread that calls MPI beside the caller's) needs it.
void require_thread_multiple(std::chrono::microseconds interval, const char* what);

class ProgressThread {
 public:
  // Collective over `comm` (duplicates it). Throws, saying what to do, if MPI
  // was not initialized with MPI_THREAD_MULTIPLE.
  ProgressThread(MPI_Comm comm, std::chrono::microseconds interval);
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Stops the thread and waits for it; the destructor and MPI_Finalize call it.
  void stop();
  std::chrono::microseconds interval() const { return interval_; }
  // Probes made so far (tests see the thread run).
  int64_t probes() const { return probes_.load(std::memory_order_relaxed); }

 private:
  void run();

  MPI_Comm probe_ = MPI_COMM_NULL;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::chrono::microseconds interval_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> probes_{0};
  std::thread thread_;
};

}  // namespace detail
}  // namespace comm
}  // namespace tessera
