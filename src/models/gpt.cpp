#include "tessera/models/gpt.h"

#include "tessera/nn/activation_checkpoint.h"
#include "tessera/nn/init.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/any.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

namespace tessera {
namespace models {

namespace {

// Test-sized shapes of each architecture: a vocabulary no tensor size
// divides (exercises padding), head dimension 8.
GPTConfig tiny_shape(GPTConfig c) { return c.vocab(101).context(32).layers(2).heads(4).hidden(32); }

GPTConfig llama_family(GPTConfig c) {
  return c.norm(nn::NormKind::kRMSNorm)
      .positions(Positions::kRotary)
      .mlp(nn::MLPKind::kSwiGLU)
      .bias(false)
      .qkv_bias(false)
      .tied(false);
}

}  // namespace

GPTConfig GPTConfig::preset(const std::string& name) {
  GPTConfig c;
  if (name == "tiny") return tiny_shape(c);
  if (name == "small") return c;  // GPT-2 124M
  if (name == "medium") return c.layers(24).heads(16).hidden(1024);
  const GPTConfig llama = llama_family(GPTConfig());
  const nn::Llama3RopeScaling llama31;  // Llama 3.1: factor 8 from an 8192-token original context
  if (name == "llama3-8b")
    return GPTConfig(llama).vocab(128256).context(131072).layers(32).heads(32).kv_heads(8).hidden(4096).ffn(14336)
        .rope_theta(500000).rope_scaling(llama31);
  if (name == "llama3-70b")
    return GPTConfig(llama).vocab(128256).context(131072).layers(80).heads(64).kv_heads(8).hidden(8192).ffn(28672)
        .rope_theta(500000).rope_scaling(llama31);
  if (name == "mistral-7b")  // v0.3: no sliding window
    return GPTConfig(llama).vocab(32768).context(32768).layers(32).heads(32).kv_heads(8).hidden(4096).ffn(14336)
        .rope_theta(1e6);
  if (name == "mixtral-8x7b")
    return GPTConfig(llama).vocab(32000).context(32768).layers(32).heads(32).kv_heads(8).hidden(4096).ffn(14336)
        .rope_theta(1e6).experts(8).top_k(2).renormalize(true).aux_loss_coef(0.02).z_loss_coef(0);
  if (name == "qwen2.5-7b")
    return GPTConfig(llama).vocab(152064).context(32768).layers(28).heads(28).kv_heads(4).hidden(3584).ffn(18944)
        .rope_theta(1e6).norm_eps(1e-6).qkv_bias(true);
  if (name == "qwen3-8b")
    return GPTConfig(llama).vocab(151936).context(40960).layers(36).heads(32).kv_heads(8).head_dim(128).hidden(4096)
        .ffn(12288).rope_theta(1e6).norm_eps(1e-6).qk_norm(true);
  // Scaled so that all three of llama3's frequency bands occur at head_dim 8.
  if (name == "llama-tiny")
    return tiny_shape(llama).kv_heads(2).ffn(48).rope_theta(500000).rope_scaling(
        nn::Llama3RopeScaling().factor(4).original_context(64));
  if (name == "mistral-tiny") return tiny_shape(llama).kv_heads(2).ffn(48).rope_theta(1e6);
  if (name == "qwen2-tiny") return tiny_shape(llama).kv_heads(2).ffn(48).norm_eps(1e-6).qkv_bias(true);
  if (name == "qwen3-tiny") return tiny_shape(llama).kv_heads(2).head_dim(16).ffn(48).norm_eps(1e-6).qk_norm(true);
  if (name == "mixtral-tiny")
    return tiny_shape(llama).kv_heads(2).ffn(48).experts(4).top_k(2).renormalize(true).aux_loss_coef(0.02)
        .z_loss_coef(0);
  std::string names;
  for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "unknown model preset '", name, "'; presets: ", names);
}

std::vector<std::string> GPTConfig::preset_names() {
  return {// GPT-2
          "tiny", "small", "medium",
          // the Llama family
          "llama3-8b", "llama3-70b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen3-8b",
          // test-sized
          "llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny"};
}

namespace {

const char* norm_name(nn::NormKind k) { return k == nn::NormKind::kRMSNorm ? "rmsnorm" : "layernorm"; }
const char* positions_name(Positions p) { return p == Positions::kRotary ? "rotary" : "learned"; }
const char* mlp_name(nn::MLPKind k) {
  return k == nn::MLPKind::kSwiGLU ? "swiglu" : k == nn::MLPKind::kGeluTanh ? "gelu-tanh" : "gelu";
}

template <typename T>
T named(const nlohmann::json& j, const char* key, T fallback, const std::vector<std::pair<std::string, T>>& names) {
  if (!j.contains(key)) return fallback;
  const std::string v = j.at(key).get<std::string>();
  for (const auto& [name, value] : names)
    if (name == v) return value;
  TORCH_CHECK(false, "model config: \"", key, "\" is '", v, "', not one of its names");
}

}  // namespace

std::string GPTConfig::to_json() const {
  nlohmann::json j = {{"vocab", vocab_},       {"context", context_},         {"layers", layers_},
                      {"heads", heads_},       {"hidden", hidden_},           {"tied", tied_},
                      {"kv_heads", num_kv_heads()}, {"head_dim", dim_per_head()}, {"norm", norm_name(norm_)},
                      {"norm_eps", norm_eps_}, {"positions", positions_name(positions_)}, {"rope_theta", rope_theta_},
                      {"mlp", mlp_name(mlp_)}, {"ffn", ffn_size()},           {"bias", bias_},
                      {"qkv_bias", qkv_bias_}, {"qk_norm", qk_norm_},         {"experts", experts_},
                      {"moe_every", moe_every_}, {"top_k", top_k_},           {"renormalize", renormalize_}};
  if (shared_expert_ffn_ > 0)
    j["shared_expert_ffn"] = shared_expert_ffn_, j["shared_expert_gate"] = shared_expert_gate_;
  if (rope_scaling_) {
    const auto& s = *rope_scaling_;
    j["rope_scaling"] = {{"type", "llama3"},
                         {"factor", s.factor()},
                         {"low_freq_factor", s.low_freq_factor()},
                         {"high_freq_factor", s.high_freq_factor()},
                         {"original_context", s.original_context()}};
  }
  return j.dump();
}

GPTConfig GPTConfig::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "model config: not JSON (", e.what(), ")");
  }
  TORCH_CHECK(j.is_object(), "model config: a JSON object expected, got ", text);
  GPTConfig c;
  try {
    c.vocab(j.value("vocab", c.vocab())).context(j.value("context", c.context())).layers(j.value("layers", c.layers()));
    c.heads(j.value("heads", c.heads())).hidden(j.value("hidden", c.hidden())).tied(j.value("tied", c.tied()));
    c.kv_heads(j.value("kv_heads", int64_t{0})).head_dim(j.value("head_dim", int64_t{0}));
    c.ffn(j.value("ffn", int64_t{0}));
    c.norm(named<nn::NormKind>(j, "norm", c.norm(), {{"layernorm", nn::NormKind::kLayerNorm},
                                                     {"rmsnorm", nn::NormKind::kRMSNorm}}));
    c.positions(named<Positions>(j, "positions", c.positions(), {{"learned", Positions::kLearned},
                                                                 {"rotary", Positions::kRotary}}));
    c.mlp(named<nn::MLPKind>(j, "mlp", c.mlp(), {{"gelu", nn::MLPKind::kGelu}, {"swiglu", nn::MLPKind::kSwiGLU},
                                                  {"gelu-tanh", nn::MLPKind::kGeluTanh}}));
    c.norm_eps(j.value("norm_eps", c.norm_eps())).rope_theta(j.value("rope_theta", c.rope_theta()));
    c.bias(j.value("bias", c.bias())).qkv_bias(j.value("qkv_bias", c.qkv_bias())).qk_norm(j.value("qk_norm", false));
    c.experts(j.value("experts", int64_t{0})).moe_every(j.value("moe_every", int64_t{1}));
    c.top_k(j.value("top_k", int64_t{1})).renormalize(j.value("renormalize", false));
    c.shared_expert_ffn(j.value("shared_expert_ffn", int64_t{0}))
        .shared_expert_gate(j.value("shared_expert_gate", false));
    if (j.contains("rope_scaling")) {
      const auto& s = j.at("rope_scaling");
      TORCH_CHECK(s.value("type", std::string("llama3")) == "llama3", "model config: rope_scaling of type '",
                  s.value("type", std::string()), "' is not carried out (only llama3 is)");
      c.rope_scaling(nn::Llama3RopeScaling()
                         .factor(s.value("factor", 8.0))
                         .low_freq_factor(s.value("low_freq_factor", 1.0))
                         .high_freq_factor(s.value("high_freq_factor", 4.0))
                         .original_context(s.value("original_context", int64_t{8192})));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "model config: a value has the wrong type (", e.what(), ") in ", text);
  }
  c.check();
  return c;
}

