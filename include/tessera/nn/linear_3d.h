#pragma once
// The linear layer of 3D tensor parallelism (arXiv 2105.14450): y = x Wᵀ + b
// with the product computed by nn::matmul_3d (Note [3D matmul]).
//
// Note [3D layouts]
// On the q x q x q cube, rank (i, j, k) is local rank j of 3d_input, k of
// 3d_weight and i of 3d_output. Between blocks activations are in layout A,
//   [b/q², s, h/q]   batch sub-block j of batch block k (index k·q + j, the
//                    rank's place in 3d_input_weight), hidden block i;
// a column-role layer (input = 3d_input, output = 3d_output) turns layout A
// into layout B,
//   [b/q², s, f/q]   batch sub-block i of batch block k (index k·q + i, the
//                    rank's place in 3d_output_weight), feature block j,
// and a row-role layer (the two groups swapped) turns B back into A. The
// layer itself only knows its three groups:
//   weight  [out/q, in/q²]  output block = the input group's index, input
//                           block = the output group's index, cut again
//                           over the weight group
//   bias    [out/q]         output block
// Placements: weight Shard(0) over input, Shard(1) over output then over
// weight; bias Shard(0) over input, Partial over output and weight (each
// holds other batch rows). The weight's gradient is whole: matmul_3d's
// reduce-scatter over the weight group sums every batch block.
#include "tessera/comm/communicator.h"
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>

namespace tessera {
namespace nn {

struct Linear3DOptions {
  Linear3DOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);   // full size; divisible by q²
  TORCH_ARG(int64_t, out_features);  // full size; divisible by q
  TORCH_ARG(bool, bias) = true;
  // Draw the weights blockwise from this seed (Note [Layout-independent
  // initialization]) instead of drawing the full tensors as torch::nn::Linear does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

class Linear3DImpl : public torch::nn::Cloneable<Linear3DImpl>, public PlacedModule {
 public:
  // The groups in this layer's roles (Note [3D matmul]); a row-role layer
  // gets 3d_output as `input` and 3d_input as `output`.
  Linear3DImpl(const Linear3DOptions& options, comm::CommunicatorPtr input, comm::CommunicatorPtr weight,
               comm::CommunicatorPtr output);

  void reset() override;
  // Without init_seed: the full weight and bias drawn as torch::nn::Linear
  // draws them, then this rank's blocks kept.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // input [..., in/q] (this rank's batch sub-block and input block); returns [..., out/q].
  at::Tensor forward(const at::Tensor& input);

  void load_full(const at::Tensor& weight, const at::Tensor& bias = at::Tensor());
  at::Tensor full_weight();

  Linear3DOptions options;
  at::Tensor weight;  // [out/q, in/q²]
  at::Tensor bias;    // [out/q], undefined without bias

 private:
  comm::CommunicatorPtr input_, weight_, output_;
};

TORCH_MODULE(Linear3D);

}  // namespace nn
}  // namespace tessera
