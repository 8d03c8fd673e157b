#include "tessera/comm/flight_recorder.h"

#include "flight_files.h"

#include "tessera/core/atomic_file.h"
#include "tessera/core/logging.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace tessera {
namespace comm {
namespace {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Modification time of `path` in microseconds, or -1 when absent.
int64_t mtime_us(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000 + st.st_mtim.tv_nsec / 1000;
}

// World ranks whose records in `dir` were written at or after `since_us`.
std::vector<int> records_since(const std::string& dir, int64_t since_us) {
  std::vector<int> ranks;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ranks;
  while (const dirent* e = ::readdir(d)) {
    int rank = -1;
    if (!detail::parse_record_name(e->d_name, &rank)) continue;
    if (mtime_us(dir + "/" + e->d_name) >= since_us) ranks.push_back(rank);
  }
  ::closedir(d);
  return ranks;
}

// Note [Records on a fatal signal]: the process-wide part.
constexpr int kFatalSignals[] = {SIGTERM, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
std::atomic<int> signal_pipe{-1};           // the claiming recorder's wake pipe; -1: none
std::atomic<int> signal_record_written{0};  // set by the watcher once the record is on disk
struct sigaction previous_actions[NSIG];

void on_fatal_signal(int signo) {
  const int saved_errno = errno;
  const int fd = signal_pipe.load();
  if (fd >= 0) {
    const unsigned char byte = static_cast<unsigned char>(signo);
    if (::write(fd, &byte, 1) == 1) {
      const timespec tick = {0, 10 * 1000 * 1000};
      for (int i = 0; i < 200 && signal_record_written.load() == 0; ++i) ::nanosleep(&tick, nullptr);
    }
  }
  ::sigaction(signo, &previous_actions[signo], nullptr);
  errno = saved_errno;
  ::raise(signo);
}

}  // namespace

int64_t FlightRecorderOptions::entries_from_env() {
  const char* value = std::getenv("TESSERA_TRACE_BUFFER");
  if (value == nullptr || *value == '\0') return 2000;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && n >= 0 && n <= 10000000, "TESSERA_TRACE_BUFFER='", value,
              "' is not a number of operations from 0 to 10000000; use e.g. 2000, or 0 to record nothing");
  return n;
}

std::string FlightRecorderOptions::dir_from_env() {
  const char* value = std::getenv("TESSERA_TRACE_DIR");
  return value == nullptr ? std::string() : std::string(value);
}

std::string op_state_name(OpState state) {
  switch (state) {
    case OpState::kIssued:
      return "issued";
    case OpState::kCompleted:
      return "completed";
    case OpState::kTimedOut:
      return "timed out";
    case OpState::kAbandoned:
      return "abandoned";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled OpState");
}

FlightRecorder::FlightRecorder(FlightRecorderOptions options, int world_rank, int world_size)
    : options_(std::move(options)),
      world_rank_(world_rank),
      world_size_(world_size),
      capacity_(options_.entries),
      started_(std::chrono::system_clock::now()) {
  ring_.resize(static_cast<size_t>(capacity_));
  if (capacity_ > 0 && !options_.dir.empty()) {
    // Made here (not at the first dump) so that a bad directory is refused at once.
    if (::mkdir(options_.dir.c_str(), 0755) != 0 && errno != EEXIST)
      TORCH_CHECK(false, "flight recorder: cannot create the record directory '", options_.dir, "' (",
                  std::strerror(errno), "); set TESSERA_TRACE_DIR to a writable directory whose parent exists");
    int fds[2];
    TORCH_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0,
                "flight recorder: cannot make a pipe: ", std::strerror(errno));
    wake_read_ = fds[0];
    wake_write_ = fds[1];
    watcher_ = std::thread([this] { watch(); });
    install_signal_handlers();
  }
}

FlightRecorder::~FlightRecorder() {
  if (!watcher_.joinable()) return;
  remove_signal_handlers();
  const unsigned char stop = 0;
  while (::write(wake_write_, &stop, 1) != 1 && errno == EINTR) {
  }
  watcher_.join();
  ::close(wake_read_);
  ::close(wake_write_);
}

void FlightRecorder::install_signal_handlers() {
  int none = -1;
  if (!signal_pipe.compare_exchange_strong(none, wake_write_)) return;  // another recorder has them
  handles_signals_ = true;
  struct sigaction action {};
  action.sa_handler = on_fatal_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signo : kFatalSignals) ::sigaction(signo, &action, &previous_actions[signo]);
}

