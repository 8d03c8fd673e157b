#pragma once
// The position embedding of 2D and 2.5D tensor parallelism: the [context, h]
// table cut along the hidden dimension only, hidden block j on the row group
// (Note [2D and 2.5D layouts] in linear_2d.h), so rank (i, j) holds
// [context, h/q] and its lookup [s, h/q] adds to the [b/q, s, h/q] token
// embedding without communication. Every grid row (and, in 2.5D, every depth
// layer) holds the same table and sees its own batch rows: the gradient is
// Partial over col and depth. 3D uses it with row = 3d_output, col =
// 3d_input and depth = 3d_weight, as it uses LayerNorm2D.
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

struct PositionEmbedding2DOptions {
  PositionEmbedding2DOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // the context length
  TORCH_ARG(int64_t, embedding_dim);   // full size; divisible by q
  // Draw the table blockwise from this seed (Note [Layout-independent
  // initialization]) instead of drawing it whole as torch::nn::Embedding does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

class PositionEmbedding2DImpl : public torch::nn::Cloneable<PositionEmbedding2DImpl>, public PlacedModule {
 public:
  // `depth` (2.5D) may be null or of size 1 for 2D.
  PositionEmbedding2DImpl(const PositionEmbedding2DOptions& options, comm::CommunicatorPtr row,
                          comm::CommunicatorPtr col, comm::CommunicatorPtr depth = nullptr);

  void reset() override;
  // Without init_seed: the full table drawn from N(0, 1) as
  // torch::nn::Embedding draws it, then this rank's block kept.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // positions [...] in [0, num_embeddings) -> [..., h/q]; local.
  at::Tensor forward(const at::Tensor& positions);

  PositionEmbedding2DOptions options;
  at::Tensor weight;  // [num_embeddings, h/q]

 private:
  comm::CommunicatorPtr row_, col_, depth_;
};

TORCH_MODULE(PositionEmbedding2D);

}  // namespace nn
}  // namespace tessera