void GPTConfig::check() const {
  TORCH_CHECK(vocab_ > 0 && context_ > 0 && layers_ > 0 && heads_ > 0 && hidden_ > 0,
              "model sizes must be positive; got vocab ", vocab_, ", context ", context_, ", layers ", layers_,
              ", heads ", heads_, ", hidden ", hidden_);
  TORCH_CHECK(kv_heads_ >= 0 && head_dim_ >= 0 && ffn_ >= 0,
              "kv_heads, head_dim and ffn must be >= 0 (0: the default), got ", kv_heads_, ", ", head_dim_, ", ", ffn_);
  TORCH_CHECK(heads_ % num_kv_heads() == 0, "the ", heads_, " attention heads are not divisible by the ",
              num_kv_heads(), " key/value heads (each kv head serves a whole group of query heads); choose kv heads "
              "that divide the heads");
  TORCH_CHECK(head_dim_ > 0 || hidden_ % heads_ == 0, "hidden size ", hidden_, " is not divisible by heads ", heads_,
              "; choose divisible sizes or set head_dim");
  TORCH_CHECK(positions_ != Positions::kRotary || dim_per_head() % 2 == 0,
              "rotary position embeddings need an even head dimension; got head_dim ", dim_per_head(),
              "; choose an even head dimension or learned positions");
  TORCH_CHECK(positions_ == Positions::kRotary || !rope_scaling_,
              "rope_scaling is set, but the positions are learned (it scales rotary frequencies); set rotary "
              "positions or leave rope_scaling unset");
  TORCH_CHECK(norm_eps_ > 0, "norm_eps must be positive, got ", norm_eps_);
  TORCH_CHECK(experts_ >= 0 && moe_every_ >= 1, "experts (", experts_, ") must be >= 0 and moe_every (", moe_every_,
              ") >= 1");
  if (experts_ == 0) {
    // A MoE option on a dense model would silently do nothing.
    const char* set = top_k_ != 1                                         ? "top_k"
                      : moe_every_ != 1                                   ? "moe_every"
                      : renormalize_                                      ? "renormalize"
                      : capacity_factor_                                  ? "capacity_factor"
                      : shared_expert_ffn_ != 0                           ? "shared_expert_ffn"
                      : shared_expert_gate_                               ? "shared_expert_gate"
                      : expert_compute_ != nn::MoEExpertCompute::kGrouped ? "expert_compute"
                                                                          : nullptr;
    TORCH_CHECK(set == nullptr, "the mixture-of-experts option ", set,
                " is set, but the model is dense (experts 0); set experts, or leave ", set, " at its default");
  }
  TORCH_CHECK(experts_ == 0 || mlp_ != nn::MLPKind::kGeluTanh,
              "the experts compute GELU or SwiGLU, not GELU's tanh approximation; choose mlp gelu or swiglu");
  TORCH_CHECK(experts_ == 0 || moe_every_ <= layers_, "moe_every ", moe_every_, " exceeds the ", layers_,
              " layers, so no block would have experts; lower moe_every");
  TORCH_CHECK(experts_ == 0 || (top_k_ >= 1 && top_k_ <= experts_), "top-k ", top_k_, " must be between 1 and the ",
              experts_, " experts");
  TORCH_CHECK(shared_expert_ffn_ >= 0, "shared_expert_ffn must be >= 0 (the shared experts' width; 0: none), got ",
              shared_expert_ffn_);
  TORCH_CHECK(!shared_expert_gate_ || shared_expert_ffn_ > 0,
              "shared_expert_gate is set, but shared_expert_ffn is 0 (no shared experts); set shared_expert_ffn");
}

