#pragma once
// The vocabulary embedding of 2D and 2.5D tensor parallelism: the [V, h]
// table in q x q blocks, vocabulary block i (over the col group, Note
// [Vocabulary padding] in vocab_parallel_embedding.h) and hidden block j
// (over the row group), so rank (i, j) holds [V_p/q, h/q]. The output is the
// activation layout of Note [2D and 2.5D layouts]: [b/q, s, h/q].
//
// Forward: the ids of the column's batch blocks are all-gathered over col,
// each rank looks up the ids in its vocabulary block (zero rows for the
// others), and the partial rows are reduce-scattered over col back to batch
// blocks, summing the vocabulary blocks. Backward: the all-gather of the
// output gradient. In 2.5D the table is Partial over depth: each depth
// layer embeds its own batch blocks.
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

struct VocabEmbedding2DOptions {
  VocabEmbedding2DOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // true vocabulary size V, padded internally to a multiple of q
  TORCH_ARG(int64_t, embedding_dim);   // divisible by q
  // Draw the table blockwise from this seed (Note [Layout-independent
  // initialization]) instead of drawing it whole as torch::nn::Embedding does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
  // forward() takes the whole batch [b, s] (the same ids on every rank, as a
  // layer factory passes them) and keeps its depth layer's rows itself, with
  // no all-gather of ids; b must be divisible by q·depth.
  TORCH_ARG(bool, full_batch) = false;
};

class VocabEmbedding2DImpl : public torch::nn::Cloneable<VocabEmbedding2DImpl>, public PlacedModule {
 public:
  // `depth` (2.5D) may be null or of size 1 for 2D.
  VocabEmbedding2DImpl(const VocabEmbedding2DOptions& options, comm::CommunicatorPtr row, comm::CommunicatorPtr col,
                       comm::CommunicatorPtr depth = nullptr);

  void reset() override;
  // Without init_seed: the unpadded table drawn from N(0, 1) as
  // torch::nn::Embedding draws it, then this rank's block kept.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // ids [b/q, s] (this grid row's batch block, the same on the row group's
  // ranks; [b, s] with full_batch), each in [0, V); returns [b/q, s, h/q].
  at::Tensor forward(const at::Tensor& ids);

  // Loads this rank's block of the full, unpadded [V, h] table.
  void load_full(const at::Tensor& weight);
  // The full, unpadded table (collective over row and col).
  at::Tensor full_weight();

  int64_t padded_vocab() const { return padded_vocab_; }

  VocabEmbedding2DOptions options;
  at::Tensor weight;  // [V_p/q, h/q]

 private:
  comm::CommunicatorPtr row_, col_, depth_;
  int64_t padded_vocab_ = 0;
  int64_t vocab_start_ = 0, vocab_end_ = 0;
};

TORCH_MODULE(VocabEmbedding2D);

}  // namespace nn
}  // namespace tessera