void FlightRecorder::remove_signal_handlers() {
  if (!handles_signals_) return;
  for (int signo : kFatalSignals) ::sigaction(signo, &previous_actions[signo], nullptr);
  signal_pipe.store(-1);
  handles_signals_ = false;
}

int FlightRecorder::add_communicator(const std::string& name, const std::string& backend,
                                     const std::vector<int>& world_ranks, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  comms_.push_back(CommRow{name, backend, world_ranks, 0, 0, 0, 1000 * static_cast<int64_t>(timeout.count())});
  return static_cast<int>(comms_.size()) - 1;
}

int64_t FlightRecorder::issued(int comm, const char* op, int64_t seq, const std::vector<int>& peers, int64_t bytes,
                               const char* dtype, bool posted) {
  if (capacity_ == 0) return -1;
  const int64_t start = now_us();
  const bool p2p =
      std::strcmp(op, "send") == 0 || std::strcmp(op, "recv") == 0 || std::strcmp(op, "batch_isend_irecv") == 0;
  std::lock_guard<std::mutex> lock(mutex_);
  CommRow& row = comms_[static_cast<size_t>(comm)];
  const int64_t id = next_id_++;
  Entry& e = ring_[static_cast<size_t>(id % capacity_)];
  e.id = id;
  e.comm = comm;
  e.op = op;
  e.seq = seq;
  e.collective = p2p ? 0 : ++row.collectives;
  e.peers.assign(peers.begin(), peers.end());  // reuses the slot's storage
  e.bytes = bytes;
  e.dtype = dtype;
  e.state = OpState::kIssued;
  e.posted = posted;
  e.start_us = start;
  e.end_us = 0;
  row.last_issued = seq;
  return id;
}

void FlightRecorder::posted(int64_t id) {
  if (id < 0 || capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[static_cast<size_t>(id % capacity_)];
  if (e.id == id) e.posted = true;
}

void FlightRecorder::ended(int64_t id, OpState state) {
  if (id < 0 || capacity_ == 0) return;
  const int64_t end = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[static_cast<size_t>(id % capacity_)];
  if (e.id != id || e.state != OpState::kIssued) return;
  e.state = state;
  e.end_us = end;
  if (state == OpState::kCompleted) {
    int64_t& last = comms_[static_cast<size_t>(e.comm)].last_completed;
    if (e.seq > last) last = e.seq;
  }
}

bool FlightRecorder::overdue_locked(const Entry& e, int64_t now) const {
  if (e.id < 0 || e.state != OpState::kIssued || e.posted) return false;
  const CommRow& row = comms_[static_cast<size_t>(e.comm)];
  if (row.timeout_us <= 0) return false;
  return now - e.start_us > row.timeout_us + 1000 * static_cast<int64_t>(options_.poll.count());
}

std::string FlightRecorder::to_json(const std::string& reason) const {
  using nlohmann::json;
  json record;
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  record["version"] = 1;
  record["rank"] = world_rank_;
  record["world_size"] = world_size_;
  record["host"] = host;
  record["pid"] = static_cast<int64_t>(::getpid());
  record["reason"] = reason;
  const int64_t dumped = now_us();
  record["dumped_us"] = dumped;
  record["capacity"] = capacity_;
  std::lock_guard<std::mutex> lock(mutex_);
  json comms = json::array();
  for (const auto& c : comms_)
    comms.push_back({{"name", c.name},
                     {"backend", c.backend},
                     {"world_ranks", c.world_ranks},
                     {"last_issued", c.last_issued},
                     {"last_completed", c.last_completed},
                     {"collectives", c.collectives},
                     {"timeout_us", c.timeout_us}});
  record["communicators"] = std::move(comms);
  json entries = json::array();
  const int64_t first = next_id_ > capacity_ ? next_id_ - capacity_ : 0;
  for (int64_t id = first; id < next_id_; ++id) {
    const Entry& e = ring_[static_cast<size_t>(id % capacity_)];
    entries.push_back({{"id", e.id},
                       {"comm", e.comm},
                       {"op", e.op},
                       {"seq", e.seq},
                       {"collective", e.collective},
                       {"peers", e.peers},
                       {"bytes", e.bytes},
                       {"dtype", e.dtype},
                       {"state", op_state_name(e.state)},
                       {"start_us", e.start_us},
                       {"end_us", e.end_us},
                       {"overdue", overdue_locked(e, dumped)}});
  }
  record["entries"] = std::move(entries);
  return record.dump(1);
}

std::string FlightRecorder::record_path(const std::string& dir, int world_rank) {
  return fmt::format("{}/flight-rank-{}.json", dir, world_rank);
}

void FlightRecorder::dump_to(const std::string& path, const std::string& reason) const {
  write_file_atomically(path, to_json(reason));
}

void FlightRecorder::write_record(const std::string& path, const std::string& reason) const {
  try {
    dump_to(path, reason);
    log_message(LogLevel::kError, world_rank_, fmt::format("flight record written to {} ({})", path, reason));
  } catch (const std::exception& e) {
    // A record is a diagnostic: failing to write one must not hide the error being reported.
    log_message(LogLevel::kError, world_rank_, fmt::format("flight record not written: {}", e.what()));
  }
}

std::string FlightRecorder::dump(const std::string& reason) {
  if (options_.dir.empty() || capacity_ == 0) return "";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dumped_ = true;
  }
  const std::string path = record_path(options_.dir, world_rank_);
  write_record(path, reason);
  return path;
}

