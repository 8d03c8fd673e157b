#pragma once
// A decorator that counts calls and bytes per (communicator name, operation).
// Communicators split from a traced one are traced into the same CommTrace,
// so one trace sees every group of a ParallelContext.
//
// Note [Trace byte counts]
// `bytes` follows nccl-tests' "size": the tensor for all_reduce, broadcast,
// reduce, send and recv; the (full) output for all_gather; the (full) input
// for reduce_scatter and all_to_all. `bus_bytes` is what this rank puts on the
// wire with a bandwidth-optimal algorithm: all_reduce 2(n-1)/n·bytes,
// all_gather and reduce_scatter (n-1)/n·bytes, all_to_all the input rows sent
// to other ranks, broadcast and reduce bytes, send bytes, recv 0. Analytical
// volume checks compare against these.
#include "tessera/comm/communicator.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace tessera {
namespace comm {

struct TraceRecord {
  int64_t calls = 0;
  int64_t bytes = 0;
  double bus_bytes = 0.0;
};

class CommTrace {
 public:
  using Key = std::pair<std::string, OpType>;  // (communicator name, op)

  void record(const std::string& group, OpType op, int64_t bytes, double bus_bytes);
  TraceRecord get(const std::string& group, OpType op) const;
  // Summed over operations of one group ("" sums every group).
  TraceRecord total(const std::string& group = "") const;
  std::map<Key, TraceRecord> snapshot() const;
  void reset();
  // One line per (group, op): "data all_reduce calls=3 bytes=96 bus_bytes=144".
  std::string to_string() const;

 private:
  mutable std::mutex mutex_;
  std::map<Key, TraceRecord> records_;
};

class TracingCommunicator : public Communicator, public std::enable_shared_from_this<TracingCommunicator> {
 public:
  // The control channel (Note [Control traffic]) records into control_trace,
  // or into trace when none is given, under the same communicator name.
  TracingCommunicator(CommunicatorPtr inner, std::shared_ptr<CommTrace> trace,
                      std::shared_ptr<CommTrace> control_trace = nullptr);

  const std::shared_ptr<CommTrace>& trace() const { return trace_; }
  const CommunicatorPtr& inner() const { return inner_; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  std::string backend() const override { return "tracing(" + inner_->backend() + ")"; }

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
  // Recorded as its sends and receives.
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops) override;
  bool sends_wait_for_receiver() const override { return inner_->sends_wait_for_receiver(); }
  bool issue_waits_for_group() const override { return inner_->issue_waits_for_group(); }
  CommunicatorPtr control() override;
  CommunicatorPtr split(int color, int key, const std::string& name) override;

 private:
  void record(OpType op, int64_t bytes, double bus_factor);

  CommunicatorPtr inner_;
  std::shared_ptr<CommTrace> trace_;
  std::shared_ptr<CommTrace> control_trace_;
  std::shared_ptr<TracingCommunicator> control_;  // null when inner_ is its own control channel
};

}  // namespace comm
}  // namespace tessera
