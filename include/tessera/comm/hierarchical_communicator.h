#pragma once
// A decorator for a group whose ranks sit on several hosts: all_reduce,
// reduce_scatter and all_gather of a large tensor go inside each host and
// across hosts once.
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
// host, then across hosts: the mean of equal-sized means.
//
// Note [Scatters and gathers by host]
// ZeRO's reduce-scatter and all-gather (chunk c per rank, n = H·L·c) cross
// the hosts once too, each rank sending (H-1)·c, so (H-1)/H · n bytes leave
// a host, as for a flat ring but without relying on MPI's choice of
// algorithm (a flat reduce-scatter plus all-gather of 3.4 MB sent 10 MB out
// of each of 2 hosts of 4 ranks):
//   reduce-scatter: reorder the input to [local index][host] (its chunk for
//   group rank g(h, l) to place l·H + h), reduce-scatter inside the host (a
//   rank gets the host's sum of the H chunks of the ranks with its local
//   index), then a ring reduce-scatter across hosts leaves it its own chunk;
//   all-gather: a ring all-gather across hosts first (the H chunks of the
//   ranks with this local index: c per rank crosses, not L·c), then an
//   all-gather inside the host, and the reverse reordering.
// They are staged at any size: ZeRO issues them once per unit (layer), so
// the extra stages' latency is paid a few times a step, and a ring of H - 1
// steps across hosts is no slower than a flat collective's steps over all
// ranks; the planner then routes every one of them (Note [Reductions across
// nodes in the plan]) without knowing the units' sizes.
// Every other operation goes to the inner communicator unchanged.
//
// Note [Stages advanced beside the caller]
// A staged operation moves to its next stage only when somebody looks:
// its caller's wait() or is_completed() (ShardedModule polls its buckets in
// each gradient hook). Between two looks a stage that has completed waits,
// and with it the later reductions' stages on its lane (Note [Reductions
// in bucket order per link] in the source): MPI moves the bytes of a
// posted stage (with a progress thread, Note [A progress thread]), but
// nobody posts the next one. So a hierarchical group and its splits get a
// stage driver: a thread that, while any of their staged operations is
// pending, looks every N µs and posts the next stage itself (its MPI_Test
// also runs MPI's progress engine), and sleeps otherwise. N is TESSERA_PROGRESS_US (the
// progress thread's switch; 0 turns both off), 200 µs when that is unset:
// the driver costs nothing while no reduction by host is pending, unlike
// the progress thread, which stays opt-in. Every advance, the
// caller's or the driver's, holds the group's mutex, so each of the
// group's communicators still sees one order of operations, the same on
// every rank; the host and cross communicators carry nothing but the
// stages, so the caller's own operations on other communicators never meet
// the driver's on one. The driver never waits for the mutex (the caller
// may hold it in a blocking wait) and never blocks in MPI; timeouts stay
// with the caller's wait. It needs MPI_THREAD_MULTIPLE, as the progress
// thread does.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace tessera {
namespace comm {
namespace detail {
class StageDriver;
struct Stage;
}  // namespace detail

class HierarchicalCommunicator : public Communicator {
 public:
  static constexpr int64_t kMinElements = 1 << 14;

  // Collective over `inner`: `host` is this rank's host index (numbered
  // alike on every rank). Returns `inner` itself unless the group spans
  // more than one host with the same number (> 1) of its ranks on each,
  // ranks of one host contiguous or not.
  // `drive` > 0 starts a stage driver polling every `drive` (Note [Stages
  // advanced beside the caller]); the first form takes it from
  // TESSERA_PROGRESS_US (0: none), or kDefaultDrive when that is unset and
  // MPI runs with MPI_THREAD_MULTIPLE. Splits share the group's driver.
  static constexpr std::chrono::microseconds kDefaultDrive{200};
  static CommunicatorPtr wrap(CommunicatorPtr inner, int host);
  static CommunicatorPtr wrap(CommunicatorPtr inner, int host, std::chrono::microseconds drive);
  // Polls the group's stage driver has made; -1 without a driver (tests).
  int64_t driver_polls() const;

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
  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options = {}) override;
  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                         const ReduceScatterOptions& options = {}) override;
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
  bool issue_waits_for_group() const override { return inner_->issue_waits_for_group(); }
  CommunicatorPtr control() override { return inner_->control(); }
  // A sub-group that spans hosts evenly is hierarchical too (ZeRO's shard
  // levels of the data group); others are the inner communicator's split.
  CommunicatorPtr split(int color, int key, const std::string& name) override;

 private:
  HierarchicalCommunicator(CommunicatorPtr inner, CommunicatorPtr host, CommunicatorPtr host_gather,
                           CommunicatorPtr cross, at::Tensor by_local_index, int host_id);
  static CommunicatorPtr wrap_with(CommunicatorPtr inner, int host, std::shared_ptr<detail::StageDriver> driver);
  // Runs the stages in order with the group's earlier staged operations
  // (Note [Reductions in bucket order per link] in the source).
  WorkPtr submit(std::vector<detail::Stage> stages, bool async);

  CommunicatorPtr inner_;
  CommunicatorPtr host_;         // reduce-scatters inside the host
  CommunicatorPtr host_gather_;  // all-gathers inside the host: the same ranks
  CommunicatorPtr cross_;
  // Group ranks in [local index][host] order: entry l·H + h is the rank
  // with local index l on host h (Note [Scatters and gathers by host]).
  at::Tensor by_local_index_;
  int host_id_;  // wrap's `host`, for splits
  // The last reduction issued; the next follows it (Note [Reductions in
  // bucket order per link] in the source). Dropped works have completed.
  std::weak_ptr<Work> last_;
  // Held by every advance of this group's stages; null driver: none.
  std::shared_ptr<std::mutex> stage_mutex_ = std::make_shared<std::mutex>();
  std::shared_ptr<detail::StageDriver> driver_;
};

}  // namespace comm
}  // namespace tessera
