#pragma once
// Builds the world communicator of a job: the backend for the job's device,
// wrapped in the checking and tracing decorators when asked for.
#include "tessera/comm/communicator.h"
#include "tessera/comm/flight_recorder.h"
#include "tessera/comm/tracing_communicator.h"
#include "tessera/core/fault_injection.h"

#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <string>

namespace tessera {
namespace comm {

enum class Backend { kAuto, kMpi, kNccl };

std::string backend_name(Backend backend);
Backend backend_from_name(const std::string& name);  // "auto", "mpi", "nccl"

struct WorldOptions {
  // kAuto: NCCL for a CUDA device when tessera was built with NCCL, MPI otherwise.
  Backend backend = Backend::kAuto;
  c10::Device device = c10::Device(c10::kCPU);
  // Wraps the world (and so every split) in a CheckedCommunicator. Defaults
  // to TESSERA_CHECK_COLLECTIVES=1 in the environment.
  bool check_collectives = checked_mode_from_env();
  // When set, every communicator records into this trace.
  std::shared_ptr<CommTrace> trace;
  // Note [Timeouts] in communicator.h; 0 waits forever.
  std::chrono::milliseconds timeout = timeout_from_env();
  // Note [Flight recorder]: the last operations of every communicator, and
  // where they are written when something goes wrong.
  FlightRecorderOptions flight_recorder{};

  static bool checked_mode_from_env();
};

// Needs MPI initialized (MpiRuntime) for every backend: NCCL bootstraps over it.
CommunicatorPtr make_world_communicator(const WorldOptions& options = {});

// The flight recorder of `comm`'s family (through the tracing and checking
// decorators), or null for a communicator of another kind.
std::shared_ptr<FlightRecorder> flight_recorder_of(const CommunicatorPtr& comm);
// Its fault injector (Note [Fault injection] in core/fault_injection.h), or
// null without TESSERA_FAULT.
std::shared_ptr<FaultInjector> fault_injector_of(const CommunicatorPtr& comm);

// True when this build of tessera includes the NCCL backend.
bool nccl_available();

}  // namespace comm
}  // namespace tessera
