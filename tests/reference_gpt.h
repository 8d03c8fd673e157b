#pragma once
// The reference GPT of the serial-equivalence tests: a GPT-2-style model
// written with plain LibTorch tensor operations and nothing from tessera, so
// that a bug in tessera's own GPT (include/tessera/models/gpt.h) cannot hide
// on the serial side of a "parallel equals serial" test.
//
// Token and position embeddings, dropout, N pre-LayerNorm blocks of causal
// multi-head self-attention and a 4h exact-GELU MLP, final LayerNorm, an LM
// head tied to the token embedding (or a separate lm_head), and mean cross
// entropy with ignore_index -100. With experts > 0, every moe_every-th block
// has a dropless mixture of experts in place of its MLP: a bias-free router,
// softmax, top-k gates (renormalized by option), every expert run on every
// token and the outputs mixed by a dense [tokens, experts] gate matrix
// (nothing of tessera's sort-and-dispatch); aux_loss() gives the weighted
// load-balancing and z losses of the last forward over its tokens.
//
// Its parameters carry the names and shapes of tessera's GPT::full_state()
// (Note [GPT full weights]): "wte.weight", "wpe.weight",
// "h.<i>.ln_1.{weight,bias}", "h.<i>.attn.c_attn.{weight,bias}",
// "h.<i>.attn.c_proj.{weight,bias}", "h.<i>.ln_2.{weight,bias}",
// "h.<i>.mlp.c_fc.{weight,bias}", "h.<i>.mlp.c_proj.{weight,bias}",
// "ln_f.{weight,bias}" and, untied, "lm_head.weight". Linear weights are
// [out, in]; c_attn's [3h, h] rows are grouped per head (head 0's q, k, v
// rows, then head 1's, ...).
//
// Construction draws nothing from the default generator (weights start at
// zero, LayerNorm at one): load_full_state() gives the model its weights.
#include "module_state.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace test {

struct ReferenceGPTConfig {
  int64_t vocab = 101;
  int64_t context = 32;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t hidden = 32;
  double dropout = 0.0;
  bool tied = true;
  int64_t experts = 0;
  int64_t moe_every = 1;
  int64_t top_k = 1;
  bool renormalize = false;
  double aux_loss_coef = 0;
  double z_loss_coef = 0;
  int64_t shared_expert_ffn = 0;  // the shared experts' width; 0: none
  bool shared_expert_gate = false;
};

// From any config with these fields (models::GPTConfig), without naming it.
template <typename Config>
ReferenceGPTConfig reference_config(const Config& c) {
  ReferenceGPTConfig r;
  r.vocab = c.vocab();
  r.context = c.context();
  r.layers = c.layers();
  r.heads = c.heads();
  r.hidden = c.hidden();
  r.dropout = c.dropout();
  r.tied = c.tied();
  r.experts = c.experts();
  r.moe_every = c.moe_every();
  r.top_k = c.top_k();
  r.renormalize = c.renormalize();
  r.aux_loss_coef = c.aux_loss_coef();
  r.z_loss_coef = c.z_loss_coef();
  r.shared_expert_ffn = c.shared_expert_ffn();
  r.shared_expert_gate = c.shared_expert_gate();
  return r;
}

