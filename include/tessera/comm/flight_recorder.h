#pragma once
// The flight recorder: the last N operations of every communicator of a
// process, written as JSON when something goes wrong (docs/reliability.md).
//
// Note [Flight recorder]
// One recorder per world communicator (normally one per process), shared
// with everything split from it (as the abort state is). Each operation is recorded when it
// is issued (op, sequence number on its communicator, peers, bytes, dtype,
// start time) and again when a wait observes it complete, time out or be
// abandoned. The buffer is a ring of `entries` slots whose storage is reused,
// so recording costs a lock and two clock reads, no allocation once warm.
//
// A record is written, one file per rank (DIR/flight-rank-R.json):
//  - when a wait times out on this rank (Note [Timeouts]), which then waits
//    up to `peer_wait` for the other ranks' records before it throws;
//  - when another rank's record appears in DIR: a watcher thread polls DIR
//    and writes this rank's record once, so a rank stuck in compute (never
//    in a timed wait) still says what it last did. This is the shared
//    directory standing in for PyTorch's store-based "dump on peer timeout";
//  - when DIR/flight.request is touched (on request, each new touch);
//  - when code calls dump() (the trainer does on an uncaught error);
//  - on a fatal signal (Note [Records on a fatal signal]).
// Only records whose modification time is at or after the recorder's start
// count as peers' records, so files left from an earlier run trigger nothing.
// `tessera_trace DIR` reads them all and names the rank that is behind.
//
// NCCL operations are issued on a stream: their entries say "issued" until
// a wait or is_completed() on the host observes their event.
//
// Note [Overdue operations]
// An entry stays "issued" while its operation is in flight, and an
// asynchronous one may stay so for long while the rank waits for
// something else. What no healthy rank does is stay inside the call that
// issues an operation: tessera's calls post nonblocking operations and
// wait in timed waits. So an entry whose issuing call has not returned a
// poll interval past its communicator's timeout is stuck inside it: an
// injected hang (Note [Fault injection]) is the one way in today, which is
// why only then is the call's return recorded (posted()); otherwise
// entries are posted when issued, at no cost. The watcher checks each
// poll, and the first time it finds one it writes the record, naming it,
// as PyTorch's NCCL watchdog does for a hung collective; such entries are
// marked "overdue" in the record, and the reader names their rank as stuck.
//
// Note [Records on a fatal signal]
// A launcher ends the other ranks of a job whose rank died with SIGTERM
// (then SIGKILL); a crash raises SIGSEGV, SIGBUS, SIGFPE, SIGILL or
// SIGABRT. The first recorder of a process with a directory installs a
// handler for these. A handler may only call async-signal-safe functions,
// and JSON and file writes are not, so it writes the signal's number into
// a pipe, which wakes the watcher thread; the watcher writes the record,
// and the handler waits for that (2 s at most, since the interrupted
// thread may hold a lock the writer needs), then puts back the action
// that was there before (Open MPI's, LibTorch's or the default) and raises
// the signal again. Signals belong to the whole process, so the pipe's
// write end is the one process-wide variable of comm/, owned by that
// recorder and given up by its destructor. SIGKILL and SIGSTOP cannot be
// caught: such a rank writes nothing, and the reader names it as missing.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tessera {
namespace comm {

struct FlightRecorderOptions {
  // Operations kept; 0 turns recording off. TESSERA_TRACE_BUFFER, or 2000.
  int64_t entries = entries_from_env();
  // Where records are written; empty: only dump_to() writes.
  // TESSERA_TRACE_DIR, or empty.
  std::string dir = dir_from_env();
  // After its own timeout, how long a rank waits for the others' records.
  std::chrono::milliseconds peer_wait{5000};
  // How often the watcher looks at DIR.
  std::chrono::milliseconds poll{250};

