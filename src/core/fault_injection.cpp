#include "tessera/core/fault_injection.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <thread>

namespace tessera {
namespace {

constexpr const char* kSyntax =
    "TESSERA_FAULT items are RANK:STEP:KIND[:ARG][@save], KIND one of kill, stop, hang:OP, slow:F, throw, "
    "crash_file, crash_index, disk_full (e.g. 2:3:hang:all_reduce,1:4:kill@save)";

bool parse_int(const std::string& text, int64_t* value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  *value = v;
  return true;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!text.empty() && text.back() == sep) parts.emplace_back();
  return parts;
}

Fault parse_one(const std::string& item) {
  Fault f;
  std::string body = item;
  const size_t at = body.find('@');
  if (at != std::string::npos) {
    TORCH_CHECK(body.substr(at) == "@save", "TESSERA_FAULT item '", item, "': '", body.substr(at),
                "' is not a place; the only one is @save. ", kSyntax);
    f.at_save = true;
    body = body.substr(0, at);
  }
  const auto parts = split(body, ':');
  TORCH_CHECK(parts.size() >= 3 && parts.size() <= 4, "TESSERA_FAULT item '", item, "' has ", parts.size(),
              " fields where 3 or 4 are needed. ", kSyntax);
  int64_t rank = 0;
  TORCH_CHECK(parse_int(parts[0], &rank) && rank >= 0 && rank <= (1 << 30), "TESSERA_FAULT item '", item, "': rank '",
              parts[0], "' is not a world rank (an integer from 0). ", kSyntax);
  f.rank = static_cast<int>(rank);
  TORCH_CHECK(parse_int(parts[1], &f.step) && f.step >= 1, "TESSERA_FAULT item '", item, "': step '", parts[1],
              "' is not a training step (an integer from 1). ", kSyntax);
  const std::string& kind = parts[2];
  const std::string arg = parts.size() == 4 ? parts[3] : "";
  static const std::pair<const char*, FaultKind> kinds[] = {{"kill", FaultKind::kKill},
                                                            {"stop", FaultKind::kStop},
                                                            {"hang", FaultKind::kHang},
                                                            {"slow", FaultKind::kSlow},
                                                            {"throw", FaultKind::kThrow},
                                                            {"crash_file", FaultKind::kCrashFile},
                                                            {"crash_index", FaultKind::kCrashIndex},
                                                            {"disk_full", FaultKind::kDiskFull}};
  bool known = false;
  for (const auto& [name, k] : kinds)
    if (kind == name) {
      f.kind = k;
      known = true;
    }
  TORCH_CHECK(known, "TESSERA_FAULT item '", item, "': '", kind, "' is not a fault kind. ", kSyntax);
  const bool takes_arg = f.kind == FaultKind::kHang || f.kind == FaultKind::kSlow;
  TORCH_CHECK(takes_arg == (parts.size() == 4), "TESSERA_FAULT item '", item, "': ", kind,
              takes_arg ? " needs an argument (hang:OP, slow:F)" : " takes no argument", ". ", kSyntax);
  if (f.kind == FaultKind::kHang) {
    TORCH_CHECK(!arg.empty() && arg.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") == std::string::npos,
                "TESSERA_FAULT item '", item, "': '", arg,
                "' is not an operation name (all_reduce, all_gather, broadcast, send, batch_isend_irecv, ...). ",
                kSyntax);
    f.op = arg;
  }
  if (f.kind == FaultKind::kSlow) {
    char* end = nullptr;
    f.factor = std::strtod(arg.c_str(), &end);
    TORCH_CHECK(!arg.empty() && end == arg.c_str() + arg.size() && f.factor >= 1 && f.factor <= 1000,
                "TESSERA_FAULT item '", item, "': slow factor '", arg, "' must be a number from 1 to 1000. ", kSyntax);
  }
  const bool in_save =
      f.kind == FaultKind::kCrashFile || f.kind == FaultKind::kCrashIndex || f.kind == FaultKind::kDiskFull;
  TORCH_CHECK(!(in_save && f.at_save), "TESSERA_FAULT item '", item, "': ", kind,
              " always happens in a save; drop the @save. ", kSyntax);
  f.at_save = f.at_save || in_save;
  return f;
}

}  // namespace

std::string fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kKill:
      return "kill";
    case FaultKind::kStop:
      return "stop";
    case FaultKind::kHang:
      return "hang";
    case FaultKind::kSlow:
      return "slow";
    case FaultKind::kThrow:
      return "throw";
    case FaultKind::kCrashFile:
      return "crash_file";
    case FaultKind::kCrashIndex:
      return "crash_index";
    case FaultKind::kDiskFull:
      return "disk_full";
  }
  return "?";
}

std::string describe(const Fault& f) {
  std::string out = fmt::format("{}:{}:{}", f.rank, f.step, fault_kind_name(f.kind));
  if (f.kind == FaultKind::kHang) out += ":" + f.op;
  if (f.kind == FaultKind::kSlow) out += fmt::format(":{:g}", f.factor);
  const bool in_save =
      f.kind == FaultKind::kCrashFile || f.kind == FaultKind::kCrashIndex || f.kind == FaultKind::kDiskFull;
  if (f.at_save && !in_save) out += "@save";
  return out;
}

std::vector<Fault> parse_faults(const std::string& spec) {
  std::vector<Fault> faults;
  if (spec.empty()) return faults;
  for (const auto& item : split(spec, ',')) {
    TORCH_CHECK(!item.empty(), "TESSERA_FAULT '", spec, "' has an empty item. ", kSyntax);
    faults.push_back(parse_one(item));
  }
  return faults;
}