namespace reference_detail {

// y = x W^T + b, W [out, in].
struct LinearImpl : torch::nn::Module {
  LinearImpl(int64_t in, int64_t out) {
    weight = register_parameter("weight", torch::zeros({out, in}));
    bias = register_parameter("bias", torch::zeros({out}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return at::linear(x, weight, bias); }
  torch::Tensor weight, bias;
};

struct LayerNormImpl : torch::nn::Module {
  explicit LayerNormImpl(int64_t dim) : shape{dim} {
    weight = register_parameter("weight", torch::ones({dim}));
    bias = register_parameter("bias", torch::zeros({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return at::layer_norm(x, shape, weight, bias, 1e-5); }
  std::vector<int64_t> shape;
  torch::Tensor weight, bias;
};

// A [rows, dim] table: token and position embeddings, the untied LM head.
struct TableImpl : torch::nn::Module {
  TableImpl(int64_t rows, int64_t dim) { weight = register_parameter("weight", torch::zeros({rows, dim})); }
  torch::Tensor forward(const torch::Tensor& ids) { return at::embedding(weight, ids); }
  torch::Tensor weight;
};

// Skipped at p = 0 (then it draws nothing). Not named dropout: at::dropout is found by ADL.
inline torch::Tensor apply_dropout(const torch::Tensor& x, double p, bool training) {
  return p > 0 ? at::dropout(x, p, training) : x;
}

// Causal multi-head self-attention; c_attn's rows grouped per head.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t hidden, int64_t n_heads, double drop) : heads(n_heads), head_dim(hidden / n_heads), p(drop) {
    c_attn = register_module("c_attn", std::make_shared<LinearImpl>(hidden, 3 * hidden));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(hidden, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1);
    // [b, s, heads, 3, head_dim]: per head, its q, k and v features in turn.
    const torch::Tensor qkv = c_attn->forward(x).reshape({b, s, heads, 3, head_dim});
    const torch::Tensor q = qkv.select(3, 0).transpose(1, 2);  // [b, heads, s, head_dim]
    const torch::Tensor k = qkv.select(3, 1).transpose(1, 2);
    const torch::Tensor v = qkv.select(3, 2).transpose(1, 2);
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    const torch::Tensor future =
        torch::ones({s, s}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    const torch::Tensor probs = apply_dropout(torch::softmax(scores, -1), p, is_training());
    const torch::Tensor y = torch::matmul(probs, v).transpose(1, 2).reshape({b, s, heads * head_dim});
    return c_proj->forward(y);
  }
  int64_t heads, head_dim;
  double p;
  std::shared_ptr<LinearImpl> c_attn, c_proj;
};

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(int64_t hidden, int64_t width = 0) {
    if (width == 0) width = 4 * hidden;
    c_fc = register_module("c_fc", std::make_shared<LinearImpl>(hidden, width));
    c_proj = register_module("c_proj", std::make_shared<LinearImpl>(width, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c_proj->forward(at::gelu(c_fc->forward(x))); }  // exact GELU
  std::shared_ptr<LinearImpl> c_fc, c_proj;
};

// Stacked expert weights: weight [E, out, in], bias [E, out].
struct ExpertsLinearImpl : torch::nn::Module {
  ExpertsLinearImpl(int64_t experts, int64_t in, int64_t out) {
    weight = register_parameter("weight", torch::zeros({experts, out, in}));
    bias = register_parameter("bias", torch::zeros({experts, out}));
  }
  torch::Tensor weight, bias;
};

// Dropless top-k mixture of 4h GELU experts over all tokens of the call,
// plus, by option, a shared GELU MLP on every token, gated by sigmoid(g · x).
struct MoEImpl : torch::nn::Module {
  MoEImpl(int64_t hidden, const ReferenceGPTConfig& c) : experts(c.experts), top_k(c.top_k), renorm(c.renormalize) {
    router = register_module("router", std::make_shared<TableImpl>(experts, hidden));
    c_fc = register_module("c_fc", std::make_shared<ExpertsLinearImpl>(experts, hidden, 4 * hidden));
    c_proj = register_module("c_proj", std::make_shared<ExpertsLinearImpl>(experts, 4 * hidden, hidden));
    if (c.shared_expert_ffn > 0)
      shared = register_module("shared_expert", std::make_shared<MLPImpl>(hidden, c.shared_expert_ffn));
    if (c.shared_expert_gate)
      shared_gate = register_module("shared_expert_gate", std::make_shared<TableImpl>(1, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor t = x.reshape({-1, x.size(-1)});  // [T, h]
    const torch::Tensor logits = torch::matmul(t, router->weight.t());
    const torch::Tensor probs = torch::softmax(logits, -1);
    const auto top = probs.topk(top_k, -1);
    torch::Tensor gates = std::get<0>(top);
    if (renorm) gates = gates / gates.sum(-1, true);
    const torch::Tensor dense = torch::zeros_like(probs).scatter(1, std::get<1>(top), gates);  // [T, E]
    // Every expert on every token: [E, T, 4h] then [E, T, h].
    const torch::Tensor hid =
        at::gelu(torch::einsum("th,efh->etf", {t, c_fc->weight}) + c_fc->bias.unsqueeze(1));
    const torch::Tensor y = torch::einsum("etf,ehf->eth", {hid, c_proj->weight}) + c_proj->bias.unsqueeze(1);
    // f_i: share of the T·k assignments routed to i; P_i: mean probability.
    const torch::Tensor f = torch::zeros({experts}, t.options()).index_add(
        0, std::get<1>(top).reshape({-1}), torch::ones({t.size(0) * top_k}, t.options()));
    aux = experts * (f / static_cast<double>(t.size(0) * top_k) * probs.mean(0)).sum();
    const torch::Tensor lse = torch::logsumexp(logits, -1);
    z = (lse * lse).mean();
    torch::Tensor out = torch::einsum("te,eth->th", {dense, y});
    if (shared) {
      torch::Tensor s = shared->forward(t);
      if (shared_gate) s = s * torch::sigmoid(torch::matmul(t, shared_gate->weight.t()));
      out = out + s;
    }
    return out.reshape(x.sizes());
  }
  int64_t experts, top_k;
  bool renorm;
  std::shared_ptr<MLPImpl> shared;
  std::shared_ptr<TableImpl> router, shared_gate;
  std::shared_ptr<ExpertsLinearImpl> c_fc, c_proj;
  torch::Tensor aux, z;  // of the last forward
};

// Pre-LayerNorm block: x + drop(attn(ln_1(x))), then h + drop(mlp(ln_2(h))).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t hidden, int64_t heads, double drop, const ReferenceGPTConfig* moe_config = nullptr) : p(drop) {
    ln_1 = register_module("ln_1", std::make_shared<LayerNormImpl>(hidden));
    attn = register_module("attn", std::make_shared<AttentionImpl>(hidden, heads, drop));
    ln_2 = register_module("ln_2", std::make_shared<LayerNormImpl>(hidden));
    if (moe_config)
      moe = register_module("mlp", std::make_shared<MoEImpl>(hidden, *moe_config));
    else
      mlp = register_module("mlp", std::make_shared<MLPImpl>(hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = x + apply_dropout(attn->forward(ln_1->forward(x)), p, is_training());
    const torch::Tensor m = ln_2->forward(h);
    return h + apply_dropout(moe ? moe->forward(m) : mlp->forward(m), p, is_training());
  }
  double p;
  std::shared_ptr<LayerNormImpl> ln_1, ln_2;
  std::shared_ptr<AttentionImpl> attn;
  std::shared_ptr<MLPImpl> mlp;
  std::shared_ptr<MoEImpl> moe;
};

}  // namespace reference_detail

class ReferenceGPTImpl : public torch::nn::Module {
 public:
  explicit ReferenceGPTImpl(const ReferenceGPTConfig& config) : config_(config) {
    TORCH_CHECK(config_.vocab > 0 && config_.context > 0 && config_.layers > 0 && config_.heads > 0 &&
                    config_.hidden > 0,
                "reference GPT: config sizes must be positive");
    TORCH_CHECK(config_.hidden % config_.heads == 0, "reference GPT: hidden ", config_.hidden,
                " is not divisible by heads ", config_.heads);
    namespace d = reference_detail;
    wte_ = register_module("wte", std::make_shared<d::TableImpl>(config_.vocab, config_.hidden));
    wpe_ = register_module("wpe", std::make_shared<d::TableImpl>(config_.context, config_.hidden));
    // Submodule names cannot hold a dot: "h" holds "0", "1", ... ("h.0.ln_1.weight").
    auto h = register_module("h", std::make_shared<torch::nn::Module>());
    for (int64_t i = 0; i < config_.layers; ++i) {
      const bool moe = config_.experts > 0 && (i + 1) % config_.moe_every == 0;
      blocks_.push_back(
          std::make_shared<d::BlockImpl>(config_.hidden, config_.heads, config_.dropout, moe ? &config_ : nullptr));
      h->register_module(std::to_string(i), blocks_.back());
    }
    ln_f_ = register_module("ln_f", std::make_shared<d::LayerNormImpl>(config_.hidden));
    if (!config_.tied)
      lm_head_ = register_module("lm_head", std::make_shared<d::TableImpl>(config_.vocab, config_.hidden));
  }

  // ids [b, s] (s <= context) -> logits [b, s, vocab].
  torch::Tensor forward(const torch::Tensor& ids) {
    TORCH_CHECK(ids.dim() == 2, "reference GPT expects token ids [batch, sequence], got shape ", ids.sizes());
    const int64_t s = ids.size(1);
    TORCH_CHECK(s <= config_.context, "reference GPT: sequence length ", s, " exceeds the context ", config_.context);
    const torch::Tensor positions = torch::arange(s, torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
    torch::Tensor x =
        reference_detail::apply_dropout(wte_->forward(ids) + wpe_->forward(positions), config_.dropout, is_training());
    for (auto& block : blocks_) x = block->forward(x);
    x = ln_f_->forward(x);
    const torch::Tensor& head = config_.tied ? wte_->weight : lm_head_->weight;
    return torch::matmul(x, head.t());
  }

  // Mean cross entropy of logits [b, s, vocab] against targets [b, s], ignore_index -100.
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
  }

  // Σ over MoE blocks of aux_loss_coef · load-balancing loss + z_loss_coef ·
  // z-loss of the last forward (zero without experts).
  torch::Tensor aux_loss() {
    torch::Tensor sum = torch::zeros({});
    for (auto& block : blocks_)
      if (block->moe) sum = sum + config_.aux_loss_coef * block->moe->aux + config_.z_loss_coef * block->moe->z;
    return sum;
  }

  // Copies every parameter from `state` (GPT::full_state() names and shapes);
  // a missing, extra or misshapen entry is an error.
  void load_full_state(const std::map<std::string, torch::Tensor>& state) {
    torch::NoGradGuard no_grad;
    auto params = named_parameters();
    TORCH_CHECK(state.size() == params.size(), "reference GPT: load_full_state got ", state.size(),
                " tensors, the model has ", params.size());
    for (auto& p : params) {
      auto it = state.find(p.key());
      TORCH_CHECK(it != state.end(), "reference GPT: load_full_state: '", p.key(), "' is missing");
      TORCH_CHECK(it->second.sizes() == p.value().sizes(), "reference GPT: '", p.key(), "' has shape ",
                  it->second.sizes(), ", expected ", p.value().sizes());
      p.value().copy_(it->second);
    }
  }

  // Copies of the parameters (or, with gradients = true, of their gradients,
  // zeros where none) under GPT::full_state() names.
  std::map<std::string, torch::Tensor> full_state(bool gradients = false) { return module_state(*this, gradients); }

  const ReferenceGPTConfig& config() const { return config_; }

 private:
  ReferenceGPTConfig config_;
  std::shared_ptr<reference_detail::TableImpl> wte_, wpe_, lm_head_;
  std::vector<std::shared_ptr<reference_detail::BlockImpl>> blocks_;
  std::shared_ptr<reference_detail::LayerNormImpl> ln_f_;
};

TORCH_MODULE(ReferenceGPT);

}  // namespace test
}  // namespace tessera
