#pragma once
// MPI backend: CPU tensors directly; CUDA tensors directly when the MPI is
// CUDA-aware, otherwise staged through host memory (see
// docs/communicator.md). Synchronous calls use MPI's blocking collectives
// (its tuned algorithms); asynchronous calls use the nonblocking ones
// (MPI_Iallreduce, ...) and return a Work that owns the MPI requests.
#include "tessera/comm/communicator.h"

#include <mpi.h>

#include <memory>
#include <string>

namespace tessera {
namespace comm {

class MpiTypes;  // bfloat16/float16 datatypes and reduction ops (src/comm)

class MpiCommunicator : public Communicator, public std::enable_shared_from_this<MpiCommunicator> {
 public:
  // A communicator over a duplicate of `comm`, so tessera's traffic never
  // matches the caller's own messages. Needs MPI initialized (MpiRuntime).
  static std::shared_ptr<MpiCommunicator> create(MPI_Comm comm, const std::string& name);
  static std::shared_ptr<MpiCommunicator> world() { return create(MPI_COMM_WORLD, "world"); }

  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  std::string backend() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }
  bool cuda_aware() const { return cuda_aware_; }

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
  CommunicatorPtr split(int color, int key, const std::string& name) override;

 private:
  MpiCommunicator(MPI_Comm comm, std::string name, std::shared_ptr<MpiTypes> types);

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  std::shared_ptr<MpiTypes> types_;
  int rank_ = 0;
  int size_ = 1;
  bool cuda_aware_ = false;
};

}  // namespace comm
}  // namespace tessera
