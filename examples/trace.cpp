// tessera_trace: reads the flight records every rank wrote into one
// directory (docs/reliability.md) and says which rank is behind, in which
// communicator and operation, and what the others were waiting for. No MPI
// needed.
//
//   tessera_trace DIR
#include <tessera/comm/flight_trace.h>
#include <tessera/core/cli.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <string>

int main(int argc, char** argv) {
  std::string dir;
  tessera::cli::Command c("tessera_trace", "which rank is behind, from the flight records of a failed job", "DIR");
  c.positional("DIR", &dir,
               "the directory the ranks wrote flight-rank-R.json into (TESSERA_TRACE_DIR, or train_gpt's "
               "METRICS.flight)");
  try {
    const auto parsed = c.parse(argc, argv);
    if (!parsed.run) {
      fmt::print("{}", parsed.text);
      return 0;
    }
    fmt::print("{}", tessera::comm::analyze_flight_records(dir).text());
  } catch (const c10::Error& e) {
    fmt::print(stderr, "tessera_trace: error: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
