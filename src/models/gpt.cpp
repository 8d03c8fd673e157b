#include "tessera/models/gpt.h"

#include "tessera/nn/activation_checkpoint.h"
#include "tessera/nn/init.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/modules/container/any.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

namespace tessera {
namespace models {

GPTConfig GPTConfig::preset(const std::string& name) {
  GPTConfig c;
  if (name == "tiny") {
    c.vocab(101);  // deliberately not divisible by tensor sizes: exercises padding
    c.context(32);
    c.layers(2);
    c.heads(4);
    c.hidden(32);
    return c;
  }
  if (name == "small") return c;  // GPT-2 124M
  if (name == "medium") {
    c.layers(24);
    c.heads(16);
    c.hidden(1024);
    return c;
  }
  TORCH_CHECK(false, "unknown GPT preset '", name, "'; presets: tiny, small, medium");
}

class GPTBlockImpl : public torch::nn::Module {
 public:
  GPTBlockImpl(const GPTConfig& c, nn::LayerFactory& f, bool moe, std::shared_ptr<nn::MoELossScale> aux_loss_scale)
      : f_(f), heads_(f.local_heads(c.heads())), head_dim_(c.hidden() / c.heads()), checkpoint_(c.checkpoint_activations()) {
    TORCH_CHECK(c.hidden() % c.heads() == 0, "GPT hidden size ", c.hidden(), " is not divisible by heads ", c.heads());
    ln_1 = f.layer_norm(c.hidden());
    c_attn = f.linear(c.hidden(), 3 * c.hidden(), nn::LinearRole::kColumn, true);
    core_attention = f.core_attention(c.heads(), head_dim_, c.dropout());
    attn_proj = f.linear(c.hidden(), c.hidden(), nn::LinearRole::kRow, true);
    resid_drop_1 = f.dropout(c.dropout(), nn::DropoutSite::kBlock);
    ln_2 = f.layer_norm(c.hidden());
    mlp = moe ? f.moe(nn::MoEOptions(c.hidden(), 4 * c.hidden(), c.experts())
                          .top_k(c.top_k())
                          .renormalize(c.renormalize())
                          .capacity_factor(c.capacity_factor())
                          .drop_policy(c.drop_policy())
                          .aux_loss_coef(c.aux_loss_coef())
                          .z_loss_coef(c.z_loss_coef()),
                      std::move(aux_loss_scale))
              : f.mlp(c.hidden(), 4 * c.hidden());
    resid_drop_2 = f.dropout(c.dropout(), nn::DropoutSite::kBlock);
    const std::pair<const char*, torch::nn::AnyModule*> children[] = {
        {"ln_1", &ln_1}, {"c_attn", &c_attn}, {"core_attention", &core_attention}, {"attn_proj", &attn_proj},
        {"resid_drop_1", &resid_drop_1}, {"ln_2", &ln_2}, {"mlp", &mlp}, {"resid_drop_2", &resid_drop_2}};
    for (const auto& child : children) register_module(child.first, child.second->ptr());
  }

  at::Tensor forward(const at::Tensor& x) {
    if (!checkpoint_) return body(x);
    // Only x is kept for backward; the block's own dropouts replay their masks.
    return nn::checkpoint(
        *this, [this](const at::Tensor& in) { return body(in); }, x);
  }

  torch::nn::AnyModule ln_1, c_attn, core_attention, attn_proj, resid_drop_1, ln_2, mlp, resid_drop_2;

 private:
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = x + resid_drop_1.forward(attn_proj.forward(attention(ln_1.forward(x))));
    return h + resid_drop_2.forward(mlp.forward(ln_2.forward(h)));
  }

