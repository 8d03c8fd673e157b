#pragma once
// The matrix product of 3D tensor parallelism (Bian et al., arXiv
// 2105.14450, as Colossal-AI's 3D layers compute it), written once as an
// autograd function.
//
// Note [3D matmul]
// On a q x q x q cube, y = x·Wᵀ for activations cut into q² batch
// sub-blocks and q hidden blocks, and a weight cut into q x q blocks, each
// block cut again into q sub-blocks. Three groups, named for their role in
// one product:
//   input   holds the other batch sub-blocks of this rank's batch block
//           (same input block): x is all-gathered over it;
//   weight  holds the other sub-blocks of this rank's weight block (and
//           the other batch blocks): Wᵀ is all-gathered over it;
//   output  holds the other input blocks of the same rows: the partial
//           products are reduce-scattered over it, each rank keeping a
//           batch sub-block of the sum.
// Forward: xg = all-gather(x, input) [q·M, in/q], Wg = all-gather(Wᵀ,
// weight) [in/q, out/q], y = reduce-scatter(xg·Wg, output) [M, out/q].
// Backward: dyg = all-gather(dy, output), dW = reduce-scatter(xgᵀ·dyg,
// weight), dx = reduce-scatter(dyg·Wgᵀ, input); the two gathers of the
// forward are kept for it, so every byte moves once: per rank and product
// 2(q-1)/q³·(B·in + B·out + in·out) elements for a global batch of B rows,
// the paper's figure. dW's reduce-scatter is posted before dx is computed
// and runs under that product; both gathers of the forward run together.
// The output's hidden block is the input group's index and its batch
// sub-block the output group's: the next product swaps the two groups'
// roles (nn/linear_3d.h), and two products bring the layout back.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

namespace tessera {
namespace nn {

// y = x·Wᵀ with x [..., in/q] (its leading dimensions flatten to this rank's
// M rows) and w [out/q, in/q²] (this rank's sub-block of its weight block);
// returns [..., out/q]. Collective over the three groups (each of size q);
// differentiable in x and w.
at::Tensor matmul_3d(const at::Tensor& x, const at::Tensor& w, const comm::CommunicatorPtr& input,
                     const comm::CommunicatorPtr& weight, const comm::CommunicatorPtr& output);

}  // namespace nn
}  // namespace tessera
