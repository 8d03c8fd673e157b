#include "waiting.h"

#include "tessera/comm/flight_trace.h"
#include "tessera/comm/mpi_check.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

namespace tessera {
namespace comm {

std::chrono::milliseconds timeout_from_env() {
  constexpr double kDefaultSeconds = 600;
  const char* value = std::getenv("TESSERA_COMM_TIMEOUT");
  if (value == nullptr || *value == '\0') return std::chrono::milliseconds(static_cast<int64_t>(kDefaultSeconds * 1e3));
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  TORCH_CHECK(end != value && *end == '\0' && seconds >= 0 && seconds < 1e9, "TESSERA_COMM_TIMEOUT='", value,
              "' is not a number of seconds >= 0; use e.g. 600, or 0 to wait forever");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
}

namespace detail {
namespace {

std::string describe(const CommInfo& comm, const char* op, int64_t seq) {
  return fmt::format("{} #{} on communicator '{}' ({}, rank {} of {})", op, seq, comm.name, comm.backend, comm.rank,
                     comm.size);
}

std::string peer_list(const OpInfo& op) {
  const CommInfo& c = *op.comm;
  std::vector<std::string> parts;
  auto world = [&](int r) {
    return r >= 0 && r < static_cast<int>(c.world_ranks.size()) ? c.world_ranks[static_cast<size_t>(r)] : -1;
  };
  auto describe_peer = [&](int r) {
    const std::string host = c.abort ? c.abort->host_of(world(r)) : "";
    return host.empty() ? fmt::format("{} (world {})", r, world(r))
                        : fmt::format("{} (world {} on {})", r, world(r), host);
  };
  if (op.peers.empty()) {
    for (int r = 0; r < c.size; ++r)
      if (r != c.rank) parts.push_back(describe_peer(r));
  } else {
    for (int r : op.peers) parts.push_back(describe_peer(r));
  }
  std::string out;
  for (const auto& part : parts) out += (out.empty() ? "" : ", ") + part;
  return out;
}

}  // namespace

std::shared_ptr<AbortState> AbortState::create(const FlightRecorderOptions& options) {
  int rank = 0, size = 1;
  TESSERA_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  TESSERA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return std::make_shared<AbortState>(std::make_shared<FlightRecorder>(options, rank, size),
                                      FaultInjector::from_env(rank, size));
}

void AbortState::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.load(std::memory_order_relaxed)) return;
  reason_ = reason;
  aborted_.store(true, std::memory_order_release);
}

void AbortState::set_hosts(std::vector<std::string> by_world_rank) {
  std::vector<std::string> distinct = by_world_rank;
  std::sort(distinct.begin(), distinct.end());
  if (std::unique(distinct.begin(), distinct.end()) - distinct.begin() > 1) hosts_ = std::move(by_world_rank);
}

std::string AbortState::host_of(int world_rank) const {
  return world_rank >= 0 && world_rank < static_cast<int>(hosts_.size()) ? hosts_[static_cast<size_t>(world_rank)] : "";
}

std::string AbortState::reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

std::shared_ptr<const CommInfo> make_comm_info(MPI_Comm comm, const std::string& name, const std::string& backend,
                                               std::chrono::milliseconds timeout, std::shared_ptr<AbortState> abort) {
  auto info = std::make_shared<CommInfo>();
  info->name = name;
  info->backend = backend;
  TESSERA_MPI_CHECK(MPI_Comm_rank(comm, &info->rank));
  TESSERA_MPI_CHECK(MPI_Comm_size(comm, &info->size));
  info->timeout = timeout;
  info->abort = std::move(abort);
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  TESSERA_MPI_CHECK(MPI_Comm_group(comm, &group));
  TESSERA_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world));
  std::vector<int> mine(static_cast<size_t>(info->size));
  for (int r = 0; r < info->size; ++r) mine[static_cast<size_t>(r)] = r;
  info->world_ranks.resize(mine.size());
  const int result = MPI_Group_translate_ranks(group, info->size, mine.data(), world, info->world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  TESSERA_MPI_CHECK(result);
  if (info->abort && info->abort->recorder())
    info->recorder_comm = info->abort->recorder()->add_communicator(name, backend, info->world_ranks, info->timeout);
  return info;
}