FaultInjector::FaultInjector(const std::vector<Fault>& faults, int world_rank, int world_size)
    : world_rank_(world_rank) {
  for (const auto& f : faults) {
    TORCH_CHECK(f.rank < world_size, "TESSERA_FAULT item '", describe(f), "': rank ", f.rank,
                " is not a world rank of this job (world size ", world_size, ")");
    if (f.rank == world_rank) faults_.push_back(f);
  }
}

std::shared_ptr<FaultInjector> FaultInjector::from_env(int world_rank, int world_size) {
  const char* spec = std::getenv("TESSERA_FAULT");
  if (spec == nullptr || *spec == '\0') return nullptr;
  return std::make_shared<FaultInjector>(parse_faults(spec), world_rank, world_size);
}

void FaultInjector::announce(const Fault& f, const std::string& where) const {
  // One write, flushed: the process may die right after it.
  std::cerr << fmt::format("tessera: world rank {}: injected fault {} (TESSERA_FAULT) {}\n", world_rank_, describe(f),
                           where)
            << std::flush;
}

void FaultInjector::fire(const Fault& f, const std::string& where) const {
  announce(f, where);
  switch (f.kind) {
    case FaultKind::kKill:
    case FaultKind::kCrashFile:
    case FaultKind::kCrashIndex:
      std::raise(SIGKILL);
      break;
    case FaultKind::kStop:
      std::raise(SIGSTOP);
      return;
    case FaultKind::kThrow:
      throw InjectedFault(
          fmt::format("world rank {}: injected fault {} (TESSERA_FAULT) {}", world_rank_, describe(f), where));
    default:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "fault ", describe(f), " cannot fire");
}

void FaultInjector::begin_step(int64_t step) {
  step_.store(step, std::memory_order_relaxed);
  for (const auto& f : faults_) {
    if (f.step != step || f.at_save) continue;
    if (f.kind == FaultKind::kHang) {
      std::lock_guard<std::mutex> lock(mutex_);
      hangs_.push_back(&f);
      announce(f, fmt::format("armed at the start of step {}", step));
    } else if (f.kind == FaultKind::kSlow) {
      std::lock_guard<std::mutex> lock(mutex_);
      slow_factor_ = f.factor;
      announce(f, fmt::format("from step {} on", step));
    } else {
      fire(f, fmt::format("at the start of step {}", step));
    }
  }
}

void FaultInjector::slow_down(double seconds) {
  double factor = 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    factor = slow_factor_;
  }
  if (factor > 1 && seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>((factor - 1) * seconds));
}

void FaultInjector::begin_save() {
  const int64_t step = step_.load(std::memory_order_relaxed);
  saving_.store(true, std::memory_order_relaxed);
  for (const auto& f : faults_) {
    if (f.step != step || !f.at_save) continue;
    if (f.kind == FaultKind::kHang) {
      std::lock_guard<std::mutex> lock(mutex_);
      hangs_.push_back(&f);
      announce(f, fmt::format("armed in the checkpoint save after step {}", step));
    } else if (f.kind == FaultKind::kSlow) {
      std::lock_guard<std::mutex> lock(mutex_);
      slow_factor_ = f.factor;
      announce(f, fmt::format("from the save after step {} on", step));
    } else if (f.kind == FaultKind::kKill || f.kind == FaultKind::kStop || f.kind == FaultKind::kThrow) {
      fire(f, fmt::format("at the start of the checkpoint save after step {}", step));
    }
  }
}

void FaultInjector::end_save() {
  saving_.store(false, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  hangs_.erase(std::remove_if(hangs_.begin(), hangs_.end(), [](const Fault* f) { return f->at_save; }), hangs_.end());
}

void FaultInjector::before_op(const char* op) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Fault* hang = nullptr;
    for (const Fault* f : hangs_)
      if (f->op == op) hang = f;
    if (hang == nullptr) return;
    announce(*hang, fmt::format("hangs in {} now, in step {}", op, step_.load(std::memory_order_relaxed)));
  }
  // A rank stuck inside the operation: only a signal ends it.
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

WriteHook FaultInjector::file_hook() const {
  if (!saving_.load(std::memory_order_relaxed)) return nullptr;
  const int64_t step = step_.load(std::memory_order_relaxed);
  for (const auto& f : faults_) {
    if (f.step != step) continue;
    if (f.kind == FaultKind::kCrashFile) {
      return [this, &f](std::ostream&, int64_t written, int64_t total) {
        if (2 * written >= total) fire(f, fmt::format("after {} of {} bytes of its checkpoint file", written, total));
      };
    }
    if (f.kind == FaultKind::kDiskFull) {
      return [this, &f](std::ostream& out, int64_t written, int64_t total) {
        if (2 * written < total || out.fail()) return;
        announce(f, fmt::format("fails its checkpoint file's write after {} of {} bytes", written, total));
        out.setstate(std::ios::badbit);  // as a write to a full disk leaves the stream
      };
    }
  }
  return nullptr;
}

WriteHook FaultInjector::index_hook() const {
  if (!saving_.load(std::memory_order_relaxed)) return nullptr;
  const int64_t step = step_.load(std::memory_order_relaxed);
  for (const auto& f : faults_) {
    if (f.step == step && f.kind == FaultKind::kCrashIndex) {
      return [this, &f](std::ostream&, int64_t written, int64_t total) {
        if (2 * written >= total) fire(f, fmt::format("after {} of {} bytes of the checkpoint index", written, total));
      };
    }
  }
  return nullptr;
}

}  // namespace tessera
