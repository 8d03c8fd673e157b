#pragma once
// The frame every command's main() shares (the examples' and the
// benchmarks'): its options parsed before MPI starts, MPI's lifetime, one
// thread per rank, and errors turned into a message and a non-zero exit on
// every rank, never a hang (Note [One rank's error]).
#include <tessera/comm/mpi_runtime.h>
#include <tessera/core/cli.h>
#include <tessera/core/threads.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>

namespace tessera_examples {

// Note [One rank's error]
// Bad input (a flag, a grid that does not fit) fails on every rank alike;
// an error that only some ranks meet (a data file missing on one node, a
// disk full on one rank) leaves the others blocked in their next
// collective. A failing rank therefore waits up to kAgreeSeconds for every
// rank to fail too, on a barrier of a communicator kept for that alone:
// when all fail, rank 0 prints the one message and every rank exits with
// status 1; when they do not, the rank prints its own error, naming itself,
// and ends the job with MPI_Abort, which stops every rank.
constexpr double kAgreeSeconds = 10;

inline int run_example(int argc, char** argv, const char* name, const std::function<int(int argc, char** argv)>& body) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  tessera::limit_threads(1);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm failures = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &failures);
  std::string message;
  try {
    const int status = body(argc, argv);
    MPI_Comm_free(&failures);
    return status;
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    message = e.what();
  }
  MPI_Request all_failed = MPI_REQUEST_NULL;
  MPI_Ibarrier(failures, &all_failed);
  const auto start = std::chrono::steady_clock::now();
  int done = 0;
  while (!done && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < kAgreeSeconds) {
    MPI_Test(&all_failed, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (done) {
    if (rank == 0) fmt::print(stderr, "{}: error: {}\n", name, message);
    MPI_Comm_free(&failures);
    return 1;
  }
  fmt::print(stderr, "{}: error on rank {} of {} (the other ranks did not fail within {} s; ending the job): {}\n",
             name, rank, size, kAgreeSeconds, message);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

// This process's rank as the launcher numbered it (0 without a launcher):
// read before MPI starts.
inline int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return 0;
}

// Note [Options before MPI]
// The command's options are parsed before MPI starts: --help and --version
// answer without mpirun's start-up (once, from rank 0, under it). Every rank
// parses the same argv and files, so a refusal is the same on every rank;
// it still goes through MPI (Note [One rank's error]): rank 0 prints it
// before MPI_Finalize, whose synchronisation keeps every rank alive until
// then. Exiting at once instead lets the first rank's status 1 make mpirun
// end the job, which can kill rank 0 before it printed (seen on a machine of
// one core).
inline int run_command(int argc, char** argv, tessera::cli::Command& command, const std::function<int()>& body) {
  tessera::cli::Parsed parsed;
  try {
    parsed = command.parse(argc, argv);
  } catch (const c10::Error& e) {
    const std::string refusal = e.what_without_backtrace();
    return run_example(argc, argv, command.name().c_str(), [&](int, char**) -> int { TORCH_CHECK(false, refusal); });
  }
  if (!parsed.run) {
    if (launcher_rank() == 0) fmt::print("{}", parsed.text);
    return 0;
  }
  return run_example(argc, argv, command.name().c_str(), [&](int, char**) { return body(); });
}

}  // namespace tessera_examples
