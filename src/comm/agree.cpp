#include "tessera/comm/agree.h"

#include <ATen/ATen.h>

#include <exception>

namespace tessera {
namespace comm {

void on_every_rank(const CommunicatorPtr& group, const std::string& what, const std::function<void()>& step) {
  std::exception_ptr error;
  try {
    step();
  } catch (...) {
    error = std::current_exception();
  }
  if (group == nullptr || group->size() == 1) {
    if (error) std::rethrow_exception(error);
    return;
  }
  at::Tensor first = at::full({1}, error ? group->rank() : group->size(), at::kLong);
  AllReduceOptions min;
  min.op = ReduceOp::kMin;
  group->control()->all_reduce(first, min)->wait();
  if (error) std::rethrow_exception(error);
  const int64_t failed = first.item<int64_t>();
  TORCH_CHECK(failed == group->size(), what, " failed on rank ", failed, " of group '", group->name(),
              "' (its own error says why), so this rank stops too");
}

}  // namespace comm
}  // namespace tessera