OpInfo begin_op(const std::shared_ptr<const CommInfo>& comm, const char* op, int64_t seq, std::vector<int> peers,
                int64_t bytes, const char* dtype) {
  OpInfo info{comm, op, seq, std::move(peers), -1};
  FaultInjector* faults = comm->abort ? comm->abort->faults().get() : nullptr;
  if (comm->recorder_comm >= 0)
    info.record = comm->abort->recorder()->issued(comm->recorder_comm, op, seq, info.peers, bytes, dtype,
                                                  /*posted=*/faults == nullptr);
  if (faults) {
    faults->before_op(op);  // an injected hang stays here
    if (comm->recorder_comm >= 0) comm->abort->recorder()->posted(info.record);
  }
  return info;
}

void end_op(const OpInfo& op, OpState state) {
  if (op.record >= 0) op.comm->abort->recorder()->ended(op.record, state);
}

void check_not_aborted(const CommInfo& comm, const char* op) {
  if (!comm.abort || !comm.abort->aborted()) return;
  TORCH_CHECK(false, op, " on communicator '", comm.name, "': refused, the communicators of this job were aborted ",
              "after an earlier timeout: ", comm.abort->reason());
}

namespace {

// What the records in the recorder's directory say about who is behind,
// for the end of a timeout message; "" without records.
std::string flight_summary(const FlightRecorder& recorder) {
  if (recorder.dir().empty()) return "";
  try {
    const FlightVerdict v = analyze_flight_records(recorder.dir(), recorder.started_us());
    std::string out = fmt::format(" Flight records of {} of {} ranks in {} (tessera_trace {})", v.ranks_read.size(),
                                  v.world_size, recorder.dir(), recorder.dir());
    if (v.behind.empty()) return out + " name no rank as behind.";
    std::string ranks;
    for (int r : v.behind) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    out += fmt::format(" put world rank(s) {} behind", ranks);
    return out + (v.findings.empty() ? "." : ": " + v.findings.front() + ".");
  } catch (const std::exception& e) {
    return fmt::format(" The flight records in {} could not be read: {}", recorder.dir(), e.what());
  }
}

}  // namespace

void wait_until(const std::function<bool()>& test, const OpInfo& op, const std::function<void()>& on_abort) {
  using Clock = std::chrono::steady_clock;
  const CommInfo& c = *op.comm;
  check_not_aborted(c, op.op);
  const auto start = Clock::now();
  FlightRecorder* recorder = c.abort ? c.abort->recorder().get() : nullptr;
  for (int64_t polls = 0;; ++polls) {
    if (test()) {
      if (recorder) recorder->add_wait(Clock::now() - start);
      return;
    }
    // Another operation of the family timed out: its ranks are gone.
    check_not_aborted(c, op.op);
    // Note [Polling a wait]
    // Spin first (a collective that is about to finish), then yield, then
    // sleep a twentieth of the time waited so far, from 20 us up to 1 ms:
    // a wait then ends at most 5 % (or 1 ms) after its operation did, and a
    // rank waiting for a straggler costs about 1 % of a core instead of the
    // 16 % that fixed 20 us sleeps cost (a wakeup and an MPI_Testall each),
    // which ranks sharing cores took from the ranks they waited for.
    if (polls < 100) continue;
    const auto waited = Clock::now() - start;
    if (polls < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(
          std::clamp<Clock::duration>(waited / 20, std::chrono::microseconds(20), std::chrono::milliseconds(1)));
    }
    if (c.timeout.count() > 0 && waited >= c.timeout) break;
  }
  const std::string message = fmt::format(
      "tessera: {} did not complete within {:g} s. Peers (rank in the communicator, world rank): {}. One of them "
      "stalled, died or called a different operation; their own messages say which. This rank has aborted "
      "'{}' and every communicator split from the same world: end the process (MPI cannot finalize with the "
      "operation pending). TESSERA_COMM_TIMEOUT sets the limit in seconds.",
      describe(c, op.op, op.seq), static_cast<double>(c.timeout.count()) / 1e3, peer_list(op), c.name);
  if (on_abort) on_abort();
  if (c.abort) c.abort->abort(describe(c, op.op, op.seq) + " timed out");
  end_op(op, OpState::kTimedOut);
  if (c.abort && c.abort->recorder()) {
    c.abort->recorder()->dump_on_timeout(message);
    throw TimeoutError(message + flight_summary(*c.abort->recorder()));
  }
  throw TimeoutError(message);
}

}  // namespace detail
}  // namespace comm
}  // namespace tessera
