#pragma once
// A GPT-2-style language model written once against nn::LayerFactory: token
// and position embeddings, N pre-LayerNorm blocks of causal multi-head
// self-attention (heads split across tensor ranks) and a 4h GELU MLP, final
// LayerNorm, an LM head tied to the token embedding by option, and the loss.
// With a factory over a size-1 group it is the serial model.
//
// Note [GPT full weights]
// full_state() / load_full_state() use GPT-2's names ("wte.weight",
// "h.0.attn.c_attn.weight", ...) with unsharded shapes. One layout differs
// from Hugging Face's checkpoint: c_attn's [3h, h] rows are grouped per head
// (head 0's q, k, v rows, then head 1's, ...), so that contiguous row shards
// give each tensor rank whole heads; Linear weights are [out, in] as in
// torch::nn::Linear (Hugging Face's Conv1D stores them transposed).
#include "tessera/nn/layer_factory.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace models {

// Built in LibTorch's options style: GPTConfig().layers(2).hidden(64).heads(4).
struct GPTConfig {
  TORCH_ARG(int64_t, vocab) = 50257;
  TORCH_ARG(int64_t, context) = 1024;
  TORCH_ARG(int64_t, layers) = 12;
  TORCH_ARG(int64_t, heads) = 12;
  TORCH_ARG(int64_t, hidden) = 768;
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(bool, tied) = true;
  // Recompute each block's activations in backward instead of keeping them
  // (nn/activation_checkpoint.h): one more block forward per backward, the
  // same gradients, dropout included.
  TORCH_ARG(bool, checkpoint_activations) = false;
  // Mixture of experts (nn/moe.h, docs/expert-parallel.md): with experts > 0
  // every moe_every-th block (blocks moe_every-1, 2·moe_every-1, ...) has a
  // MoE layer of `experts` experts (each a 4h GELU MLP) in place of its MLP,
  // routing each token to top_k of them; capacity_factor nullopt: dropless.
  TORCH_ARG(int64_t, experts) = 0;
  TORCH_ARG(int64_t, moe_every) = 1;
  TORCH_ARG(int64_t, top_k) = 1;
  TORCH_ARG(bool, renormalize) = false;
  TORCH_ARG(c10::optional<double>, capacity_factor) = c10::nullopt;
  TORCH_ARG(nn::MoEDropPolicy, drop_policy) = nn::MoEDropPolicy::kPosition;
  TORCH_ARG(double, aux_loss_coef) = 1e-2;
  TORCH_ARG(double, z_loss_coef) = 1e-3;

 public:
  GPTConfig() = default;
  bool moe_block(int64_t block) const { return experts_ > 0 && (block + 1) % moe_every_ == 0; }

  // "tiny" (tests), "small" (GPT-2 124M), "medium" (GPT-2 350M).
  static GPTConfig preset(const std::string& name);
};

// The load balance of a model's last MoE forward, over the ranks of a
// world: the largest number of assignments routed to one expert over the
// mean (1: perfect balance), worst layer; and, averaged over layers, the
// auxiliary loss and the assignments dropped over capacity. All 0 for a
// dense model.
struct MoEBalance {
  double max_over_mean = 0, aux_loss = 0, dropped = 0;
};

class GPTBlockImpl;

class GPTImpl : public torch::nn::Module {
 public:
  GPTImpl(const GPTConfig& config, std::shared_ptr<nn::LayerFactory> factory);

  // ids [b, s] (full, s <= context) -> logits on this rank's vocabulary
  // shard, [b, s, vocab shard] (full sequence in every mode's 1D variant).
  at::Tensor forward(const at::Tensor& ids);
  // The model as a sequence of layers, for pipelining: "embed" (token and
  // position embeddings, dropout; ids -> activations), "h0" ... "h{N-1}",
  // "head" (final LayerNorm and the LM logits; it holds the token embedding
  // when tied). The layers share this model's parameters and, inside each
  // layer, its parameter names ("embed" and "head" add no prefix).
  torch::nn::Sequential as_sequential();
  // Mean cross entropy of the logits against targets [b, s].
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets);
  // After backward: sums gradients that are partial in this mode. Under
  // ShardedModule pass placements() to its options instead.
  void reduce_partial_gradients();

  // GPT-2's initialisation: weights and embeddings N(0, 0.02), the residual
  // projections N(0, 0.02 / sqrt(2 · layers)), biases 0, LayerNorm 1 and 0;
  // drawn blockwise from one seed of the default generator (Note
  // [Layout-independent initialization]): each rank draws only what it holds,
  // and with the same seed on every rank the model equals the serial one
  // whatever the layout. The constructor calls it.
  void reset_parameters();
  void load_full_state(const std::map<std::string, at::Tensor>& state);
  // Full parameters (or, with gradients = true, full gradients); collective.
  std::map<std::string, at::Tensor> full_state(bool gradients = false);
  // Every parameter with its full_state() name and its placement (where it
  // sits in the full tensor, which groups hold what); local, no communication.
  nn::NamedPlacements placements();

  // The factor the MoE layers' auxiliary-loss gradients are multiplied by
  // (Note [MoE auxiliary losses]): whoever scales the loss before backward
  // (1/micro-batches, a loss scale) sets the same factor here first.
  void set_aux_loss_scale(double scale) { aux_loss_scale_->value = scale; }
  // What each MoE block of this rank measured in its last forward, in block order.
  std::vector<nn::MoEStats> moe_stats() const;
  // moe_stats() summed over `world`, whose pipeline stages each hold their
  // own blocks. Collective over world (every rank of the model's layout).
  MoEBalance moe_balance(comm::Communicator& world) const;

  const GPTConfig& config() const { return config_; }
  const std::shared_ptr<nn::LayerFactory>& factory() const { return factory_; }

 private:
  GPTConfig config_;
  std::shared_ptr<nn::LayerFactory> factory_;
  torch::nn::AnyModule wte_, wpe_, drop_, ln_f_, lm_head_;
  std::vector<std::shared_ptr<GPTBlockImpl>> blocks_;
  std::shared_ptr<nn::MoELossScale> aux_loss_scale_ = std::make_shared<nn::MoELossScale>();
};

TORCH_MODULE(GPT);

}  // namespace models
}  // namespace tessera
