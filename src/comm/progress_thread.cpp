#include "progress_thread.h"

#include "tessera/comm/mpi_check.h"

#include <c10/util/Exception.h>

namespace tessera {
namespace comm {
namespace detail {
namespace {

// MPI_Finalize deletes MPI_COMM_SELF's attributes before anything else.
int stop_at_finalize(MPI_Comm, int, void* thread, void*) {
  static_cast<ProgressThread*>(thread)->stop();
  return MPI_SUCCESS;
}

}  // namespace

void require_thread_multiple(std::chrono::microseconds interval, const char* what) {
  int provided = MPI_THREAD_SINGLE;
  TESSERA_MPI_CHECK(MPI_Query_thread(&provided));
  TORCH_CHECK(provided == MPI_THREAD_MULTIPLE, "TESSERA_PROGRESS_US=", interval.count(), " asks for ", what,
              " beside the caller's thread, which needs MPI_THREAD_MULTIPLE, but MPI was initialized with thread "
              "level ",
              provided,
              "; let tessera::comm::MpiRuntime initialize MPI (it asks for MPI_THREAD_MULTIPLE), use an MPI built "
              "with thread support, or set TESSERA_PROGRESS_US=0");
}

ProgressThread::ProgressThread(MPI_Comm comm, std::chrono::microseconds interval) : interval_(interval) {
  TORCH_CHECK(interval.count() > 0, "TESSERA_PROGRESS_US: the interval between probes must be > 0 microseconds, got ",
              interval.count());
  require_thread_multiple(interval, "a progress thread");
  TESSERA_MPI_CHECK(MPI_Comm_dup(comm, &probe_));
  TESSERA_MPI_CHECK(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, stop_at_finalize, &keyval_, nullptr));
  TESSERA_MPI_CHECK(MPI_Comm_set_attr(MPI_COMM_SELF, keyval_, this));
  thread_ = std::thread([this] { run(); });
}

void ProgressThread::stop() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

ProgressThread::~ProgressThread() {
  stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // MPI freed the attribute and the communicators
  MPI_Comm_delete_attr(MPI_COMM_SELF, keyval_);
  MPI_Comm_free_keyval(&keyval_);
  MPI_Comm_free(&probe_);
}

void ProgressThread::run() {
  while (!stop_.load(std::memory_order_acquire)) {
    int flag = 0;
    // Nothing is ever sent on probe_: the call only runs the progress engine.
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, probe_, &flag, MPI_STATUS_IGNORE);
    probes_.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(interval_);
  }
}

}  // namespace detail
}  // namespace comm
}  // namespace tessera
