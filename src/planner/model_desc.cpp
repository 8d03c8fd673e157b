#include "tessera/planner/model_desc.h"

#include "tessera/core/compat.h"

#include "tessera/models/gpt.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <algorithm>

namespace tessera {
namespace planner {

int64_t ModelDesc::moe_blocks() const {
  int64_t n = 0;
  for (int64_t b = 0; b < layers_; ++b) n += moe_block(b) ? 1 : 0;
  return n;
}

std::vector<LinearShape> ModelDesc::block_linears() const {
  const int64_t h = hidden_, a = attention_width(), kv = kv_width(), f = ffn_width();
  std::vector<LinearShape> out;
  if (kv == a) {
    out.push_back({h, 3 * a, false});  // fused q, k, v
  } else {
    out.push_back({h, a, false});
    out.push_back({h, 2 * kv, false});
  }
  out.push_back({a, h, true});
  for (int i = 0; i + 1 < mlp_matrices_; ++i) out.push_back({h, f, false});  // (gate and) up
  out.push_back({f, h, true});
  return out;
}

int64_t ModelDesc::attention_params() const {
  const int64_t h = hidden_, a = attention_width(), kv = kv_width();
  return norm_params() + 2 * h * a + 2 * h * kv + (qkv_bias_ ? a + 2 * kv : 0) + (bias_ ? h : 0) +
         (qk_norm_ ? 2 * head_size() : 0);
}

int64_t ModelDesc::mlp_params() const {
  const int64_t h = hidden_, f = ffn_width();
  return norm_params() + mlp_matrices_ * h * f + (bias_ ? (mlp_matrices_ - 1) * f + h : 0);
}

int64_t ModelDesc::router_params() const { return hidden_ * experts_; }

int64_t ModelDesc::shared_params() const {
  const int64_t h = hidden_, f = shared_expert_ffn_;
  if (f == 0) return 0;
  return mlp_matrices_ * h * f + (bias_ ? (mlp_matrices_ - 1) * f + h : 0) + (shared_expert_gate_ ? h : 0);
}

int64_t ModelDesc::block_params(int64_t block) const {
  if (!moe_block(block)) return attention_params() + mlp_params();
  const int64_t norm = norm_params();
  return attention_params() + norm + router_params() + shared_params() + experts_ * (mlp_params() - norm);
}

int64_t ModelDesc::embedding_params() const { return (vocab_ + positions_) * hidden_; }

int64_t ModelDesc::head_params() const { return norm_params() + (tied_ ? 0 : vocab_ * hidden_); }

int64_t ModelDesc::params() const {
  if (opaque()) return opaque_params_;
  int64_t n = embedding_params() + head_params();
  for (int64_t b = 0; b < layers_; ++b) n += block_params(b);
  return n;
}

int64_t ModelDesc::active_params() const {
  if (opaque()) return opaque_params_;
  const int64_t norm = norm_params();
  const int64_t moe_active =
      attention_params() + norm + router_params() + shared_params() + top_k_ * (mlp_params() - norm);
  return params() + moe_blocks() * (moe_active - block_params(moe_every_ - 1));
}

double ModelDesc::flops_per_sequence() const {
  if (opaque()) return opaque_flops_per_row_;
  // Matmul parameters: everything but norms, biases and the position table;
  // the token embedding counts once, as the LM head's matmul.
  const double h = static_cast<double>(hidden_);
  const double norms = static_cast<double>(norm_params()) * (2 * layers_ + 1) +
                       (qk_norm_ ? 2.0 * static_cast<double>(head_size()) * layers_ : 0.0);
  double biases = qkv_bias_ ? static_cast<double>(layers_ * (attention_width() + 2 * kv_width())) : 0.0;
  if (bias_) {
    biases += layers_ * (h + (mlp_matrices_ - 1) * ffn_width() + h);
    biases += static_cast<double>(moe_blocks()) * (top_k_ - 1) * ((mlp_matrices_ - 1) * ffn_width() + h);
    if (shared_expert_ffn_ > 0)
      biases += static_cast<double>(moe_blocks()) * ((mlp_matrices_ - 1) * shared_expert_ffn_ + h);
  }
  double matmul = static_cast<double>(active_params()) - norms - biases - static_cast<double>(positions_) * h;
  if (!tied_) matmul -= static_cast<double>(vocab_) * h;  // the input embedding is a lookup
  const double s = static_cast<double>(seq_);
  return s * (6.0 * matmul + 12.0 * static_cast<double>(layers_) * static_cast<double>(attention_width()) * s);
}

ModelDesc ModelDesc::gpt(const models::GPTConfig& config, int64_t seq) {
  TORCH_CHECK(seq >= 0 && seq <= config.context(), "planner: sequence length ", seq, " is outside [0, the GPT's context ",
              config.context(), "]; 0 means the context");
  return ModelDesc()
      .name("gpt")
      .layers(config.layers())
      .hidden(config.hidden())
      .heads(config.heads())
      .vocab(config.vocab())
      .positions(config.positions() == models::Positions::kLearned ? config.context() : 0)
      .seq(seq == 0 ? config.context() : seq)
      .tied(config.tied())
      .ffn(config.ffn_size())
      .mlp_matrices(config.mlp() == nn::MLPKind::kSwiGLU ? 3 : 2)
      .bias(config.bias())
      .qkv_bias(config.qkv_bias())
      .rms_norm(config.norm() == nn::NormKind::kRMSNorm)
      .kv_heads(config.num_kv_heads())
      .head_dim(config.dim_per_head())
      .qk_norm(config.qk_norm())
      .experts(config.experts())
      .moe_every(config.moe_every())
      .top_k(config.top_k())
      .shared_expert_ffn(config.shared_expert_ffn())
      .shared_expert_gate(config.shared_expert_gate())
      // Note [Fused attention] in src/nn/attention.cpp: tessera's attention
      // keeps no scores when it drops nothing, fused on LibTorch 2 and in
      // tiles on 1.13 (except bf16 on CPU, which the planner does not tell
      // apart: it counts the scores as not kept there too).
      .fused_attention(config.dropout() == 0);
}

ModelDesc ModelDesc::preset(const std::string& name, int64_t seq) {
  auto llama = [&](int64_t layers, int64_t hidden, int64_t heads, int64_t ffn) {
    return ModelDesc()
        .name(name)
        .layers(layers)
        .hidden(hidden)
        .heads(heads)
        .ffn(ffn)
        .vocab(32000)
        .positions(0)
        .seq(seq)
        .tied(false)
        .mlp_matrices(3)
        .bias(false)
        .qkv_bias(false)
        .rms_norm(true);
  };
  if (name == "llama-7b") return llama(32, 4096, 32, 11008);
  if (name == "llama-13b") return llama(40, 5120, 40, 13824);
  if (name == "llama-30b") return llama(60, 6656, 52, 17920);
  if (name == "llama-65b") return llama(80, 8192, 64, 22016);
  const auto family = models::GPTConfig::preset_names();
  const bool gpt2 = name.rfind("gpt-", 0) == 0;  // family's first three are GPT-2's, named gpt-*
  if (gpt2 || std::find(family.begin() + 3, family.end(), name) != family.end()) {
    models::GPTConfig c = models::GPTConfig::preset(gpt2 ? name.substr(4) : name);
    c.context(std::max(c.context(), seq));
    return gpt(c, seq).name(name);
  }
  std::string names = "llama-7b, llama-13b, llama-30b, llama-65b, gpt-tiny, gpt-small, gpt-medium";
  for (auto it = family.begin() + 3; it != family.end(); ++it) names += ", " + *it;
  TORCH_CHECK(false, "planner: unknown model preset '", name, "'; presets: ", names);
}

ModelDesc ModelDesc::from_module(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters())
    if (p.requires_grad()) n += p.numel();
  TORCH_CHECK(n > 0, "planner: the module has no trainable parameters");
  return ModelDesc().name(module.name()).opaque_params(n).layers(0);
}

std::string ModelDesc::to_string() const {
  if (opaque()) return fmt::format("{} ({:.1f}M params)", name_, params() / 1e6);
  std::string s = fmt::format("{} L{} h{} a{} s{} v{}", name_, layers_, hidden_, heads_, seq_, vocab_);
  if (experts_ > 0) s += fmt::format(" e{}/{}k{}", experts_, moe_every_, top_k_);
  if (shared_expert_ffn_ > 0) s += fmt::format(" shared{}{}", shared_expert_ffn_, shared_expert_gate_ ? "g" : "");
  return s + fmt::format(" ({:.1f}M params)", params() / 1e6);
}

}  // namespace planner
}  // namespace tessera
