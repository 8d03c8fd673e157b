#pragma once
// Faults injected on purpose, for tests of what a job does when one rank
// dies, stops, hangs, slows down or fails a write (docs/reliability.md).
//
// Note [Fault injection]
// TESSERA_FAULT holds a comma-separated list of faults, each
//   RANK:STEP:KIND[:ARG][@save]
// RANK is a world rank; STEP the training step (from 1) the fault fires in;
// with @save it fires instead in the checkpoint save that follows step STEP.
// Kinds:
//   kill           SIGKILL to this process
//   stop           SIGSTOP to this process (it stays, stopped)
//   hang:OP        the first OP issued from then on ("all_reduce", "send",
//                  "batch_isend_irecv", ...) is recorded as issued and never
//                  returns
//   slow:F         from then on, each step's compute takes F times as long
//                  (the host sleeps (F - 1) times its compute)
//   throw          throws InjectedFault
//   crash_file     SIGKILL halfway through writing this rank's checkpoint file
//   crash_index    SIGKILL halfway through writing the checkpoint's index
//   disk_full      this rank's checkpoint file write fails as on a full disk
// The last three happen in a save, so they need no @save. The world
// communicator's family owns the injector (comm::fault_injector_of); the
// trainer says when a step begins and the checkpoint writer when a save
// does, and every operation of the family passes before_op. Without
// TESSERA_FAULT there is no injector and each of those hooks is a null
// check.
#include "tessera/core/atomic_file.h"  // WriteHook

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessera {

enum class FaultKind { kKill, kStop, kHang, kSlow, kThrow, kCrashFile, kCrashIndex, kDiskFull };

struct Fault {
  int rank = 0;
  int64_t step = 1;
  FaultKind kind = FaultKind::kThrow;
  std::string op;        // hang: the operation's name
  double factor = 1;     // slow
  bool at_save = false;  // in the save after `step` rather than in the step
};

std::string fault_kind_name(FaultKind kind);
// "2:3:hang:all_reduce". parse_faults(describe(f)) gives f back.
std::string describe(const Fault& fault);

// Parses Note [Fault injection]'s syntax; throws naming the item, the rule
// it broke and an example. An empty string is no fault.
std::vector<Fault> parse_faults(const std::string& spec);

// What the throw kind throws.
class InjectedFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class FaultInjector {
 public:
  // The faults of world rank `world_rank` out of `faults`; each is checked
  // against `world_size`.
  FaultInjector(const std::vector<Fault>& faults, int world_rank, int world_size);
  // From TESSERA_FAULT; null when it is unset or empty.
  static std::shared_ptr<FaultInjector> from_env(int world_rank, int world_size);

  // Step `step` (from 1) begins: fires kill, stop and throw; arms hang and slow.
  void begin_step(int64_t step);
  // The step's compute took `seconds` so far: sleeps (F - 1) times that
  // under an armed slow fault.
  void slow_down(double seconds);
  // A checkpoint save begins (after the step last begun): fires kill, stop
  // and throw @save; arms hang @save and the file kinds until end_save().
  void begin_save();
  void end_save();
  // Before operation `op` is issued: never returns under an armed hang for it.
  void before_op(const char* op);
  // The hook for this rank's checkpoint file (crash_file, disk_full) or the
  // index (crash_index); null when neither is armed.
  WriteHook file_hook() const;
  WriteHook index_hook() const;

  int64_t step() const { return step_.load(std::memory_order_relaxed); }
  const std::vector<Fault>& faults() const { return faults_; }

 private:
  // Fires `f` now (kill, stop, throw, crash_*), saying so on stderr first;
  // returns only from stop, once the process is continued.
  void fire(const Fault& f, const std::string& where) const;
  void announce(const Fault& f, const std::string& where) const;

  std::vector<Fault> faults_;  // this rank's
  int world_rank_;
  std::atomic<int64_t> step_{0};
  std::atomic<bool> saving_{false};
  mutable std::mutex mutex_;
  std::vector<const Fault*> hangs_;  // armed
  double slow_factor_ = 1;
};

}  // namespace tessera
