#include "tessera/models/gpt.h"

#include "tessera/nn/activation_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/modules/container/any.h>

#include <cmath>
#include <limits>
#include <utility>

namespace tessera {
namespace models {

GPTConfig GPTConfig::preset(const std::string& name) {
  GPTConfig c;
  if (name == "tiny") {
    c.vocab = 101;  // deliberately not divisible by tensor sizes: exercises padding
    c.context = 32;
    c.layers = 2;
    c.heads = 4;
    c.hidden = 32;
    return c;
  }
  if (name == "small") return c;  // GPT-2 124M
  if (name == "medium") {
    c.layers = 24;
    c.heads = 16;
    c.hidden = 1024;
    return c;
  }
  TORCH_CHECK(false, "unknown GPT preset '", name, "'; presets: tiny, small, medium");
}

class GPTBlockImpl : public torch::nn::Module {
 public:
  GPTBlockImpl(const GPTConfig& c, nn::LayerFactory& f)
      : heads_(f.local_heads(c.heads)), head_dim_(c.hidden / c.heads), checkpoint_(c.checkpoint_activations) {
    TORCH_CHECK(c.hidden % c.heads == 0, "GPT hidden size ", c.hidden, " is not divisible by heads ", c.heads);
    ln_1 = f.layer_norm(c.hidden);
    c_attn = f.linear(c.hidden, 3 * c.hidden, nn::LinearRole::kColumn, true);
    attn_drop = f.dropout(c.dropout, nn::DropoutSite::kSharded);
    attn_proj = f.linear(c.hidden, c.hidden, nn::LinearRole::kRow, true);
    resid_drop_1 = f.dropout(c.dropout, nn::DropoutSite::kBlock);
    ln_2 = f.layer_norm(c.hidden);
    c_fc = f.linear(c.hidden, 4 * c.hidden, nn::LinearRole::kColumn, true);
    mlp_proj = f.linear(4 * c.hidden, c.hidden, nn::LinearRole::kRow, true);
    resid_drop_2 = f.dropout(c.dropout, nn::DropoutSite::kBlock);
    const std::pair<const char*, torch::nn::AnyModule*> children[] = {{"ln_1", &ln_1},
                                                                      {"c_attn", &c_attn},
                                                                      {"attn_drop", &attn_drop},
                                                                      {"attn_proj", &attn_proj},
                                                                      {"resid_drop_1", &resid_drop_1},
                                                                      {"ln_2", &ln_2},
                                                                      {"c_fc", &c_fc},
                                                                      {"mlp_proj", &mlp_proj},
                                                                      {"resid_drop_2", &resid_drop_2}};
    for (const auto& child : children) register_module(child.first, child.second->ptr());
  }

  at::Tensor forward(const at::Tensor& x) {
    if (!checkpoint_) return body(x);
    // Only x is kept for backward; the block's own dropouts replay their masks.
    return nn::checkpoint(
        *this, [this](const at::Tensor& in) { return body(in); }, x);
  }

  torch::nn::AnyModule ln_1, c_attn, attn_drop, attn_proj, resid_drop_1, ln_2, c_fc, mlp_proj, resid_drop_2;

 private:
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = x + resid_drop_1.forward(attn_proj.forward(attention(ln_1.forward(x))));
    return h + resid_drop_2.forward(mlp_proj.forward(at::gelu(c_fc.forward(ln_2.forward(h)))));
  }

  // [b, s, local heads · 3 · head_dim] (rows grouped per head) -> [b, s, local heads · head_dim].
  at::Tensor attention(const at::Tensor& x) {
    at::Tensor qkv = c_attn.forward(x);
    const int64_t b = qkv.size(0), s = qkv.size(1);
    qkv = qkv.view({b, s, heads_, 3, head_dim_}).permute({3, 0, 2, 1, 4});  // [3, b, h, s, d]
    at::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
    at::Tensor causal = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
    at::Tensor probs = attn_drop.forward(at::softmax(scores, -1));
    return at::matmul(probs, v).permute({0, 2, 1, 3}).reshape({b, s, heads_ * head_dim_});
  }

