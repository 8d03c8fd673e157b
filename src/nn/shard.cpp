#include "tessera/nn/shard.h"

#include "tessera/comm/functional.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace nn {

void check_divisible(int64_t size, int64_t n, const std::string& what, const std::string& hint) {
  TORCH_CHECK(n > 0 && size % n == 0, what, " (", size, ") is not divisible by the tensor-parallel size ", n, "; ",
              hint);
}

int64_t pad_to_multiple(int64_t size, int64_t n) {
  TORCH_CHECK(n > 0, "pad_to_multiple: the multiple must be positive, got ", n);
  return (size + n - 1) / n * n;
}

at::Tensor shard_of(const at::Tensor& full, int64_t dim, const comm::Communicator& group) {
  at::NoGradGuard no_grad;
  return comm::raw::split(full.detach(), dim, group).contiguous().clone();
}

at::Tensor unshard(const at::Tensor& shard, int64_t dim, const comm::Communicator& group) {
  at::NoGradGuard no_grad;
  return comm::raw::all_gather(shard.detach(), dim, group);
}

ParamPlacement replicated_placement(const at::Tensor& param) {
  ParamPlacement p;
  p.param = param;
  p.full_shape = param.sizes().vec();
  return p;
}

ParamPlacement sharded_placement(const at::Tensor& param, int64_t dim, int64_t full_size,
                                 const comm::Communicator& group) {
  ParamPlacement p = replicated_placement(param);
  if (group.size() == 1 && param.size(dim) == full_size) return p;
  const int64_t rows = param.size(dim);
  p.dim = dim;
  p.full_shape[dim] = full_size;
  p.offset = std::min(full_size, rows * group.rank());
  p.length = std::min(rows, full_size - p.offset);
  TORCH_INTERNAL_ASSERT(p.length == rows || dim == 0, "padding rows are only supported along dim 0");
  return p;
}

}  // namespace nn
}  // namespace tessera