class GPTBlockImpl : public torch::nn::Module {
 public:
  GPTBlockImpl(const GPTConfig& c, nn::LayerFactory& f, bool moe, std::shared_ptr<nn::MoELossScale> aux_loss_scale)
      : f_(f), heads_(f.local_heads(c.heads())), head_dim_(c.dim_per_head()), checkpoint_(c.checkpoint_activations()) {
    const int64_t h = c.hidden(), d = head_dim_, attn = c.heads() * d;
    // Construction order fixes each layer's seed draw: GPT-2's is kept.
    ln_1 = f.norm(h, c.norm(), c.norm_eps());
    if (c.grouped_attention()) {
      entry_ = f.column_entry();
      q_proj = f.linear(h, attn, nn::LinearRole::kColumnEntered, c.qkv_bias());
      kv_proj = f.kv_linear(h, c.num_kv_heads(), 2 * d, c.qkv_bias());
      kv_heads_ = f.local_kv_heads(c.num_kv_heads());
    } else {
      c_attn = f.linear(h, 3 * attn, nn::LinearRole::kColumn, c.qkv_bias());
      kv_heads_ = heads_;
    }
    if (c.qk_norm()) {
      q_norm = f.head_norm(d, c.norm_eps());
      k_norm = f.head_norm(d, c.norm_eps());
    }
    if (c.positions() == Positions::kRotary)
      rotary = torch::nn::AnyModule(
          nn::RotaryEmbedding(nn::RotaryOptions(d).theta(c.rope_theta()).scaling(c.rope_scaling())));
    core_attention = f.core_attention(c.heads(), d, c.dropout());
    attn_proj = f.linear(attn, h, nn::LinearRole::kRow, c.bias());
    resid_drop_1 = f.dropout(c.dropout(), nn::DropoutSite::kBlock);
    ln_2 = f.norm(h, c.norm(), c.norm_eps());
    mlp = moe ? f.moe(nn::MoEOptions(h, c.ffn_size(), c.experts())
                          .top_k(c.top_k())
                          .renormalize(c.renormalize())
                          .capacity_factor(c.capacity_factor())
                          .drop_policy(c.drop_policy())
                          .aux_loss_coef(c.aux_loss_coef())
                          .z_loss_coef(c.z_loss_coef())
                          .gated(c.mlp() == nn::MLPKind::kSwiGLU)
                          .bias(c.bias())
                          .expert_compute(c.expert_compute())
                          .shared_ffn(c.shared_expert_ffn())
                          .shared_gate(c.shared_expert_gate()),
                      std::move(aux_loss_scale))
              : f.mlp(h, c.ffn_size(), c.mlp(), c.bias());
    resid_drop_2 = f.dropout(c.dropout(), nn::DropoutSite::kBlock);
    const std::pair<const char*, torch::nn::AnyModule*> children[] = {
        {"ln_1", &ln_1},
        {"c_attn", &c_attn},
        {"q_proj", &q_proj},
        {"kv_proj", &kv_proj},
        {"q_norm", &q_norm},
        {"k_norm", &k_norm},
        {"rotary", &rotary},
        {"core_attention", &core_attention},
        {"attn_proj", &attn_proj},
        {"resid_drop_1", &resid_drop_1},
        {"ln_2", &ln_2},
        {"mlp", &mlp},
        {"resid_drop_2", &resid_drop_2}};
    for (const auto& child : children)
      if (!child.second->is_empty()) register_module(child.first, child.second->ptr());
  }

