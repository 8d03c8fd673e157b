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

#include <functional>
#include <memory>

namespace tessera {
namespace comm {

class CheckedCommunicator : public Communicator, public std::enable_shared_from_this<CheckedCommunicator> {
 public:
  // Descriptors are exchanged as int64 CPU tensors over inner->control()
  // (Note [Control traffic]); the control channel is checked too.
  explicit CheckedCommunicator(CommunicatorPtr inner);

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
  // Each send's descriptor goes ahead of the batch; each receive checks it.
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops) override;
  bool sends_wait_for_receiver() const override { return inner_->sends_wait_for_receiver(); }
  bool issue_waits_for_group() const override { return true; }  // the comparison of the calls
  CommunicatorPtr control() override;
  CommunicatorPtr split(int color, int key, const std::string& name) override;

 private:
  struct Call;
  // Validates this rank's arguments, exchanges descriptors, throws on any
  // disagreement (Note [Checked argument errors]).
  void check_collective(Call call, const std::function<void()>& validate);

  CommunicatorPtr inner_;
  CommunicatorPtr channel_;  // inner_->control(): where descriptors travel
  std::shared_ptr<CheckedCommunicator> control_;  // null when inner_ is its own control channel
};

}  // namespace comm
}  // namespace tessera
