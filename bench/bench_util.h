#pragma once
// Shared by the benchmarks: the timing loop and integer lists. Their main()
// is examples/example_main.h's run_command, their options a cli::Command.
#include <tessera/core/cli.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace bench {

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --steps, --warmup, --rounds: the timed loop of time_ms below.
inline void add_timing_options(tessera::cli::Command& c, int64_t* steps, int64_t* warmup, int64_t* rounds) {
  c.group("Timing");
  c.add("steps", steps, "timed steps per round");
  c.add("warmup", warmup, "untimed steps before the rounds");
  c.add("rounds", rounds, "timed rounds; the median is reported");
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

// "a,b,c" -> {"a", "b", "c"}; an empty item stays empty.
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    out.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

// "1,2,4" -> {1, 2, 4}: positive integers separated by commas, the value of `flag`.
inline std::vector<int64_t> parse_int_list(const std::string& text, const std::string& flag) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text)) {
    TORCH_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos, flag,
                " takes positive integers separated by commas, got '", text, "'");
    out.push_back(std::stoll(item));
  }
  return out;
}

}  // namespace bench
