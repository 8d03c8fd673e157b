#pragma once
// A decorator for a group whose ranks sit on several hosts: all_reduce of a
// large tensor goes inside each host first and across hosts once.
//
// Note [Reductions inside a host first]
// A flat all-reduce of n bytes over a group of H hosts with L ranks each
// leaves the pairs that talk to Open MPI's algorithm: its non-blocking one
// (the polled path of Note [Timeouts]) takes a binomial tree for in-place
// reductions, reducing towards one rank and broadcasting back, so whole
// tensors cross the slow links, one direction at a time. Here instead:
//   1. reduce-scatter inside the host: each rank holds n/L reduced over its host;
//   2. a ring across hosts among the ranks with the same local index (one
//      rank per host; Note [A ring across hosts]): its reduce-scatter and
//      all-gather halves each send (H-1)/H · n/L per rank, so 2(H-1)/H · n
//      bytes leave each host in all (the ring's optimum), both directions
//      of a link busy at once;
//   3. all-gather inside the host.
// Steps 1 and 3 use the links inside a host (shared memory), step 2 the
// slow ones. Tensors under kMinElements stay flat: their time is latency,
// which more steps would multiply. The averaged reduction averages inside a
// host, then across hosts: the mean of equal-sized means. Every other
// operation, and splits, go to the inner communicator unchanged.
#include "tessera/comm/communicator.h"

#include <memory>

namespace tessera {
namespace comm {

class HierarchicalCommunicator : public Communicator {
 public:
  static constexpr int64_t kMinElements = 1 << 14;

  // Collective over `inner`: `host` is this rank's host index (numbered
  // alike on every rank). Returns `inner` itself unless the group spans
  // more than one host with the same number (> 1) of its ranks on each,
  // ranks of one host contiguous or not.
  static CommunicatorPtr wrap(CommunicatorPtr inner, int host);

  const CommunicatorPtr& inner() const { return inner_; }
  // Ranks of this host in the group, and the ranks with this local index
  // across hosts (named "<name>.host" and "<name>.cross" in traces).
  const CommunicatorPtr& host_group() const { return host_; }
  const CommunicatorPtr& cross_group() const { return cross_; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  std::string backend() const override { return "hierarchical(" + inner_->backend() + ")"; }

  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {}) override;
  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options = {}) override {
    return inner_->broadcast(tensor, options);
  }
  WorkPtr reduce(at::Tensor& tensor, const ReduceOptions& options = {}) override {
    return inner_->reduce(tensor, options);
  }
  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options = {}) override {
    return inner_->all_gather(output, input, options);
  }
  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options = {}) override {
    return inner_->reduce_scatter(output, input, options);
  }
  WorkPtr all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options = {}) override {
    return inner_->all_to_all(output, input, options);
  }
  WorkPtr send(const at::Tensor& tensor, int dst, const SendOptions& options = {}) override {
    return inner_->send(tensor, dst, options);
  }
  WorkPtr recv(at::Tensor& tensor, int src, const RecvOptions& options = {}) override {
    return inner_->recv(tensor, src, options);
  }
  WorkPtr barrier(const BarrierOptions& options = {}) override { return inner_->barrier(options); }
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops) override { return inner_->batch_isend_irecv(ops); }
  bool sends_wait_for_receiver() const override { return inner_->sends_wait_for_receiver(); }
  CommunicatorPtr control() override { return inner_->control(); }
  CommunicatorPtr split(int color, int key, const std::string& name) override {
    return inner_->split(color, key, name);
  }

 private:
  HierarchicalCommunicator(CommunicatorPtr inner, CommunicatorPtr host, CommunicatorPtr cross);

  CommunicatorPtr inner_;
  CommunicatorPtr host_;
  CommunicatorPtr cross_;
  // The last reduction issued; the next starts after it (Note [One
  // reduction at a time] in the source). Dropped works have completed.
  std::weak_ptr<Work> last_;
};

}  // namespace comm
}  // namespace tessera
