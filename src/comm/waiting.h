#pragma once
// Timed waits and the abort state they share (Note [Timeouts] in
// communicator.h). Internal to comm/.
#include "tessera/comm/communicator.h"
#include "tessera/comm/flight_recorder.h"
#include "tessera/core/fault_injection.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tessera {
namespace comm {
namespace detail {

// Shared by a world communicator, its control channel and everything split
// from them: once one of them times out, all refuse further operations.
// The family's flight recorder lives here too (Note [Flight recorder]), and
// its fault injector (Note [Fault injection] in core/fault_injection.h).
class AbortState {
 public:
  AbortState(std::shared_ptr<FlightRecorder> recorder, std::shared_ptr<FaultInjector> faults)
      : recorder_(std::move(recorder)), faults_(std::move(faults)) {}
  // A new family recording with `options` (this process's world rank names
  // its file), injecting TESSERA_FAULT's faults.
  static std::shared_ptr<AbortState> create(const FlightRecorderOptions& options);

  // Keeps the first reason.
  void abort(const std::string& reason);
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  std::string reason() const;
  const std::shared_ptr<FlightRecorder>& recorder() const { return recorder_; }
  // Null without TESSERA_FAULT.
  const std::shared_ptr<FaultInjector>& faults() const { return faults_; }
  // Each world rank's host name, when the family's ranks span several hosts
  // (empty otherwise): timeout messages name the host of each peer.
  void set_hosts(std::vector<std::string> by_world_rank);
  std::string host_of(int world_rank) const;

 private:
  std::shared_ptr<FlightRecorder> recorder_;
  std::shared_ptr<FaultInjector> faults_;
  std::vector<std::string> hosts_;  // set once, at the family's creation
  std::atomic<bool> aborted_{false};
  mutable std::mutex mutex_;
  std::string reason_;
};

// What a timeout message says about the communicator; one per communicator,
// shared by its outstanding operations.
struct CommInfo {
  std::string name;
  std::string backend;
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;  // of every rank of the communicator
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<AbortState> abort;
  int recorder_comm = -1;  // this communicator's row in the family's flight record
};

// The info of a communicator over `comm` (its world ranks translated).
std::shared_ptr<const CommInfo> make_comm_info(MPI_Comm comm, const std::string& name, const std::string& backend,
                                               std::chrono::milliseconds timeout, std::shared_ptr<AbortState> abort);

// One operation being waited for.
struct OpInfo {
  std::shared_ptr<const CommInfo> comm;
  const char* op = "";  // a static name: "all_reduce", "batch_isend_irecv", ...
  int64_t seq = 0;      // the operation's number on its communicator, from 1
  std::vector<int> peers;  // ranks in the communicator; empty: all of them
  // The flight recorder's entry; -1: none.
  int64_t record = -1;
};

// Records operation `seq` as issued on the family's flight recorder and
// returns its info (after which an injected hang stops here). bytes/dtype as in Note [Trace byte
// counts]; dtype a static string ("" for none).
OpInfo begin_op(const std::shared_ptr<const CommInfo>& comm, const char* op, int64_t seq, std::vector<int> peers,
                int64_t bytes, const char* dtype);
// Records how the operation ended.
void end_op(const OpInfo& op, OpState state);

// Throws, naming the communicator and the first timed-out operation, if the
// communicator was aborted.
void check_not_aborted(const CommInfo& comm, const char* op);

// Calls test() until it returns true. Spins first (low latency), then
// yields, then sleeps in short steps (oversubscribed ranks need the core).
// After the communicator's timeout (none when zero), aborts the
// communicator's family and throws TimeoutError; `on_abort` runs first
// (the NCCL backend aborts its communicator there).
void wait_until(const std::function<bool()>& test, const OpInfo& op,
                const std::function<void()>& on_abort = nullptr);

}  // namespace detail
}  // namespace comm
}  // namespace tessera