  int64_t heads_;
  int64_t head_dim_;
  bool checkpoint_;
};

namespace {

// ids [b, s] -> the first block's input.
at::Tensor embed(nn::LayerFactory& f, const GPTConfig& c, torch::nn::AnyModule& wte, torch::nn::AnyModule& wpe,
                 torch::nn::AnyModule& drop, const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2, "GPT expects token ids [batch, sequence], got shape ", ids.sizes());
  const int64_t s = ids.size(1);
  TORCH_CHECK(s <= c.context, "sequence length ", s, " exceeds the context length ", c.context);
  at::Tensor positions = f.positions(s).to(ids.device());
  return drop.forward(wte.forward(ids) + wpe.forward(positions));
}

// The pipeline's first and last layers (GPTImpl::as_sequential).
class GPTEmbeddingImpl : public torch::nn::Module {
 public:
  GPTEmbeddingImpl(GPTConfig c, std::shared_ptr<nn::LayerFactory> f, torch::nn::AnyModule wte, torch::nn::AnyModule wpe,
                   torch::nn::AnyModule drop)
      : c_(c), f_(std::move(f)), wte_(std::move(wte)), wpe_(std::move(wpe)), drop_(std::move(drop)) {
    register_module("wte", wte_.ptr());
    register_module("wpe", wpe_.ptr());
    register_module("drop", drop_.ptr());
  }
  at::Tensor forward(const at::Tensor& ids) { return embed(*f_, c_, wte_, wpe_, drop_, ids); }

 private:
  GPTConfig c_;
  std::shared_ptr<nn::LayerFactory> f_;
  torch::nn::AnyModule wte_, wpe_, drop_;
};

class GPTHeadImpl : public torch::nn::Module {
 public:
  GPTHeadImpl(std::shared_ptr<nn::LayerFactory> f, torch::nn::AnyModule ln_f, torch::nn::AnyModule lm, bool tied)
      : f_(std::move(f)), ln_f_(std::move(ln_f)), lm_(std::move(lm)) {
    register_module("ln_f", ln_f_.ptr());
    register_module(tied ? "wte" : "lm_head", lm_.ptr());
  }
  at::Tensor forward(const at::Tensor& x) { return f_->lm_logits(ln_f_.forward(x), lm_); }

 private:
  std::shared_ptr<nn::LayerFactory> f_;
  torch::nn::AnyModule ln_f_, lm_;
};

}  // namespace

GPTImpl::GPTImpl(const GPTConfig& config, std::shared_ptr<nn::LayerFactory> factory)
    : config_(config), factory_(std::move(factory)) {
  TORCH_CHECK(factory_ != nullptr, "GPT needs a layer factory");
  TORCH_CHECK(config_.vocab > 0 && config_.context > 0 && config_.layers > 0 && config_.heads > 0 && config_.hidden > 0,
              "GPT config sizes must be positive");
  nn::LayerFactory& f = *factory_;
  wte_ = f.vocab_embedding(config_.vocab, config_.hidden);
  wpe_ = f.position_embedding(config_.context, config_.hidden);
  drop_ = f.dropout(config_.dropout, nn::DropoutSite::kBlock);
  register_module("wte", wte_.ptr());
  register_module("wpe", wpe_.ptr());
  register_module("drop", drop_.ptr());
  for (int64_t i = 0; i < config_.layers; ++i) {
    blocks_.push_back(std::make_shared<GPTBlockImpl>(config_, f));
    register_module("h" + std::to_string(i), blocks_.back());
  }
  ln_f_ = f.layer_norm(config_.hidden);
  register_module("ln_f", ln_f_.ptr());
  if (!config_.tied) {
    lm_head_ = f.vocab_embedding(config_.vocab, config_.hidden);
    register_module("lm_head", lm_head_.ptr());
  }
  reset_parameters();
}

void GPTImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  const double std = 0.02, proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  std::map<std::string, at::Tensor> state;
  for (auto& n : named_layers()) {
    // Shapes come from the current full weights; values are drawn anew.
    auto full = factory_->full_weights(*n.layer);
    const bool norm = n.prefix.find("ln_") != std::string::npos;
    const bool proj = n.prefix.find("c_proj") != std::string::npos;
    at::Tensor w = norm ? at::ones_like(full.first) : at::empty_like(full.first).normal_(0.0, proj ? proj_std : std);
    state[n.prefix + ".weight"] = w;
    if (n.has_bias) state[n.prefix + ".bias"] = at::zeros_like(full.second);
  }
  load_full_state(state);
}

at::Tensor GPTImpl::forward(const at::Tensor& ids) {
  at::Tensor x = embed(*factory_, config_, wte_, wpe_, drop_, ids);
  for (auto& block : blocks_) x = block->forward(x);
  x = ln_f_.forward(x);
  return factory_->lm_logits(x, config_.tied ? wte_ : lm_head_);
}

torch::nn::Sequential GPTImpl::as_sequential() {
  torch::nn::Sequential seq;
  seq->push_back("embed", std::make_shared<GPTEmbeddingImpl>(config_, factory_, wte_, wpe_, drop_));
  for (size_t i = 0; i < blocks_.size(); ++i) seq->push_back("h" + std::to_string(i), blocks_[i]);
  seq->push_back("head", std::make_shared<GPTHeadImpl>(factory_, ln_f_, config_.tied ? wte_ : lm_head_, config_.tied));
  return seq;
}

at::Tensor GPTImpl::loss(const at::Tensor& logits, const at::Tensor& targets) {
  return factory_->loss(logits, targets, config_.vocab);
}

void GPTImpl::reduce_partial_gradients() { nn::reduce_partial_gradients(partial_gradients()); }
nn::PartialGradients GPTImpl::partial_gradients() { return factory_->partial_gradients(*this); }

std::vector<GPTImpl::Named> GPTImpl::named_layers() {
  std::vector<Named> out = {{"wte", &wte_, false}, {"wpe", &wpe_, false}};
  for (size_t i = 0; i < blocks_.size(); ++i) {
    GPTBlockImpl& b = *blocks_[i];
    const std::string p = "h." + std::to_string(i) + ".";
    out.push_back({p + "ln_1", &b.ln_1, true});
    out.push_back({p + "attn.c_attn", &b.c_attn, true});
    out.push_back({p + "attn.c_proj", &b.attn_proj, true});
    out.push_back({p + "ln_2", &b.ln_2, true});
    out.push_back({p + "mlp.c_fc", &b.c_fc, true});
    out.push_back({p + "mlp.c_proj", &b.mlp_proj, true});
  }
  out.push_back({"ln_f", &ln_f_, true});
  if (!config_.tied) out.push_back({"lm_head", &lm_head_, false});
  return out;
}

void GPTImpl::load_full_state(const std::map<std::string, at::Tensor>& state) {
  auto get = [&](const std::string& name) {
    auto it = state.find(name);
    TORCH_CHECK(it != state.end(), "GPT::load_full_state: '", name, "' is missing");
    return it->second;
  };
  for (auto& n : named_layers()) {
    factory_->load_full(*n.layer, get(n.prefix + ".weight"), n.has_bias ? get(n.prefix + ".bias") : at::Tensor());
  }
}

std::map<std::string, at::Tensor> GPTImpl::full_state(bool gradients) {
  std::map<std::string, at::Tensor> state;
  for (auto& n : named_layers()) {
    auto full = factory_->full_weights(*n.layer, gradients);
    state[n.prefix + ".weight"] = full.first;
    if (n.has_bias) state[n.prefix + ".bias"] = full.second;
  }
  return state;
}

std::vector<std::pair<std::string, nn::ParamPlacement>> GPTImpl::placements() {
  std::vector<std::pair<std::string, nn::ParamPlacement>> out;
  for (auto& n : named_layers()) {
    auto [weight, bias] = factory_->placements(*n.layer);
    out.emplace_back(n.prefix + ".weight", std::move(weight));
    if (n.has_bias) out.emplace_back(n.prefix + ".bias", std::move(bias));
  }
  return out;
}

}  // namespace models
}  // namespace tessera
