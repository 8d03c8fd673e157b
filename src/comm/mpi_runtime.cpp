#include "tessera/comm/mpi_runtime.h"

#include "tessera/comm/mpi_check.h"

namespace tessera {
namespace comm {

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int initialized = 0;
  TESSERA_MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized) {
    TESSERA_MPI_CHECK(MPI_Query_thread(&thread_level_));
    return;
  }
  TESSERA_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level_));
  owns_ = true;
}

MpiRuntime::~MpiRuntime() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace comm
}  // namespace tessera
