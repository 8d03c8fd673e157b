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

}  // namespace nn
}  // namespace tessera
