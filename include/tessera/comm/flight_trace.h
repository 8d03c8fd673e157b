#pragma once
// Reads the flight records every rank wrote into one directory (Note
// [Flight recorder] in flight_recorder.h) and says which rank is behind, in
// which communicator and operation, and what the others were waiting for.
// `tessera_trace DIR` prints its report.
#include <string>
#include <vector>

namespace tessera {
namespace comm {

struct FlightVerdict {
  int world_size = 0;
  std::vector<int> ranks_read;  // world ranks whose record was read
  std::vector<int> missing;     // world ranks with no record
  // World ranks that had not issued an operation their peers were waiting
  // in (or, missing a record, could not say).
  std::vector<int> behind;
  // One sentence per finding, the most telling first.
  std::vector<std::string> findings;

  // The report: what was read, then the findings.
  std::string text() const;
};

// Throws when `dir` holds no record or a record is not one.
FlightVerdict analyze_flight_records(const std::string& dir);

}  // namespace comm
}  // namespace tessera
