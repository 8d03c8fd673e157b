#pragma once
// Shared by the benchmarks: main()'s frame, integer flags and the timing loop.
#include <tessera/comm/mpi_runtime.h>
#include <tessera/core/threads.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace bench {

// main() of a benchmark: MPI up, one intra-op thread per rank, then
// body(rank); a c10::Error (bad flags included) is printed once, by rank 0,
// and every rank exits with 1.
inline int run_main(int* argc, char*** argv, const char* name, const std::function<void(int)>& body) {
  tessera::comm::MpiRuntime mpi(argc, argv);
  tessera::limit_threads(1);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    body(rank);
  } catch (const c10::Error& e) {
    if (rank == 0) fmt::print(stderr, "{}: error: {}\n", name, e.what_without_backtrace());
    return 1;
  }
  return 0;
}

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Timing {
  int steps = 4, warmup = 2, rounds = 3;
};

// Milliseconds per call of `fn`, the slowest rank's, median over rounds.
inline double time_ms(const std::function<void()>& fn, const Timing& t, MPI_Comm comm = MPI_COMM_WORLD) {
  for (int i = 0; i < t.warmup; ++i) fn();
  std::vector<double> rounds;
  for (int r = 0; r < t.rounds; ++r) {
    MPI_Barrier(comm);
    const double start = now_ms();
    for (int i = 0; i < t.steps; ++i) fn();
    double mine = (now_ms() - start) / t.steps, worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);
    rounds.push_back(worst);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

// "--name value" pairs: integer flags go to `ints`, the rest to `strings`;
// anything else is an error naming the flag and the file that documents it.
inline void parse_flags(int argc, char** argv, const std::map<std::string, int64_t*>& ints,
                        const std::map<std::string, std::string*>& strings, const std::string& doc) {
  for (int i = 1; i < argc; i += 2) {
    const std::string f = argv[i];
    TORCH_CHECK(i + 1 < argc, "flag ", f, " needs a value; see ", doc);
    const std::string v = argv[i + 1];
    if (auto s = strings.find(f); s != strings.end()) {
      *s->second = v;
      continue;
    }
    auto n = ints.find(f);
    TORCH_CHECK(n != ints.end(), "unknown flag ", f, "; see ", doc);
    try {
      *n->second = std::stoll(v);
    } catch (const std::exception&) {
      TORCH_CHECK(false, "flag ", f, " needs an integer, got '", v, "'");
    }
  }
}

}  // namespace bench
