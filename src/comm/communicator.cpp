#include "tessera/comm/communicator.h"

#include <c10/util/Exception.h>

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

}  // namespace comm
}  // namespace tessera