  // [b, s, local heads · 3 · head_dim] (rows grouped per head) -> [b, s, local heads · head_dim].
  at::Tensor attention(const at::Tensor& x) {
    at::Tensor qkv = c_attn.forward(x);
    const int64_t b = qkv.size(0), s = qkv.size(1);
    qkv = qkv.view({b, s, heads_, 3, head_dim_}).permute({3, 0, 2, 1, 4});  // [3, b, h, s, d]
    at::Tensor out = core_attention.forward(qkv[0], qkv[1], qkv[2], f_.attention_positions(s));
    return out.permute({0, 2, 1, 3}).reshape({b, s, heads_ * head_dim_});
  }

  nn::LayerFactory& f_;
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
  TORCH_CHECK(s <= c.context(), "sequence length ", s, " exceeds the context length ", c.context());
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
  TORCH_CHECK(config_.vocab() > 0 && config_.context() > 0 && config_.layers() > 0 && config_.heads() > 0 && config_.hidden() > 0,
              "GPT config sizes must be positive");
  nn::LayerFactory& f = *factory_;
  wte_ = f.vocab_embedding(config_.vocab(), config_.hidden());
  wpe_ = f.position_embedding(config_.context(), config_.hidden());
  drop_ = f.dropout(config_.dropout(), nn::DropoutSite::kBlock);
  register_module("wte", wte_.ptr());
  register_module("wpe", wpe_.ptr());
  register_module("drop", drop_.ptr());
  TORCH_CHECK(config_.experts() >= 0 && config_.moe_every() >= 1, "GPT: experts (", config_.experts(),
              ") must be >= 0 and moe_every (", config_.moe_every(), ") >= 1");
  TORCH_CHECK(config_.experts() > 0 || f.expert_size() == 1, "GPT: expert size ", f.expert_size(),
              " is configured, but the model has no mixture-of-experts blocks (experts 0); set experts or expert "
              "size 1");
  TORCH_CHECK(config_.experts() == 0 || config_.moe_every() <= config_.layers(), "GPT: moe_every ", config_.moe_every(),
              " exceeds the ", config_.layers(), " layers, so no block would have experts; lower moe_every");
  for (int64_t i = 0; i < config_.layers(); ++i) {
    blocks_.push_back(std::make_shared<GPTBlockImpl>(config_, f, config_.moe_block(i), aux_loss_scale_));
    register_module("h" + std::to_string(i), blocks_.back());
  }
  ln_f_ = f.layer_norm(config_.hidden());
  register_module("ln_f", ln_f_.ptr());
  if (!config_.tied()) {
    lm_head_ = f.vocab_embedding(config_.vocab(), config_.hidden());
    register_module("lm_head", lm_head_.ptr());
  }
  reset_parameters();
}

void GPTImpl::reset_parameters() {
  // Note [Layout-independent initialization]: one seed from the default
  // generator, each rank draws the blocks of its own region only.
  const uint64_t seed = nn::draw_seed();
  const double std = 0.02, proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers()));
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : placements()) {
    const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (bias) {
      p.param.detach().zero_();
    } else if (name.find("ln_") != std::string::npos) {
      p.param.detach().fill_(1.0);
    } else {
      const bool proj = name.find("c_proj") != std::string::npos;
      nn::init_blockwise(p, seed, name, nn::normal_draw(0.0, proj ? proj_std : std));
    }
  }
}

at::Tensor GPTImpl::forward(const at::Tensor& ids) {
  at::Tensor x = embed(*factory_, config_, wte_, wpe_, drop_, ids);
  for (auto& block : blocks_) x = block->forward(x);
  x = ln_f_.forward(x);
  return factory_->lm_logits(x, config_.tied() ? wte_ : lm_head_);
}

torch::nn::Sequential GPTImpl::as_sequential() {
  torch::nn::Sequential seq;
  seq->push_back("embed", std::make_shared<GPTEmbeddingImpl>(config_, factory_, wte_, wpe_, drop_));
  for (size_t i = 0; i < blocks_.size(); ++i) seq->push_back("h" + std::to_string(i), blocks_[i]);
  seq->push_back("head", std::make_shared<GPTHeadImpl>(factory_, ln_f_, config_.tied() ? wte_ : lm_head_, config_.tied()));
  return seq;
}