  static int64_t entries_from_env();
  static std::string dir_from_env();
};

// The states an entry goes through.
enum class OpState { kIssued, kCompleted, kTimedOut, kAbandoned };

std::string op_state_name(OpState state);

class FlightRecorder {
 public:
  // world_rank/world_size: this process's place in MPI_COMM_WORLD (the file
  // name and what the reader checks completeness against).
  FlightRecorder(FlightRecorderOptions options, int world_rank, int world_size);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // A communicator's row in the record; returns its index. `timeout` is its
  // waits' (0: none), for Note [Overdue operations].
  int add_communicator(const std::string& name, const std::string& backend, const std::vector<int>& world_ranks,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  // Records an issued operation; returns its id (-1 when recording is off).
  // `op` and `dtype` must be static strings; "send", "recv" and
  // "batch_isend_irecv" are point-to-point, the rest collectives.
  int64_t issued(int comm, const char* op, int64_t seq, const std::vector<int>& peers, int64_t bytes, const char* dtype,
                 bool posted = true);
  // The issuing call of entry `id`, recorded with posted = false, got past
  // the point where it hands the operation to the backend (Note [Overdue
  // operations]).
  void posted(int64_t id);
  // Moves entry `id` to `state` with its end time (a no-op when the ring has
  // passed it or it already ended).
  void ended(int64_t id, OpState state);

  // Time this process's host spent waiting for operations of the family to
  // complete (polling waits and MPI's blocking calls), recording on or off:
  // the trainer's compute/wait split per step (Note [Stragglers] in
  // train/trainer.h).
  void add_wait(std::chrono::nanoseconds waited) { waited_ns_.fetch_add(waited.count(), std::memory_order_relaxed); }
  double waited_seconds() const { return 1e-9 * static_cast<double>(waited_ns_.load(std::memory_order_relaxed)); }

  // The record as JSON: rank, reason, communicators with their last issued
  // and completed sequence numbers, entries oldest first.
  std::string to_json(const std::string& reason) const;
  // Writes this rank's record into the options' dir (atomically); returns the
  // path, or "" without a directory.
  std::string dump(const std::string& reason);
  void dump_to(const std::string& path, const std::string& reason) const;
  // A timed-out wait: writes the record, then waits up to peer_wait for
  // every rank's record to appear in the directory.
  void dump_on_timeout(const std::string& reason);

  // DIR/flight-rank-R.json.
  static std::string record_path(const std::string& dir, int world_rank);

  // Where records go ("" for nowhere) and when this recorder started
  // (system-clock microseconds: older records are an earlier run's).
  const std::string& dir() const { return options_.dir; }
  int64_t started_us() const;

 private:
  struct Entry {
    int64_t id = -1;
    int comm = 0;
    const char* op = "";
    int64_t seq = 0;
    int64_t collective = 0;  // the communicator's collective count at this one; 0: point-to-point
    std::vector<int> peers;
    int64_t bytes = 0;
    const char* dtype = "";
    OpState state = OpState::kIssued;
    bool posted = true;    // false while its issuing call has not returned
    int64_t start_us = 0;  // system clock, so ranks' records line up
    int64_t end_us = 0;
  };
  struct CommRow {
    std::string name;
    std::string backend;
    std::vector<int> world_ranks;
    int64_t last_issued = 0;
    int64_t last_completed = 0;
    // Collectives only: point-to-point operations involve some members, so
    // only this count lines up across the members' records.
    int64_t collectives = 0;
    int64_t timeout_us = 0;
  };
  // Note [Overdue operations]: whether `e` is, at `now_us`.
  bool overdue_locked(const Entry& e, int64_t now_us) const;

  void watch();
  void write_record(const std::string& path, const std::string& reason) const;
  // Note [Records on a fatal signal]: claims the process's handlers, or not.
  void install_signal_handlers();
  void remove_signal_handlers();

  FlightRecorderOptions options_;
  int world_rank_ = 0;
  int world_size_ = 1;
  int64_t capacity_ = 0;
  std::chrono::system_clock::time_point started_;
  std::atomic<int64_t> waited_ns_{0};

  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  int64_t next_id_ = 0;
  std::vector<CommRow> comms_;
  bool dumped_ = false;  // guarded by mutex_: a peer's record triggers one dump
  bool overdue_reported_ = false;  // the watcher's own thread only

  // The watcher sleeps in poll() on this pipe: a signal's number wakes it,
  // and 0 stops it.
  int wake_read_ = -1;
  int wake_write_ = -1;
  bool handles_signals_ = false;
  std::thread watcher_;
};

}  // namespace comm
}  // namespace tessera
