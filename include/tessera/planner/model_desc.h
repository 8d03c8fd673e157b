#pragma once
// What the planner needs to know of a model: the shapes of a decoder-only
// transformer (tessera's GPT, LLaMA), or only a parameter count for a
// module it cannot see inside (docs/planner.md).
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace tessera {
namespace models {
struct GPTConfig;
}
namespace planner {

// One linear layer of a block: in and out features, and whether it is a
// row-role layer (its input is the sharded features: attention's and the
// MLP's output projections) or a column-role one.
struct LinearShape {
  int64_t in = 0, out = 0;
  bool row = false;
};

struct ModelDesc {
  TORCH_ARG(std::string, name) = "model";
  TORCH_ARG(int64_t, layers) = 12;
  TORCH_ARG(int64_t, hidden) = 768;
  TORCH_ARG(int64_t, heads) = 12;
  // MLP width; 0: 4 · hidden.
  TORCH_ARG(int64_t, ffn) = 0;
  TORCH_ARG(int64_t, vocab) = 50257;
  // Rows of a learned position table (GPT); 0 for rotary positions (LLaMA).
  TORCH_ARG(int64_t, positions) = 1024;
  // Tokens per training sequence.
  TORCH_ARG(int64_t, seq) = 1024;
  TORCH_ARG(bool, tied) = true;
  // 2: GELU MLP (fc, proj); 3: SwiGLU (gate, up, down).
  TORCH_ARG(int, mlp_matrices) = 2;
  // Biases of the attention output and MLP linears (GPT); none (LLaMA).
  TORCH_ARG(bool, bias) = true;
  // Biases of the q/k/v projection (GPT, Qwen 2).
  TORCH_ARG(bool, qkv_bias) = true;
  // RMSNorm (weight; one statistic) instead of LayerNorm (weight and bias;
  // two statistics).
  TORCH_ARG(bool, rms_norm) = false;
  // Grouped-query attention: key/value heads (0: heads); the head dimension
  // (0: hidden / heads); per-head q/k norms (Qwen 3).
  TORCH_ARG(int64_t, kv_heads) = 0;
  TORCH_ARG(int64_t, head_dim) = 0;
  TORCH_ARG(bool, qk_norm) = false;
  // Mixture of experts, as GPTConfig: every moe_every-th block routes each
  // token to top_k of `experts` MLPs.
  TORCH_ARG(int64_t, experts) = 0;
  TORCH_ARG(int64_t, moe_every) = 1;
  TORCH_ARG(int64_t, top_k) = 1;
  // Shared experts in each MoE block: an MLP of this width (0: none), and
  // its per-token gate [1, hidden].
  TORCH_ARG(int64_t, shared_expert_ffn) = 0;
  TORCH_ARG(bool, shared_expert_gate) = false;
  // Attention that keeps no [heads, s, s] scores for backward (FlashAttention).
  // gpt() sets it as tessera's attention runs: without dropout, fused on
  // LibTorch 2 and in tiles on 1.13; explicit (scores kept) with dropout.
  TORCH_ARG(bool, fused_attention) = false;
  // A module seen only from outside (from_module): its parameter count, and
  // what the user tells of a row's work and activations (0: unknown).
  TORCH_ARG(int64_t, opaque_params) = 0;
  TORCH_ARG(double, opaque_flops_per_row) = 0;
  TORCH_ARG(double, opaque_activation_bytes_per_row) = 0;

 public:
  bool opaque() const { return opaque_params_ > 0; }
  int64_t ffn_width() const { return ffn_ > 0 ? ffn_ : 4 * hidden_; }
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : hidden_ / heads_; }
  // The width of q (and of the output projection's input), and of k (and v).
  int64_t attention_width() const { return heads_ * head_size(); }
  int64_t kv_width() const { return (kv_heads_ > 0 ? kv_heads_ : heads_) * head_size(); }
  int64_t norm_params() const { return rms_norm_ ? hidden_ : 2 * hidden_; }
  // The linears of one block as (in, out), attention then MLP (dense): what
  // the tensor modes' traffic is made of.
  std::vector<LinearShape> block_linears() const;
  bool moe_block(int64_t block) const { return experts_ > 0 && (block + 1) % moe_every_ == 0; }
  int64_t moe_blocks() const;

  // Parameters of the pieces, unsharded.
  int64_t attention_params() const;  // one block's attention and its norm
  int64_t mlp_params() const;        // one dense MLP and its norm
  int64_t router_params() const;     // one MoE layer's router
  int64_t shared_params() const;     // one MoE layer's shared experts and their gate
  int64_t block_params(int64_t block) const;
  int64_t embedding_params() const;  // tokens and positions
  int64_t head_params() const;       // final norm, and the LM head when untied
  int64_t params() const;
  // Parameters one token passes through (experts counted top_k times).
  int64_t active_params() const;

  // Model FLOPs of one sequence's forward and backward (6 per active matmul
  // parameter and token, plus attention's 12·L·h·s per token), without
  // recomputation: the numerator of MFU.
  double flops_per_sequence() const;

  // tessera's GPT (models/gpt.h) trained on sequences of `seq` tokens
  // (<= config.context; 0: the context).
  static ModelDesc gpt(const models::GPTConfig& config, int64_t seq = 0);
  // "llama-7b", "llama-13b", "llama-30b", "llama-65b" (Touvron et al. 2023);
  // GPTConfig's GPT-2 presets as "gpt-tiny", "gpt-small", "gpt-medium"; its
  // Llama-family presets by their own names ("llama3-8b", "mixtral-8x7b", ...).
  static ModelDesc preset(const std::string& name, int64_t seq);
  // Only the trainable parameter count of a module: the planner then plans
  // data parallelism and sharding (no tensor, sequence or pipeline modes).
  static ModelDesc from_module(const torch::nn::Module& module);

  // "gpt L12 h768 a12 s1024 v50257 (124.4M params)".
  std::string to_string() const;
};

}  // namespace planner
}  // namespace tessera
