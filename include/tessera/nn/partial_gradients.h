#pragma once
// Parameters whose gradients are partial sums over a group: replicated over
// the group's ranks but fed by each rank's shard of the activations only
// (sequence parallelism: LayerNorm, position embeddings, row-parallel
// biases). Their gradients must be summed over `group` before a step; the
// data-parallel wrapper does it inside its gradient reduction
// (ShardedModuleOptions::partial_gradients).
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace tessera {
namespace nn {

struct PartialGradients {
  std::vector<at::Tensor> params;
  comm::CommunicatorPtr group;  // null or size 1: nothing to sum
};

// Sums the defined gradients of `partial.params` over `partial.group` (collective).
void reduce_partial_gradients(const PartialGradients& partial);

}  // namespace nn
}  // namespace tessera
