#pragma once
// The frame every example's main() shares: MPI's lifetime, one thread per
// rank, and bad input turned into one message from rank 0 and exit status
// 1 on every rank (each rank fails the same way; none may hang).
#include <tessera/comm/mpi_runtime.h>
#include <tessera/core/threads.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <mpi.h>

#include <exception>
#include <functional>

namespace tessera_examples {

inline int run_example(int argc, char** argv, const char* name, const std::function<int(int argc, char** argv)>& body) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  tessera::limit_threads(1);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    return body(argc, argv);
  } catch (const c10::Error& e) {
    if (rank == 0) fmt::print(stderr, "{}: error: {}\n", name, e.what_without_backtrace());
  } catch (const std::exception& e) {
    if (rank == 0) fmt::print(stderr, "{}: error: {}\n", name, e.what());
  }
  return 1;
}

}  // namespace tessera_examples
