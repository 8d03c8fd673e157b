#pragma once
// RAII owner of MPI's lifetime in a process.
//
// Creating an MpiRuntime initializes MPI (asking for MPI_THREAD_MULTIPLE, so
// that gradient hooks on autograd threads may communicate) unless the program
// already did; destroying it finalizes MPI only if it was the one that
// initialized it. Keep it alive longer than every communicator: declare it
// first in main().
namespace tessera {
namespace comm {

class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  MpiRuntime() : MpiRuntime(nullptr, nullptr) {}
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  // The thread level MPI provided (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  int thread_level() const { return thread_level_; }
  bool owns_mpi() const { return owns_; }

 private:
  bool owns_ = false;
  int thread_level_ = 0;
};

}  // namespace comm
}  // namespace tessera
