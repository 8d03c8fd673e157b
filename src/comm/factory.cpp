#include "tessera/comm/factory.h"

#include "tessera/comm/checked_communicator.h"
#include "tessera/comm/hierarchical_communicator.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/config.h"
#ifdef TESSERA_HAVE_NCCL
#include "tessera/comm/nccl_communicator.h"
#endif

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <utility>

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

namespace {

// `get` applied to the backend communicator under the tracing and checking
// decorators; null for a communicator of another kind.
template <typename Get>
auto from_backend(const CommunicatorPtr& comm, const Get& get) -> decltype(get(std::declval<MpiCommunicator&>())) {
  if (!comm) return nullptr;
  if (const auto* traced = dynamic_cast<const TracingCommunicator*>(comm.get()))
    return from_backend(traced->inner(), get);
  if (const auto* checked = dynamic_cast<const CheckedCommunicator*>(comm.get()))
    return from_backend(checked->inner(), get);
  if (const auto* hier = dynamic_cast<const HierarchicalCommunicator*>(comm.get()))
    return from_backend(hier->inner(), get);
  if (auto* mpi = dynamic_cast<MpiCommunicator*>(comm.get())) return get(*mpi);
#ifdef TESSERA_HAVE_NCCL
  if (auto* nccl = dynamic_cast<NcclCommunicator*>(comm.get())) return get(*nccl);
#endif
  return nullptr;
}

}  // namespace

std::shared_ptr<FlightRecorder> flight_recorder_of(const CommunicatorPtr& comm) {
  return from_backend(comm, [](const auto& backend) { return backend.flight_recorder(); });
}

std::shared_ptr<FaultInjector> fault_injector_of(const CommunicatorPtr& comm) {
  return from_backend(comm, [](const auto& backend) { return backend.fault_injector(); });
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
