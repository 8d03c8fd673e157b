#include "tessera/comm/communicator.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace tessera {
namespace comm {
namespace {

class CompletedWork : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

}  // namespace

// Stateless and immutable, so one instance serves every call.
WorkPtr completed_work() {
  static const WorkPtr done = std::make_shared<CompletedWork>();
  return done;
}

std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled ReduceOp");
}

std::string op_type_name(OpType op) {
  switch (op) {
    case OpType::kAllReduce:
      return "all_reduce";
    case OpType::kBroadcast:
      return "broadcast";
    case OpType::kReduce:
      return "reduce";
    case OpType::kAllGather:
      return "all_gather";
    case OpType::kReduceScatter:
      return "reduce_scatter";
    case OpType::kAllToAll:
      return "all_to_all";
    case OpType::kSend:
      return "send";
    case OpType::kRecv:
      return "recv";
    case OpType::kBarrier:
      return "barrier";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled OpType");
}

std::vector<std::string> all_gather_strings(Communicator& device_group, const std::string& mine) {
  const CommunicatorPtr channel = device_group.control();
  Communicator& group = *channel;
  const int n = group.size();
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({n}, at::kLong);
  group.all_gather(lengths, length);
  const int64_t longest = std::max<int64_t>(1, lengths.max().item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  group.all_gather(all, bytes);
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(static_cast<const char*>(all.data_ptr()) + r * longest,
                     static_cast<size_t>(lengths[r].item<int64_t>()));
  return out;
}

}  // namespace comm
}  // namespace tessera
