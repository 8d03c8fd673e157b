#pragma once
// The linear layer of 2D tensor parallelism (Optimus, arXiv 2104.05343) and,
// given a depth group, of 2.5D (Tesseract, arXiv 2105.14500): y = x Wᵀ + b
// with the product computed by nn::summa_matmul (Note [SUMMA]).
//
// Note [2D and 2.5D layouts]
// On the q x q grid, rank (i, j) is local rank j of `row` (2d_row /
// 2.5d_row) and local rank i of `col` (2d_col / 2.5d_col).
//   activations [b/q, s, h/q]   batch block i, hidden block j (2.5D: batch
//                               block i + q·k over the xz group, [b/(q·d), s, h/q])
//   weight      [out/q, in/q]   output block j, input block i (Wᵀ's block (i, j))
//   bias        [out/q]         output block j
// Placements: weight Shard(0) over row, Shard(1) over col; bias Shard(0)
// over row and Partial over col (each grid row sums over its own batch
// rows). In 2.5D both are also Partial over depth: every depth layer holds
// the same weights and sees its own part of the batch. Partial gradients are
// summed by whoever reduces gradients (ShardedModule, or
// nn::reduce_partial_gradients), together with the data-parallel sum.
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

struct Linear2DOptions {
  Linear2DOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);   // full size; divisible by q
  TORCH_ARG(int64_t, out_features);  // full size; divisible by q
  TORCH_ARG(bool, bias) = true;
  // Draw the weights blockwise from this seed (Note [Layout-independent
  // initialization]) instead of drawing the full tensors as torch::nn::Linear does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

class Linear2DImpl : public torch::nn::Cloneable<Linear2DImpl>, public PlacedModule {
 public:
  // `depth` (2.5D) may be null or of size 1 for 2D.
  Linear2DImpl(const Linear2DOptions& options, comm::CommunicatorPtr row, comm::CommunicatorPtr col,
               comm::CommunicatorPtr depth = nullptr);

  void reset() override;
  // Without init_seed: the full weight and bias drawn as torch::nn::Linear
  // draws them, then this rank's blocks kept (equal to the serial layer
  // given the same seed on every rank).
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // input [..., in/q] in the layout of Note [2D and 2.5D layouts]; returns [..., out/q].
  at::Tensor forward(const at::Tensor& input);

  // Loads this rank's blocks of the full [out, in] weight and [out] bias.
  void load_full(const at::Tensor& weight, const at::Tensor& bias = at::Tensor());
  // The full weight / bias (collective over row and col).
  at::Tensor full_weight();
  at::Tensor full_bias();

  Linear2DOptions options;
  at::Tensor weight;  // [out/q, in/q]
  at::Tensor bias;    // [out/q], undefined without bias

 private:
  comm::CommunicatorPtr row_, col_, depth_;
};

TORCH_MODULE(Linear2D);

}  // namespace nn
}  // namespace tessera
