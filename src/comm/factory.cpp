#include "tessera/comm/factory.h"

#include "tessera/comm/checked_communicator.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/config.h"
#ifdef TESSERA_HAVE_NCCL
#include "tessera/comm/nccl_communicator.h"
#endif

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace tessera {
namespace comm {

std::string backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kMpi:
      return "mpi";
    case Backend::kNccl:
      return "nccl";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled Backend");
}

Backend backend_from_name(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "mpi") return Backend::kMpi;
  if (name == "nccl") return Backend::kNccl;
  TORCH_CHECK(false, "unknown communicator backend '", name, "'; accepted: auto, mpi, nccl");
}

bool WorldOptions::checked_mode_from_env() {
  const char* value = std::getenv("TESSERA_CHECK_COLLECTIVES");
  return value != nullptr && std::strcmp(value, "0") != 0 && std::strcmp(value, "") != 0;
}

bool nccl_available() {
#ifdef TESSERA_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

std::shared_ptr<FlightRecorder> flight_recorder_of(const CommunicatorPtr& comm) {
  if (!comm) return nullptr;
  if (const auto* traced = dynamic_cast<const TracingCommunicator*>(comm.get()))
    return flight_recorder_of(traced->inner());
  if (const auto* checked = dynamic_cast<const CheckedCommunicator*>(comm.get()))
    return flight_recorder_of(checked->inner());
  if (const auto* mpi = dynamic_cast<const MpiCommunicator*>(comm.get())) return mpi->flight_recorder();
#ifdef TESSERA_HAVE_NCCL
  if (const auto* nccl = dynamic_cast<const NcclCommunicator*>(comm.get())) return nccl->flight_recorder();
#endif
  return nullptr;
}

CommunicatorPtr make_world_communicator(const WorldOptions& options) {
  Backend backend = options.backend;
  if (backend == Backend::kAuto)
    backend = options.device.is_cuda() && nccl_available() ? Backend::kNccl : Backend::kMpi;
  CommunicatorPtr world;
  if (backend == Backend::kNccl) {
    TORCH_CHECK(options.device.is_cuda(), "the nccl backend needs a CUDA device, got ", options.device.str());
#ifdef TESSERA_HAVE_NCCL
    world = NcclCommunicator::create(MPI_COMM_WORLD, options.device.index() < 0 ? 0 : options.device.index(), "world",
                                     options.timeout, nullptr, options.flight_recorder);
#else
    TORCH_CHECK(false,
                "this build of tessera has no NCCL backend (configure with TESSERA_WITH_NCCL=ON and a CUDA "
                "toolkit with nccl.h); use the mpi backend");
#endif
  } else {
    MpiOptions mpi;
    mpi.timeout = options.timeout;
    mpi.flight_recorder = options.flight_recorder;
    world = MpiCommunicator::world(mpi);
  }
  if (options.check_collectives) world = std::make_shared<CheckedCommunicator>(world);
  if (options.trace) world = std::make_shared<TracingCommunicator>(world, options.trace);
  return world;
}

}  // namespace comm
}  // namespace tessera
