#pragma once
// NCCL backend of the communicator interface (see docs/nccl-backend.md).
//
// CUDA tensors only, all on the one device given at creation. Every operation
// runs on a communication stream owned by the communicator and is ordered
// after the work already queued on the calling thread's current stream of
// that device; Work::wait() orders the current stream after the operation
// without blocking the host (Note [Work semantics] in communicator.h).
//
// <mpi.h> is included for MPI_Comm only; NCCL and CUDA types stay in the .cpp.
#include "tessera/comm/communicator.h"
#include "tessera/comm/flight_recorder.h"

#include <mpi.h>

#include <chrono>
#include <memory>
#include <string>

namespace tessera {
class FaultInjector;
namespace comm {

namespace detail {
struct NcclState;
class AbortState;
}  // namespace detail

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap`: duplicates it (the duplicate is kept for
  // split()), broadcasts an NCCL unique id from rank 0 and initialises the
  // NCCL communicator on `cuda_device`. If any rank rejects its device, every
  // rank throws instead of hanging. control() is an MPI communicator over a
  // duplicate of `bootstrap` (Note [Control traffic]). Host-blocking waits
  // (barrier) give up after `timeout` and abort the communicator (Note
  // [Timeouts]); `abort` is shared with the communicators split from this
  // one (null: a new family, recording as `recorder` says, Note [Flight
  // recorder]).
  static std::shared_ptr<NcclCommunicator> create(MPI_Comm bootstrap, int cuda_device, const std::string& name,
                                                  std::chrono::milliseconds timeout = timeout_from_env(),
                                                  std::shared_ptr<detail::AbortState> abort = nullptr,
                                                  const FlightRecorderOptions& recorder = {});

  // Whether this build orders NCCL work against LibTorch's current CUDA
  // stream and tells LibTorch's allocator which stream uses a tensor (a
  // LibTorch with CUDA); false: the legacy default stream, and no CUDA
  // tensor can exist anyway.
  static bool orders_with_torch_streams();

  // Not collective for MPI, but ncclCommDestroy may wait for peers to flush
  // outstanding operations: destroy communicators on all ranks alike.
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  std::string backend() const override { return "nccl"; }
  // The CUDA device index every tensor passed to this communicator must be on.
  int device() const { return device_; }
  // Note [Flight recorder]: shared with this communicator's family.
  std::shared_ptr<FlightRecorder> flight_recorder() const;
  // Note [Fault injection] in core/fault_injection.h: null without TESSERA_FAULT.
  std::shared_ptr<FaultInjector> fault_injector() const;

  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {}) override;
  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options = {}) override;
  WorkPtr reduce(at::Tensor& tensor, const ReduceOptions& options = {}) override;
  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options = {}) override;
  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options = {}) override;
  WorkPtr all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options = {}) override;
  // Messages between a pair of ranks match in the order the calls are made.
  // An unbatched send holds the communication stream until its receive is
  // posted: a pipeline posts its messages in batches.
  WorkPtr send(const at::Tensor& tensor, int dst, const SendOptions& options = {}) override;
  WorkPtr recv(at::Tensor& tensor, int src, const RecvOptions& options = {}) override;
  // Unlike the other operations, a barrier blocks the host: the synchronous
  // call returns, and wait() on the asynchronous one returns, only after all
  // ranks' barriers (and the GPU work queued before them) have completed.
  WorkPtr barrier(const BarrierOptions& options = {}) override;

  // One NCCL group; a rank may send to itself inside it.
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops) override;
  bool sends_wait_for_receiver() const override { return true; }
  CommunicatorPtr control() override;

  // MPI_Comm_split of the bootstrap communicator, then create() on the child
  // with the same device. Collective over this communicator.
  CommunicatorPtr split(int color, int key, const std::string& name) override;

 private:
  NcclCommunicator(std::unique_ptr<detail::NcclState> state, int rank, int size, int device, std::string name);

  std::unique_ptr<detail::NcclState> state_;
  int rank_;
  int size_;
  int device_;
  std::string name_;
};

}  // namespace comm
}  // namespace tessera
