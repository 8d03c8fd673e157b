#pragma once
// MPI backend: CPU tensors directly; CUDA tensors directly when the MPI is
// CUDA-aware, otherwise staged through host memory (see
// docs/communicator.md). Synchronous calls use MPI's blocking collectives
// (its tuned algorithms); asynchronous calls use the nonblocking ones
// (MPI_Iallreduce, ...) and return a Work that owns the MPI requests.
#include "tessera/comm/communicator.h"
#include "tessera/comm/flight_recorder.h"

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
class FaultInjector;
namespace comm {

class MpiTypes;  // bfloat16/float16 datatypes and reduction ops (src/comm)
namespace detail {
class AbortState;
struct CommInfo;
struct OpInfo;
}  // namespace detail

namespace detail {
class ProgressThread;
}  // namespace detail

struct MpiOptions {
  // Note [Timeouts]. With a timeout, synchronous calls are issued as the
  // nonblocking ones and polled; with none (0), MPI's blocking calls run.
  std::chrono::milliseconds timeout = timeout_from_env();
  // Test mode (TESSERA_MPI_SYNC_SENDS=1): every send blocks the host until
  // its receive is posted (MPI_Ssend; MPI_Issend inside a batch), as an
  // unbatched NCCL send blocks its stream, so that code which would deadlock
  // on NCCL deadlocks here too (and times out with a message).
  bool synchronous_sends = synchronous_sends_from_env();
  // Shared with the communicators this one belongs with (the NCCL backend
  // passes its own); null: a new family, recording as flight_recorder says.
  std::shared_ptr<detail::AbortState> abort;
  // Note [Flight recorder]; used only when a new family is made.
  FlightRecorderOptions flight_recorder{};
  // Note [A progress thread] (src/comm/progress_thread.h): when > 0, a new
  // family runs a thread that moves MPI's pending operations every so
  // often. TESSERA_PROGRESS_US (unset or 0: none).
  std::chrono::microseconds progress = progress_from_env();
  // The family's thread, shared like `abort`; made by create().
  std::shared_ptr<detail::ProgressThread> progress_thread;

  static bool synchronous_sends_from_env();
  // Throws, naming the value, unless it is a whole number of microseconds.
  static std::chrono::microseconds progress_from_env();
};

class MpiCommunicator : public Communicator, public std::enable_shared_from_this<MpiCommunicator> {
 public:
  // A communicator over a duplicate of `comm`, so tessera's traffic never
  // matches the caller's own messages. Needs MPI initialized (MpiRuntime).
  // Collective over `comm` (it also duplicates the control channel).
  static std::shared_ptr<MpiCommunicator> create(MPI_Comm comm, const std::string& name,
                                                 const MpiOptions& options = {});
  static std::shared_ptr<MpiCommunicator> world(const MpiOptions& options = {}) {
    return create(MPI_COMM_WORLD, "world", options);
  }

  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  std::string backend() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }
  bool cuda_aware() const { return cuda_aware_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  // Note [Flight recorder]: shared with this communicator's family.
  std::shared_ptr<FlightRecorder> flight_recorder() const;
  // Note [Fault injection] in core/fault_injection.h: null without TESSERA_FAULT.
  std::shared_ptr<FaultInjector> fault_injector() const;
  // Probes the family's progress thread has made; -1 without one.
  int64_t progress_probes() const;

  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {}) override;
  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options = {}) override;
  WorkPtr reduce(at::Tensor& tensor, const ReduceOptions& options = {}) override;
  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options = {}) override;
  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options = {}) override;
  WorkPtr all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options = {}) override;
  WorkPtr send(const at::Tensor& tensor, int dst, const SendOptions& options = {}) override;
  WorkPtr recv(at::Tensor& tensor, int src, const RecvOptions& options = {}) override;
  WorkPtr barrier(const BarrierOptions& options = {}) override;
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops) override;
  bool sends_wait_for_receiver() const override { return options_.synchronous_sends; }
  CommunicatorPtr control() override;
  CommunicatorPtr split(int color, int key, const std::string& name) override;

 private:
  // Takes ownership of `comm`; with_control: also duplicates it into the
  // control channel (collective).
  MpiCommunicator(MPI_Comm comm, std::string name, std::shared_ptr<MpiTypes> types, MpiOptions options,
                  bool with_control);
  // Numbers and records the next operation of `bytes` of `dtype` (a static
  // string) and says who it waits for (empty: all), after refusing it if the
  // family was aborted.
  detail::OpInfo begin(const char* op, int64_t bytes, const char* dtype, std::vector<int> peers = {});
  // The same for an operation on `tensor` (undefined: no data).
  detail::OpInfo begin(const char* op, const at::Tensor& tensor, std::vector<int> peers = {});

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  std::shared_ptr<MpiTypes> types_;
  MpiOptions options_;
  std::shared_ptr<const detail::CommInfo> info_;
  std::shared_ptr<MpiCommunicator> control_;  // null on a control channel
  int rank_ = 0;
  int size_ = 1;
  int64_t seq_ = 0;
  bool cuda_aware_ = false;
};

}  // namespace comm
}  // namespace tessera
