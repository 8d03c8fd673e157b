#pragma once
// Reads the flight records every rank wrote into one directory (Note
// [Flight recorder] in flight_recorder.h) and says which rank is behind, in
// which communicator and operation, and what the others were waiting for.
// `tessera_trace DIR` prints its report.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace comm {

// Note [Stuck inside an operation]
// Every rank gives up on an operation the same timeout after entering it.
// A waiter whose entry is still "issued" although it entered within half
// that timeout of the last rank that gave up, and had been inside it for at
// least half of it when its record was written, did not give up as its
// peers did: it is stuck in the operation itself (an injected hang, a kernel
// that never ends), not late. The half leaves room for the watcher's poll
// between a peer's record and this rank's own. A rank that merely arrived
// inside that window gives up later and rewrites its record, so the reader
// run after the job has ended sees it as it was.

struct FlightVerdict {
  int world_size = 0;
  std::vector<int> ranks_read;  // world ranks whose record was read
  std::vector<int> missing;     // world ranks with no record
  // World ranks that had not issued an operation their peers were waiting
  // in and wait in nothing themselves, are stuck inside one (Note [Stuck
  // inside an operation]), or, missing a record, could not say. A rank
  // behind only because it waits for these is left out (named in the
  // findings).
  std::vector<int> behind;
  // One sentence per finding, the most telling first.
  std::vector<std::string> findings;

  // The report: what was read, then the findings.
  std::string text() const;
};

// Throws when `dir` holds no record or a record is not one. Records dumped
// before `since_us` (system-clock microseconds) are left out: an earlier
// run's.
FlightVerdict analyze_flight_records(const std::string& dir, int64_t since_us = 0);

}  // namespace comm
}  // namespace tessera
