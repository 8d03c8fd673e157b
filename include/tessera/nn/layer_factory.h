#pragma once
// The layer factory: how a model asks for its layers without knowing the
// tensor-parallel mode. A model written against it (models::GPT) runs
// serially (tensor size 1), in 1D and, once their factories exist, in 2D,
// 2.5D and 3D.
//
// Note [Layer factory contract]
// - Activations between blocks are in the mode's "block layout": 1D keeps
//   them replicated [b, s, h]; its sequence-parallel variant shards the
//   sequence [b, s/n, h]; 2D will use [b/q, s, h/q], 2.5D [b/(d·q), s, h/q]
//   (DESIGN.md). scatter_activation / gather_activation convert from / to the
//   full tensor; positions() says which sequence positions this rank holds.
// - linear(role = kColumn) takes block layout and returns features sharded
//   the way heads are split (local_heads()); linear(kRow) takes that and
//   returns block layout. A model never reshapes across the sharded
//   dimension other than through these.
// - Layers are returned as torch::nn::AnyModule; their full (unsharded)
//   weights go in and out through load_full / full_weights, so that a model
//   can load and give back full weights whatever the mode.
// - lm_logits gives logits on this rank's vocabulary shard; loss takes them
//   with full targets [b, s].
// - partial_gradients names the parameters whose gradients are partial over
//   the tensor group in this mode (sequence-parallel LayerNorm, position
//   embeddings and row biases).
#include "tessera/comm/communicator.h"
#include "tessera/nn/partial_gradients.h"
#include "tessera/nn/shard.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace tessera {
namespace nn {

enum class LinearRole { kColumn, kRow };
// Where a dropout sits: on block-layout activations, or on activations
// sharded over the tensor group (heads, features) — Note [Dropout seeds].
enum class DropoutSite { kBlock, kSharded };

class LayerFactory {
 public:
  virtual ~LayerFactory() = default;

  virtual std::string mode() const = 0;  // "1d", "1d-sp", ...
  virtual const comm::CommunicatorPtr& tensor_group() const = 0;

  virtual at::Tensor scatter_activation(const at::Tensor& full) const = 0;
  virtual at::Tensor gather_activation(const at::Tensor& local) const = 0;
  // The sequence positions [0, seq_len) this rank's block layout holds.
  virtual at::Tensor positions(int64_t seq_len) const = 0;
  virtual int64_t local_heads(int64_t heads) const = 0;

  virtual torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) = 0;
  // Token ids [b, s] (full) -> block layout [.., dim].
  virtual torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) = 0;
  virtual torch::nn::AnyModule layer_norm(int64_t dim) = 0;
  // Positions [s_local] -> [s_local, dim], replicated table.
  virtual torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) = 0;
  virtual torch::nn::AnyModule dropout(double p, DropoutSite site) = 0;

  // Full weights of a layer this factory made (bias undefined where none);
  // with gradients = true the full gradients instead (collective).
  virtual void load_full(torch::nn::AnyModule& layer, const at::Tensor& weight, const at::Tensor& bias) = 0;
  virtual std::pair<at::Tensor, at::Tensor> full_weights(torch::nn::AnyModule& layer, bool gradients = false) = 0;
  // Where this rank's weight and bias of a layer this factory made sit in
  // the full tensors (the bias placement's param undefined where none).
  virtual std::pair<ParamPlacement, ParamPlacement> placements(torch::nn::AnyModule& layer) = 0;

  // Logits [.., vocab shard] from block-layout hidden states and the
  // vocabulary embedding (tied head) this factory made.
  virtual at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) = 0;
  // Mean cross entropy over targets [b, s] (full), ignore_index -100.
  virtual at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) = 0;
  // The parameters of `model` whose gradients are partial in this mode
  // (include/tessera/nn/partial_gradients.h); empty params if none.
  virtual PartialGradients partial_gradients(torch::nn::Module& model) = 0;
  // The parameters of `model` split over the tensor group (each rank holds
  // a different part); the others are replicated on every tensor rank.
  // Whole-parameter norms (LAMB, LARS, clipping) sum the former over the group.
  virtual std::vector<at::Tensor> sharded_parameters(torch::nn::Module& model) = 0;
};

// The 1D (Megatron) factory over `tensor_group`; `sequence_parallel` selects
// its sequence-parallel variant. `seed_block` / `seed_sharded` seed dropout
// (ctx->seed(kData) and ctx->seed(kTensor), Note [Dropout seeds]).
std::shared_ptr<LayerFactory> make_1d_factory(comm::CommunicatorPtr tensor_group, bool sequence_parallel,
                                              uint64_t seed_block, uint64_t seed_sharded);

}  // namespace nn
}  // namespace tessera
