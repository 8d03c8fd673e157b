#pragma once
// A decorator that, before every collective, verifies that all ranks of the
// communicator are calling the same operation with the same dtype, root and
// compatible sizes, and throws on every rank with a message naming the
// operation, the ranks and the shapes that differ, instead of hanging or
// corrupting memory. Point-to-point calls check that sender and receiver
// agree on dtype and size.
//
// Turned on for a whole job by TESSERA_CHECK_COLLECTIVES=1 (see
// make_communicator in comm/factory.h). It costs one small all_gather per
// collective, so it is for debugging, not for production runs.
#include "tessera/comm/communicator.h"

#include <c10/core/Device.h>

#include <functional>

namespace tessera {
namespace comm {

class CheckedCommunicator : public Communicator {
 public:
  // Descriptors are exchanged as int64 tensors on `check_device`, which must
  // be a device the inner backend accepts (CPU for MPI, the GPU for NCCL).
  CheckedCommunicator(CommunicatorPtr inner, c10::Device check_device);

  const CommunicatorPtr& inner() const { return inner_; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  std::string backend() const override { return "checked(" + inner_->backend() + ")"; }

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
  struct Call;
  // Validates this rank's arguments, exchanges descriptors, throws on any
  // disagreement (Note [Checked argument errors]).
  void check_collective(Call call, const std::function<void()>& validate);

  CommunicatorPtr inner_;
  c10::Device check_device_;
};

}  // namespace comm
}  // namespace tessera
