#pragma once
// The vocabulary embedding of 3D tensor parallelism, whose table is also the
// tied LM head's weight (Note [3D layouts] in linear_3d.h): the [V, h] table
// stored as a column-role Linear3D's weight of shape [V_p/q, h/q²],
// vocabulary block = 3d_input's index (padded as in Note [Vocabulary
// padding]), hidden block = 3d_output's index, cut again over 3d_weight.
//
// Forward, from the whole batch's ids [b, s] to layout A [b/q², s, h/q]:
// all-gather the table over the weight group ([V_p/q, h/q]), look up the
// ids of batch block k (this rank's 3d_weight index) that fall in this
// vocabulary block (zero rows for the others), and reduce-scatter over the
// input group, which sums the vocabulary blocks and leaves batch sub-block
// j. Backward: the all-gather of the output gradient over the input group,
// the lookup's gradient, and the reduce-scatter of the table's gradient
// over the weight group (whole: it sums every batch block).
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

struct VocabEmbedding3DOptions {
  VocabEmbedding3DOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // true vocabulary size V, padded internally to a multiple of q
  TORCH_ARG(int64_t, embedding_dim);   // divisible by q²
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

class VocabEmbedding3DImpl : public torch::nn::Cloneable<VocabEmbedding3DImpl>, public PlacedModule {
 public:
  VocabEmbedding3DImpl(const VocabEmbedding3DOptions& options, comm::CommunicatorPtr input,
                       comm::CommunicatorPtr weight, comm::CommunicatorPtr output);

  void reset() override;
  // Without init_seed: the unpadded table drawn from N(0, 1) as
  // torch::nn::Embedding draws it, then this rank's block kept.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // ids [b, s] (the whole batch, the same on every rank; b divisible by q²),
  // each in [0, V); returns layout A [b/q², s, h/q].
  at::Tensor forward(const at::Tensor& ids);
  // Logits [..., V_p/q] in layout B from hidden states in layout A: the tied
  // head, the table used as a column-role linear's weight.
  at::Tensor logits(const at::Tensor& hidden);

  void load_full(const at::Tensor& weight);
  at::Tensor full_weight();

  VocabEmbedding3DOptions options;
  at::Tensor weight;  // [V_p/q, h/q²]

 private:
  comm::CommunicatorPtr input_, weight_, output_;
  int64_t vocab_start_ = 0, vocab_end_ = 0;
};

TORCH_MODULE(VocabEmbedding3D);

}  // namespace nn
}  // namespace tessera