  at::Tensor forward(const at::Tensor& x) {
    if (!checkpoint_) return body(x);
    // Only x is kept for backward; the block's own dropouts replay their masks.
    return nn::checkpoint(
        *this, [this](const at::Tensor& in) { return body(in); }, x);
  }

  // Empty where the configuration has no such layer.
  torch::nn::AnyModule ln_1, c_attn, q_proj, kv_proj, q_norm, k_norm, rotary, core_attention, attn_proj, resid_drop_1,
      ln_2, mlp, resid_drop_2;

 private:
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = x + resid_drop_1.forward(attn_proj.forward(attention(ln_1.forward(x))));
    return h + resid_drop_2.forward(mlp.forward(ln_2.forward(h)));
  }

  // -> [b, s, local heads · head_dim].
  at::Tensor attention(const at::Tensor& x) {
    at::Tensor q, k, v;  // [b, heads, s, d]
    if (!c_attn.is_empty()) {
      const at::Tensor qkv = c_attn.forward(x);  // rows grouped per head
      const at::Tensor split = qkv.view({qkv.size(0), qkv.size(1), heads_, 3, head_dim_}).permute({3, 0, 2, 1, 4});
      q = split[0], k = split[1], v = split[2];
    } else {
      const at::Tensor in = entry_(x);  // one entry for both projections
      const at::Tensor qp = q_proj.forward(in);
      q = qp.view({qp.size(0), qp.size(1), heads_, head_dim_}).transpose(1, 2);
      const at::Tensor kv = kv_proj.forward(in);  // rows grouped per kv head: k, then v
      const at::Tensor split = kv.view({kv.size(0), kv.size(1), kv_heads_, 2, head_dim_}).permute({3, 0, 2, 1, 4});
      k = split[0], v = split[1];
    }
    const int64_t b = q.size(0), s = q.size(2);
    if (!q_norm.is_empty()) q = q_norm.forward(q), k = k_norm.forward(k);
    const at::Tensor positions = f_.attention_positions(s);
    if (!rotary.is_empty()) q = rotary.forward(q, positions), k = rotary.forward(k, positions);
    if (kv_heads_ != heads_) {
      // Each kv head serves heads_ / kv_heads_ consecutive query heads.
      k = k.repeat_interleave(heads_ / kv_heads_, 1);
      v = v.repeat_interleave(heads_ / kv_heads_, 1);
    }
    const at::Tensor out = core_attention.forward(q, k, v, positions);
    return out.permute({0, 2, 1, 3}).reshape({b, s, heads_ * head_dim_});
  }

  nn::LayerFactory& f_;
  std::function<at::Tensor(const at::Tensor&)> entry_;  // grouped attention: column_entry()
  int64_t heads_;
  int64_t kv_heads_ = 0;
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
  at::Tensor x = wte.forward(ids);
  if (!wpe.is_empty()) x = x + wpe.forward(f.positions(s).to(ids.device()));
  return drop.forward(x);
}

