#include "tessera/nn/partial_gradients.h"

namespace tessera {
namespace nn {

void reduce_partial_gradients(const PartialGradients& partial) {
  if (!partial.group || partial.group->size() == 1) return;
  for (const auto& p : partial.params) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.mutable_grad();
    partial.group->all_reduce(g);
  }
}

}  // namespace nn
}  // namespace tessera
