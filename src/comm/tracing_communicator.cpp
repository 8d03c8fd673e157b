#include "tessera/comm/tracing_communicator.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

namespace tessera {
namespace comm {
namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

}  // namespace

void CommTrace::record(const std::string& group, OpType op, int64_t bytes, double bus_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TraceRecord& r = records_[Key(group, op)];
  r.calls += 1;
  r.bytes += bytes;
  r.bus_bytes += bus_bytes;
}

TraceRecord CommTrace::get(const std::string& group, OpType op) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = records_.find(Key(group, op));
  return it == records_.end() ? TraceRecord{} : it->second;
}

TraceRecord CommTrace::total(const std::string& group) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TraceRecord sum;
  for (const auto& entry : records_) {
    if (!group.empty() && entry.first.first != group) continue;
    sum.calls += entry.second.calls;
    sum.bytes += entry.second.bytes;
    sum.bus_bytes += entry.second.bus_bytes;
  }
  return sum;
}

std::map<CommTrace::Key, TraceRecord> CommTrace::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_;
}

void CommTrace::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
}

std::string CommTrace::to_string() const {
  std::string out;
  for (const auto& entry : snapshot()) {
    out +=
        fmt::format("{} {} calls={} bytes={} bus_bytes={:.0f}\n", entry.first.first, op_type_name(entry.first.second),
                    entry.second.calls, entry.second.bytes, entry.second.bus_bytes);
  }
  return out;
}

TracingCommunicator::TracingCommunicator(CommunicatorPtr inner, std::shared_ptr<CommTrace> trace,
                                         std::shared_ptr<CommTrace> control_trace)
    : inner_(std::move(inner)), trace_(std::move(trace)), control_trace_(std::move(control_trace)) {
  TORCH_CHECK(inner_ != nullptr, "TracingCommunicator needs a communicator to wrap");
  TORCH_CHECK(trace_ != nullptr, "TracingCommunicator needs a CommTrace");
  if (!control_trace_) control_trace_ = trace_;
  auto channel = inner_->control();
  if (channel != inner_) control_ = std::make_shared<TracingCommunicator>(channel, control_trace_);
}

CommunicatorPtr TracingCommunicator::control() {
  if (control_) return control_;
  return shared_from_this();
}

void TracingCommunicator::record(OpType op, int64_t bytes, double bus_factor) {
  trace_->record(name(), op, bytes, static_cast<double>(bytes) * bus_factor);
}

// The call is recorded after the inner call returned, so a rejected call is
// not counted.
WorkPtr TracingCommunicator::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  auto work = inner_->all_reduce(tensor, options);
  const double n = size();
  record(OpType::kAllReduce, nbytes(tensor), 2.0 * (n - 1) / n);
  return work;
}

WorkPtr TracingCommunicator::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  auto work = inner_->broadcast(tensor, options);
  record(OpType::kBroadcast, nbytes(tensor), 1.0);
  return work;
}

WorkPtr TracingCommunicator::reduce(at::Tensor& tensor, const ReduceOptions& options) {
  auto work = inner_->reduce(tensor, options);
  record(OpType::kReduce, nbytes(tensor), 1.0);
  return work;
}

WorkPtr TracingCommunicator::all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options) {
  auto work = inner_->all_gather(output, input, options);
  const double n = size();
  record(OpType::kAllGather, nbytes(output), (n - 1) / n);
  return work;
}

WorkPtr TracingCommunicator::reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                            const ReduceScatterOptions& options) {
  auto work = inner_->reduce_scatter(output, input, options);
  const double n = size();
  record(OpType::kReduceScatter, nbytes(input), (n - 1) / n);
  return work;
}

WorkPtr TracingCommunicator::all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options) {
  auto work = inner_->all_to_all(output, input, options);
  const int64_t bytes = nbytes(input);
  double to_self = 0.0;
  if (options.input_split_sizes.empty()) {
    to_self = static_cast<double>(bytes) / size();
  } else if (input.size(0) > 0) {
    to_self = static_cast<double>(bytes) * options.input_split_sizes[rank()] / input.size(0);
  }
  trace_->record(name(), OpType::kAllToAll, bytes, static_cast<double>(bytes) - to_self);
  return work;
}

WorkPtr TracingCommunicator::send(const at::Tensor& tensor, int dst, const SendOptions& options) {
  auto work = inner_->send(tensor, dst, options);
  record(OpType::kSend, nbytes(tensor), 1.0);
  return work;
}

WorkPtr TracingCommunicator::recv(at::Tensor& tensor, int src, const RecvOptions& options) {
  auto work = inner_->recv(tensor, src, options);
  record(OpType::kRecv, nbytes(tensor), 0.0);
  return work;
}

WorkPtr TracingCommunicator::barrier(const BarrierOptions& options) {
  auto work = inner_->barrier(options);
  record(OpType::kBarrier, 0, 0.0);
  return work;
}

WorkPtr TracingCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  auto work = inner_->batch_isend_irecv(ops);
  for (const auto& o : ops) {
    const bool send = o.kind == P2POp::Kind::kSend;
    record(send ? OpType::kSend : OpType::kRecv, nbytes(o.tensor), send && o.peer != rank() ? 1.0 : 0.0);
  }
  return work;
}

CommunicatorPtr TracingCommunicator::split(int color, int key, const std::string& name) {
  auto child = inner_->split(color, key, name);
  if (!child) return nullptr;
  return std::make_shared<TracingCommunicator>(std::move(child), trace_, control_trace_);
}

}  // namespace comm
}  // namespace tessera