// The pipeline's first and last layers (GPTImpl::as_sequential).
class GPTEmbeddingImpl : public torch::nn::Module {
 public:
  GPTEmbeddingImpl(GPTConfig c, std::shared_ptr<nn::LayerFactory> f, torch::nn::AnyModule wte, torch::nn::AnyModule wpe,
                   torch::nn::AnyModule drop)
      : c_(c), f_(std::move(f)), wte_(std::move(wte)), wpe_(std::move(wpe)), drop_(std::move(drop)) {
    register_module("wte", wte_.ptr());
    if (!wpe_.is_empty()) register_module("wpe", wpe_.ptr());
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

namespace {

// Module names -> GPT-2's: "h3.c_attn.weight" -> "h.3.attn.c_attn.weight"
// (Note [GPT full weights]).
std::string gpt2_name(const std::string& name) {
  if (name.size() < 2 || name[0] != 'h' || !std::isdigit(static_cast<unsigned char>(name[1]))) return name;
  const auto dot = name.find('.');
  std::string rest = name.substr(dot + 1);
  for (const char* attn : {"c_attn.", "q_proj.", "kv_proj.", "q_norm.", "k_norm."})
    if (rest.rfind(attn, 0) == 0) rest = "attn." + rest;
  if (rest.rfind("attn_proj.", 0) == 0) rest = "attn.c_proj." + rest.substr(10);
  return "h." + name.substr(1, dot - 1) + "." + rest;
}

}  // namespace

GPTImpl::GPTImpl(const GPTConfig& config, std::shared_ptr<nn::LayerFactory> factory)
    : config_(config), factory_(std::move(factory)) {
  TORCH_CHECK(factory_ != nullptr, "GPT needs a layer factory");
  nn::LayerFactory& f = *factory_;
  TORCH_CHECK(config_.experts() > 0 || f.expert_size() == 1, "GPT: expert size ", f.expert_size(),
              " is configured, but the model has no mixture-of-experts blocks (experts 0); set experts or expert "
              "size 1");
  config_.check();
  wte_ = f.vocab_embedding(config_.vocab(), config_.hidden());
  register_module("wte", wte_.ptr());
  if (config_.positions() == Positions::kLearned) {
    wpe_ = f.position_embedding(config_.context(), config_.hidden());
    register_module("wpe", wpe_.ptr());
  }
  drop_ = f.dropout(config_.dropout(), nn::DropoutSite::kBlock);
  register_module("drop", drop_.ptr());
  for (int64_t i = 0; i < config_.layers(); ++i) {
    blocks_.push_back(std::make_shared<GPTBlockImpl>(config_, f, config_.moe_block(i), aux_loss_scale_));
    register_module("h" + std::to_string(i), blocks_.back());
  }
  ln_f_ = f.norm(config_.hidden(), config_.norm(), config_.norm_eps());
  register_module("ln_f", ln_f_.ptr());
  if (!config_.tied()) {
    lm_head_ = f.vocab_embedding(config_.vocab(), config_.hidden());
    register_module("lm_head", lm_head_.ptr());
  }
  // Taken once, from the shapes as built: a pipeline rank later empties the
  // layers it does not run (Note [Other stages released]).
  placements_ = factory_->placements(*this);
  for (auto& entry : placements_) entry.first = gpt2_name(entry.first);
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
    } else if (name.find("ln_") != std::string::npos || name.find("_norm.") != std::string::npos) {
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

nn::NamedPlacements GPTImpl::placements() { return placements_; }

}  // namespace models
}  // namespace tessera
