#pragma once
// The decoder-only transformer, written once against nn::LayerFactory: GPT-2
// and the Llama family (Llama 3, Mistral, Qwen 2/3, Mixtral) are presets of
// one configuration (docs/models.md). Token embeddings (and learned positions,
// or rotary ones applied to q and k), N pre-norm blocks of causal attention
// (multi-head, grouped-query or multi-query; heads split across tensor
// ranks) and an MLP (4h GELU or SwiGLU) or a mixture of experts, a final
// norm, an LM head tied to the token embedding or its own, and the loss.
// With a factory over a size-1 group it is the serial model.
//
// Note [GPT full weights]
// full_state() / load_full_state() use GPT-2's names ("wte.weight",
// "h.0.attn.c_attn.weight", ...) with unsharded shapes, whatever the preset.
// Multi-head attention keeps GPT-2's fused c_attn, whose [3·H·d, h] rows are
// grouped per head (head 0's q, k, v rows, then head 1's, ...), so that
// contiguous row shards give each tensor rank whole heads. Grouped-query
// attention has attn.q_proj [H·d, h] (rows per head) and attn.kv_proj
// [2·K·d, h] (rows per kv head: its k rows, then its v rows). A SwiGLU MLP
// has mlp.c_gate (gate_proj), mlp.c_fc (up_proj), mlp.c_proj (down_proj);
// Qwen 3's per-head norms are attn.q_norm and attn.k_norm. Linear weights
// are [out, in] as in torch::nn::Linear (Hugging Face's GPT-2 Conv1D stores
// them transposed); rotary models use Hugging Face's half-split rotation.
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/rotary.h"

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

// How a decoder knows where its tokens are.
enum class Positions { kLearned, kRotary };

// Built in LibTorch's options style: GPTConfig().layers(2).hidden(64).heads(4).
// The defaults are GPT-2's.
struct GPTConfig {
  TORCH_ARG(int64_t, vocab) = 50257;
  TORCH_ARG(int64_t, context) = 1024;
  TORCH_ARG(int64_t, layers) = 12;
  TORCH_ARG(int64_t, heads) = 12;
  TORCH_ARG(int64_t, hidden) = 768;
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(bool, tied) = true;
  // Architecture (docs/models.md). kv_heads 0: heads (multi-head attention);
  // head_dim 0: hidden / heads; ffn 0: 4 · hidden.
  TORCH_ARG(nn::NormKind, norm) = nn::NormKind::kLayerNorm;
  TORCH_ARG(double, norm_eps) = 1e-5;
  TORCH_ARG(Positions, positions) = Positions::kLearned;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(c10::optional<nn::Llama3RopeScaling>, rope_scaling) = c10::nullopt;
  TORCH_ARG(int64_t, kv_heads) = 0;
  TORCH_ARG(int64_t, head_dim) = 0;
  TORCH_ARG(nn::MLPKind, mlp) = nn::MLPKind::kGelu;
  TORCH_ARG(int64_t, ffn) = 0;
  // Biases of the attention output and MLP linears (GPT-2: yes; Llama,
  // Qwen: no), and of the q/k/v projection (GPT-2, Qwen 2: yes).
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, qkv_bias) = true;
  // Qwen 3: RMSNorm over each head's q and k before the rotation.
  TORCH_ARG(bool, qk_norm) = false;
  // Recompute each block's activations in backward instead of keeping them
  // (nn/activation_checkpoint.h): one more block forward per backward, the
  // same gradients, dropout included.
  TORCH_ARG(bool, checkpoint_activations) = false;
  // Mixture of experts (nn/moe.h, docs/expert-parallel.md): with experts > 0
  // every moe_every-th block (blocks moe_every-1, 2·moe_every-1, ...) has a
  // MoE layer of `experts` experts (each an MLP of the config's kind, ffn and
  // bias) in place of its MLP, routing each token to top_k of them (softmax
  // over all experts, then top k, renormalized by option: Mixtral's router);
  // capacity_factor nullopt: dropless.
  TORCH_ARG(int64_t, experts) = 0;
  TORCH_ARG(int64_t, moe_every) = 1;
  TORCH_ARG(int64_t, top_k) = 1;
  TORCH_ARG(bool, renormalize) = false;
  TORCH_ARG(c10::optional<double>, capacity_factor) = c10::nullopt;
  TORCH_ARG(nn::MoEDropPolicy, drop_policy) = nn::MoEDropPolicy::kPosition;
  TORCH_ARG(double, aux_loss_coef) = 1e-2;
  TORCH_ARG(double, z_loss_coef) = 1e-3;
  // Shared experts beside the routed ones (DeepSeekMoE, Qwen-MoE): an MLP of
  // this width every token passes through in each MoE block, its output
  // scaled by a per-token sigmoid gate with shared_expert_gate; 0: none.
  TORCH_ARG(int64_t, shared_expert_ffn) = 0;
  TORCH_ARG(bool, shared_expert_gate) = false;
  // How the local experts compute (Note [Expert compute] in src/nn/moe.cpp);
  // the same weights and results either way, so checkpoints do not record it.
  TORCH_ARG(nn::MoEExpertCompute, expert_compute) = nn::MoEExpertCompute::kGrouped;

 public:
  GPTConfig() = default;
  bool moe_block(int64_t block) const { return experts_ > 0 && (block + 1) % moe_every_ == 0; }
  // The sizes with their defaults resolved.
  int64_t num_kv_heads() const { return kv_heads_ > 0 ? kv_heads_ : heads_; }
  int64_t dim_per_head() const { return head_dim_ > 0 ? head_dim_ : (heads_ > 0 ? hidden_ / heads_ : 0); }
  int64_t ffn_size() const { return ffn_ > 0 ? ffn_ : 4 * hidden_; }
  // Grouped-query (or multi-query) attention: separate q and kv projections.
  bool grouped_attention() const { return num_kv_heads() != heads_; }
  // Refuses an inconsistent configuration, naming the value and the rule.
  void check() const;

  // GPT-2: "tiny" (tests), "small" (124M), "medium" (350M). Llama family:
  // "llama3-8b", "llama3-70b" (Llama 3.1, rope scaling), "qwen2.5-7b",
  // "qwen3-8b", "mistral-7b" (v0.3), "mixtral-8x7b"; and test-sized ones of
  // the same architectures: "llama-tiny", "mistral-tiny", "qwen2-tiny",
  // "qwen3-tiny", "mixtral-tiny".
  static GPTConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();  // GPT-2's three first

  // The architecture and sizes as a JSON object (what checkpoints and weight
  // files carry under "gpt", so that inference rebuilds the model), and back;
  // keys missing from the object keep GPT-2's defaults, so {"heads": 12}
  // (what earlier checkpoints carry) reads as GPT-2.
  std::string to_json() const;
  static GPTConfig from_json(const std::string& json);
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
  // Fixed at construction.
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
  torch::nn::AnyModule wte_, wpe_, drop_, ln_f_, lm_head_;  // wpe_ empty with rotary positions
  std::vector<std::shared_ptr<GPTBlockImpl>> blocks_;
  std::shared_ptr<nn::MoELossScale> aux_loss_scale_ = std::make_shared<nn::MoELossScale>();
  nn::NamedPlacements placements_;
};

TORCH_MODULE(GPT);

}  // namespace models
}  // namespace tessera
