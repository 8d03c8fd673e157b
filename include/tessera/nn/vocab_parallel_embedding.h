#pragma once
// Megatron's vocabulary-parallel embedding: the [V, D] table is split by rows
// (vocabulary entries) over the tensor-parallel group. Each rank looks up the
// ids that fall in its rows, writes zero rows for the others, and the partial
// outputs are summed over the group.
//
// Note [Vocabulary padding]
// A vocabulary rarely divides the tensor-parallel size n (GPT-2's 50257 is
// prime), and unlike a hidden size it may be padded soundly: the table is
// padded with zero rows to V_p = pad_to_multiple(V, n), rank r holds rows
// [r·V_p/n, (r+1)·V_p/n) and ids are checked against the true V, so padded
// rows are never looked up and never get a gradient. A tied LM head built on
// this table produces V_p logits whose padded columns the cross entropy must
// ignore: pass vocab_size(V) to vocab_parallel_cross_entropy.
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

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // true vocabulary size V, padded internally
  TORCH_ARG(int64_t, embedding_dim);
  // Output only this rank's sequence shard: the partial outputs are
  // reduce-scattered along sequence_dim instead of all-reduced
  // (Note [1D activation layouts] in column_parallel_linear.h).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;  // of the output [batch, sequence, embedding_dim]
  // Draw the weights blockwise from this seed (Note [Layout-independent
  // initialization]: no full tensor, the same whatever the layout) instead of
  // drawing the full tensors as LibTorch's layer does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;

 public:
};

class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl>, public PlacedModule {
 public:
  VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options, comm::CommunicatorPtr tensor_group);

  void reset() override;
  // The unpadded [V, D] table drawn from N(0, 1) as torch::nn::Embedding
  // draws it (default generator), then padded and sharded: with the same seed
  // on every rank the layer equals the serial one.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  // Where this rank's weight (and bias) sit in the full tensors.
  NamedPlacements local_placements() override;
  // ids: integer tensor of any shape, the same on every rank, each in [0, V).
  // Returns [*ids.shape, D], or with sequence_parallel this rank's shard of
  // it along sequence_dim.
  at::Tensor forward(const at::Tensor& ids);

  // Loads this rank's rows of the full, unpadded [V, D] table.
  void load_full(const at::Tensor& weight);
  // The full, unpadded [V, D] table, gathered from every rank (collective).
  at::Tensor full_weight() const;

  // V_p: the vocabulary padded to a multiple of the group size.
  int64_t padded_vocab() const { return padded_vocab_; }
  // This rank's rows [vocab_start(), vocab_end()) of the padded table.
  int64_t vocab_start() const { return vocab_start_; }
  int64_t vocab_end() const { return vocab_end_; }
  const comm::CommunicatorPtr& tensor_group() const { return group_; }

  VocabParallelEmbeddingOptions options;
  at::Tensor weight;  // [V_p/n, D]

 private:
  comm::CommunicatorPtr group_;
  int64_t padded_vocab_ = 0;
  int64_t vocab_start_ = 0;
  int64_t vocab_end_ = 0;
};

TORCH_MODULE(VocabParallelEmbedding);

}  // namespace nn
}  // namespace tessera