at::Tensor GPTImpl::loss(const at::Tensor& logits, const at::Tensor& targets) {
  return factory_->loss(logits, targets, config_.vocab());
}

std::vector<nn::MoEStats> GPTImpl::moe_stats() const {
  std::vector<nn::MoEStats> out;
  for (const auto& block : blocks_)
    if (auto moe = std::dynamic_pointer_cast<nn::MoEImpl>(block->mlp.ptr())) out.push_back(moe->last_stats());
  return out;
}

MoEBalance GPTImpl::moe_balance(comm::Communicator& world) const {
  MoEBalance b;
  if (config_.experts() == 0) return b;
  double layers = 0;
  for (const auto& s : moe_stats()) {
    if (s.tokens_per_expert.empty()) continue;  // a block of another pipeline stage
    double total = 0, most = 0;
    for (int64_t t : s.tokens_per_expert) {
      total += static_cast<double>(t);
      most = std::max(most, static_cast<double>(t));
    }
    const double mean = total / static_cast<double>(s.tokens_per_expert.size());
    b.max_over_mean = std::max(b.max_over_mean, mean > 0 ? most / mean : 0.0);
    b.aux_loss += s.aux_loss;
    b.dropped += static_cast<double>(s.dropped);
    layers += 1;
  }
  // A layer's statistics are global already, but each pipeline stage holds
  // its own layers: sums over the world divided by the number of (rank,
  // layer) pairs count every layer's replicas alike.
  at::Tensor sums = at::tensor({b.aux_loss, b.dropped, layers}, at::kDouble);
  at::Tensor most = at::tensor({b.max_over_mean}, at::kDouble);
  auto control = world.control();
  control->all_reduce(sums)->wait();
  control->all_reduce(most, comm::AllReduceOptions{comm::ReduceOp::kMax})->wait();
  const double pairs = std::max(1.0, sums[2].item<double>());
  b.aux_loss = sums[0].item<double>() / pairs;
  b.dropped = sums[1].item<double>() / pairs;
  b.max_over_mean = most[0].item<double>();
  return b;
}

void GPTImpl::reduce_partial_gradients() { nn::reduce_partial_gradients(placements()); }

void GPTImpl::load_full_state(const std::map<std::string, at::Tensor>& state) {
  for (const auto& [name, p] : placements()) {
    auto it = state.find(name);
    TORCH_CHECK(it != state.end(), "GPT::load_full_state: '", name, "' is missing");
    TORCH_CHECK(it->second.sizes().vec() == p.full_shape, "GPT::load_full_state: '", name, "' has shape ",
                it->second.sizes(), ", this model's is ", c10::IntArrayRef(p.full_shape));
    nn::load_full(p, it->second);
  }
}

std::map<std::string, at::Tensor> GPTImpl::full_state(bool gradients) {
  std::map<std::string, at::Tensor> state;
  for (const auto& [name, p] : placements()) state[name] = nn::full_value(p, gradients);
  return state;
}

namespace {

// Module names -> GPT-2's: "h3.c_attn.weight" -> "h.3.attn.c_attn.weight"
// (Note [GPT full weights]).
std::string gpt2_name(const std::string& name) {
  if (name.size() < 2 || name[0] != 'h' || !std::isdigit(static_cast<unsigned char>(name[1]))) return name;
  const auto dot = name.find('.');
  std::string rest = name.substr(dot + 1);
  if (rest.rfind("c_attn.", 0) == 0) rest = "attn." + rest;
  if (rest.rfind("attn_proj.", 0) == 0) rest = "attn.c_proj." + rest.substr(10);
  return "h." + name.substr(1, dot - 1) + "." + rest;
}

}  // namespace

nn::NamedPlacements GPTImpl::placements() {
  nn::NamedPlacements out = factory_->placements(*this);
  for (auto& entry : out) entry.first = gpt2_name(entry.first);
  return out;
}

}  // namespace models
}  // namespace tessera
