#pragma once
// Shared by the benchmarks: main()'s frame, integer flags and the timing loop.
#include <tessera/comm/mpi_runtime.h>
#include <tessera/context/parallel_config.h>
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

// The benchmark's own flags, "--name value" or "--name=value": integers go
// to `ints`, the rest to `strings`. The grid's dimensions (--dp --pp --tp
// --tp-mode --tp-depth --sp --sp-mode --ep --order --seed) are read by the
// library's one parser, context::config_from_args, over `grid`, which is
// returned. Anything else is an error naming the flag and the file that
// documents it.
inline tessera::context::ParallelConfig parse_flags(int argc, char** argv,
                                                    const std::map<std::string, int64_t*>& ints,
                                                    const std::map<std::string, std::string*>& strings,
                                                    const std::string& doc,
                                                    const tessera::context::ParallelConfig& grid = {}) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    TORCH_CHECK(arg.rfind("--", 0) == 0, "expected a flag, got '", arg, "'; see ", doc);
    const size_t eq = arg.find('=');
    const std::string f = arg.substr(0, eq);
    std::string v;
    if (eq != std::string::npos) {
      v = arg.substr(eq + 1);
    } else {
      TORCH_CHECK(i + 1 < argc, "flag ", f, " needs a value; see ", doc);
      v = argv[++i];
    }
    if (tessera::context::is_parallel_flag(f)) continue;
    if (auto s = strings.find(f); s != strings.end()) {
      *s->second = v;
      continue;
    }
    auto n = ints.find(f);
    TORCH_CHECK(n != ints.end(), "unknown flag ", f, "; see ", doc);
    try {
      size_t used = 0;
      *n->second = std::stoll(v, &used);
      TORCH_CHECK(used == v.size(), "trailing characters");
    } catch (const std::exception&) {
      TORCH_CHECK(false, "flag ", f, " needs an integer, got '", v, "'");
    }
  }
  return tessera::context::config_from_args(argc, argv, grid);
}

// "1,2,4" -> {1, 2, 4}: positive integers separated by commas, the value of `flag`.
inline std::vector<int64_t> parse_int_list(const std::string& text, const std::string& flag) {
  std::vector<int64_t> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    TORCH_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos, flag,
                " takes positive integers separated by commas, got '", text, "'");
    out.push_back(std::stoll(item));
    begin = end + 1;
  }
  return out;
}

// Whether argv has `flag`, as "--flag value" or "--flag=value".
inline bool flag_given(int argc, char** argv, const std::string& flag) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == flag || arg.rfind(flag + "=", 0) == 0) return true;
  }
  return false;
}

}  // namespace bench