int64_t FlightRecorder::started_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(started_.time_since_epoch()).count();
}

void FlightRecorder::dump_on_timeout(const std::string& reason) {
  if (dump(reason).empty()) return;
  const int64_t since = started_us();
  const auto deadline = std::chrono::steady_clock::now() + options_.peer_wait;
  while (std::chrono::steady_clock::now() < deadline) {
    if (static_cast<int>(records_since(options_.dir, since).size()) >= world_size_) {
      // Time for a rank stuck inside an operation to mark it overdue (Note [Overdue operations]).
      std::this_thread::sleep_for(2 * options_.poll);
      return;
    }
    std::this_thread::sleep_for(options_.poll);
  }
}

void FlightRecorder::watch() {
  const int64_t since = started_us();
  const std::string request = options_.dir + "/flight.request";
  int64_t last_request = std::max(mtime_us(request), since - 1);
  for (;;) {
    pollfd wake = {wake_read_, POLLIN, 0};
    if (::poll(&wake, 1, static_cast<int>(options_.poll.count())) > 0) {
      unsigned char byte = 0;
      if (::read(wake_read_, &byte, 1) == 1) {
        if (byte == 0) return;  // the destructor
        dump(fmt::format("signal {} ({})", static_cast<int>(byte), ::strsignal(byte)));
        signal_record_written.store(1);
        continue;
      }
    }
    if (!overdue_reported_) {
      std::string stuck;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        const int64_t now = now_us();
        for (const Entry& e : ring_) {
          if (!overdue_locked(e, now)) continue;
          const CommRow& row = comms_[static_cast<size_t>(e.comm)];
          stuck = fmt::format(
              "{} #{} on '{}' has been in progress for {:.1f} s, past its timeout of {:g} s: this "
              "rank is stuck inside it (Note [Overdue operations])",
              e.op, e.seq, row.name, 1e-6 * static_cast<double>(now - e.start_us),
              1e-6 * static_cast<double>(row.timeout_us));
          break;
        }
      }
      if (!stuck.empty()) {
        overdue_reported_ = true;
        dump(stuck);
        continue;
      }
    }
    const int64_t touched = mtime_us(request);
    if (touched > last_request) {
      last_request = touched;
      dump("requested: " + request + " was touched");
      continue;
    }
    bool dumped = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      dumped = dumped_;
    }
    if (dumped) continue;
    for (int rank : records_since(options_.dir, since)) {
      if (rank == world_rank_) continue;
      dump(fmt::format("rank {} wrote its record", rank));
      break;
    }
  }
}

}  // namespace comm
}  // namespace tessera
