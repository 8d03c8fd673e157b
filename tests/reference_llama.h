#pragma once
// The reference Llama of the serial-equivalence tests: the Llama-family
// decoder (Llama 3, Mistral, Qwen 2, Qwen 3, Mixtral) written with plain
// LibTorch tensor operations and nothing from tessera, so that a bug in
// tessera's own Llama cannot hide on the serial side of a "parallel equals
// serial" test. It follows the eager math of Hugging Face transformers'
// LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and
// MixtralForCausalLM, op for op where it matters for rounding.
//
// Token embedding, N pre-RMSNorm blocks of causal grouped-query attention
// with rotary embeddings (optionally Llama 3 frequency scaling, Qwen 2 q/k/v
// biases, Qwen 3 per-head q/k RMSNorm) and a SwiGLU MLP, final RMSNorm, an LM
// head (or the tied embedding), and mean cross entropy with ignore_index
// -100. With experts > 0, every moe_every-th block has Mixtral's sparse MoE in
// place of its MLP: softmax router, top-k gates (renormalized by option),
// every expert run on every token and the outputs mixed by a dense
// [tokens, experts] gate matrix (nothing of a sort-and-dispatch).
//
// Parameters carry Hugging Face's names and shapes: "model.embed_tokens.weight",
// "model.layers.<i>.input_layernorm.weight",
// "model.layers.<i>.self_attn.{q,k,v,o}_proj.weight" (+ q/k/v ".bias" with
// qkv_bias), "model.layers.<i>.self_attn.{q,k}_norm.weight" (qk_norm),
// "model.layers.<i>.post_attention_layernorm.weight",
// "model.layers.<i>.mlp.{gate,up,down}_proj.weight" or, in MoE blocks,
// "model.layers.<i>.block_sparse_moe.gate.weight" and
// "model.layers.<i>.block_sparse_moe.experts.<j>.{w1,w2,w3}.weight",
// "model.norm.weight" and, untied, "lm_head.weight". Linear weights are
// [out, in].
//
// Construction draws nothing from the default generator (weights start at
// zero, norms at one): load_state() gives the model its weights, e.g. from
// random_llama_weights(). For a reduced-precision reference, ->to(dtype)
// the model before loading (load_state copies into the parameters' dtype).
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

struct ReferenceLlamaConfig {
  int64_t vocab = 101, hidden = 32, layers = 2, heads = 4, kv_heads = 2, head_dim = 8, ffn = 48;
  double norm_eps = 1e-5, rope_theta = 10000.0;
  bool llama3_scaling = false;  // HF rope_scaling {"rope_type": "llama3", ...}
  double rope_factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_context = 8192;  // original_max_position_embeddings
  bool qkv_bias = false;            // Qwen 2
  bool qk_norm = false;             // Qwen 3: RMSNorm over head_dim on q and k, before rotary
  bool tied = false;                // lm_head shares embed_tokens
  int64_t experts = 0;              // > 0: Mixtral sparse MoE in every moe_every-th block
  int64_t moe_every = 1;            // block i has MoE when (i + 1) % moe_every == 0
  int64_t top_k = 2;
  bool renormalize = true;  // Mixtral renormalizes the top-k softmax weights
};

namespace reference_llama_detail {

// y = x W^T (+ b), W [out, in].
struct LinearImpl : torch::nn::Module {
  LinearImpl(int64_t in, int64_t out, bool has_bias = false) {
    weight = register_parameter("weight", torch::zeros({out, in}));
    if (has_bias) bias = register_parameter("bias", torch::zeros({out}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
  }
  torch::Tensor weight, bias;
};

// HF LlamaRMSNorm: normalized in float32, cast back, then scaled.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double epsilon) : eps(epsilon) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor x32 = x.to(torch::kFloat);
    const torch::Tensor y = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * y.to(x.scalar_type());
  }
  double eps;
  torch::Tensor weight;
};

// HF _compute_default_rope_parameters and _compute_llama3_parameters, in
// float32 and with the same operations as HF so the frequencies round alike.
inline torch::Tensor rope_inv_freq(const ReferenceLlamaConfig& c, const torch::Device& device) {
  const torch::Tensor exponent =
      torch::arange(0, c.head_dim, 2, torch::TensorOptions().dtype(torch::kLong).device(device)).to(torch::kFloat) /
      static_cast<double>(c.head_dim);
  const torch::Tensor inv_freq = torch::pow(c.rope_theta, exponent).reciprocal();  // Python's 1.0 / t
  if (!c.llama3_scaling) return inv_freq;
  const double pi = 3.141592653589793;  // math.pi
  const double low_freq_wavelen = static_cast<double>(c.original_context) / c.low_freq_factor;
  const double high_freq_wavelen = static_cast<double>(c.original_context) / c.high_freq_factor;
  const torch::Tensor wavelen = inv_freq.reciprocal() * (2 * pi);
  // Long wavelengths (low frequencies) are slowed by the factor...
  torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / c.rope_factor, inv_freq);
  // ...short ones kept, and the band between interpolated smoothly.
  const torch::Tensor smooth = (wavelen.reciprocal() * static_cast<double>(c.original_context) - c.low_freq_factor) /
                               (c.high_freq_factor - c.low_freq_factor);
  const torch::Tensor smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled;
  const torch::Tensor medium = (wavelen < high_freq_wavelen).logical_not() & (wavelen > low_freq_wavelen).logical_not();
  return torch::where(medium, smoothed, scaled);
}

inline torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Causal grouped-query self-attention with rotary embeddings.
struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const ReferenceLlamaConfig& c) : heads(c.heads), kv_heads(c.kv_heads), head_dim(c.head_dim) {
    q_proj = register_module("q_proj", std::make_shared<LinearImpl>(c.hidden, c.heads * c.head_dim, c.qkv_bias));
    k_proj = register_module("k_proj", std::make_shared<LinearImpl>(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
    v_proj = register_module("v_proj", std::make_shared<LinearImpl>(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
    o_proj = register_module("o_proj", std::make_shared<LinearImpl>(c.heads * c.head_dim, c.hidden));
    if (c.qk_norm) {
      q_norm = register_module("q_norm", std::make_shared<RMSNormImpl>(c.head_dim, c.norm_eps));
      k_norm = register_module("k_norm", std::make_shared<RMSNormImpl>(c.head_dim, c.norm_eps));
    }
  }
  // HF repeat_kv: each kv head serves `group` consecutive query heads.
  torch::Tensor repeat_kv(const torch::Tensor& t) const {
    const int64_t group = heads / kv_heads;
    if (group == 1) return t;
    return t.unsqueeze(2)
        .expand({t.size(0), kv_heads, group, t.size(2), head_dim})
        .reshape({t.size(0), heads, t.size(2), head_dim});
  }
  // cos, sin [s, head_dim] in x's dtype.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t b = x.size(0), s = x.size(1);
    torch::Tensor q = q_proj->forward(x).view({b, s, heads, head_dim});
    torch::Tensor k = k_proj->forward(x).view({b, s, kv_heads, head_dim});
    if (q_norm) {  // Qwen 3 normalizes per head, before rotary
      q = q_norm->forward(q);
      k = k_norm->forward(k);
    }
    q = q.transpose(1, 2);  // [b, heads, s, d]
    k = k.transpose(1, 2);  // [b, kv_heads, s, d]
    torch::Tensor v = v_proj->forward(x).view({b, s, kv_heads, head_dim}).transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    k = repeat_kv(k);
    v = repeat_kv(v);
    // HF multiplies by head_dim ** -0.5 rather than dividing by the root.
    torch::Tensor scores = torch::matmul(q, k.transpose(2, 3)) * std::pow(static_cast<double>(head_dim), -0.5);
    const torch::Tensor future =
        torch::ones({s, s}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    const torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat).to(q.scalar_type());
    const torch::Tensor y = torch::matmul(probs, v).transpose(1, 2).reshape({b, s, heads * head_dim});
    return o_proj->forward(y);
  }
  int64_t heads, kv_heads, head_dim;
  std::shared_ptr<LinearImpl> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<RMSNormImpl> q_norm, k_norm;
};

// SwiGLU: down(silu(gate(x)) * up(x)); named gate_proj/up_proj/down_proj in
// the dense MLP and w1/w3/w2 in a Mixtral expert.
struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t hidden, int64_t ffn, bool expert = false) {
    gate = register_module(expert ? "w1" : "gate_proj", std::make_shared<LinearImpl>(hidden, ffn));
    up = register_module(expert ? "w3" : "up_proj", std::make_shared<LinearImpl>(hidden, ffn));
    down = register_module(expert ? "w2" : "down_proj", std::make_shared<LinearImpl>(ffn, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return down->forward(torch::silu(gate->forward(x)) * up->forward(x));
  }
  std::shared_ptr<LinearImpl> gate, up, down;
};

// Mixtral's sparse MoE block, computed densely: every expert on every token.
struct MoEImpl : torch::nn::Module {
  explicit MoEImpl(const ReferenceLlamaConfig& c) : top_k(c.top_k), renorm(c.renormalize) {
    gate = register_module("gate", std::make_shared<LinearImpl>(c.hidden, c.experts));
    auto list = register_module("experts", std::make_shared<torch::nn::Module>());
    for (int64_t j = 0; j < c.experts; ++j) {
      experts.push_back(std::make_shared<MLPImpl>(c.hidden, c.ffn, /*expert=*/true));
      list->register_module(std::to_string(j), experts.back());
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor t = x.reshape({-1, x.size(-1)});  // [T, h]
    const torch::Tensor routing = torch::softmax(gate->forward(t), -1, torch::kFloat);
    const auto top = routing.topk(top_k, -1);
    torch::Tensor gates = std::get<0>(top);
    if (renorm) gates = gates / gates.sum(-1, /*keepdim=*/true);
    gates = gates.to(x.scalar_type());
    // [T, E], zero for the experts a token did not choose.
    const torch::Tensor dense = torch::zeros({t.size(0), static_cast<int64_t>(experts.size())}, gates.options())
                                    .scatter(1, std::get<1>(top), gates);
    std::vector<torch::Tensor> outs;
    for (auto& e : experts) outs.push_back(e->forward(t));
    return torch::einsum("te,eth->th", {dense, torch::stack(outs)}).reshape(x.sizes());
  }
  int64_t top_k;
  bool renorm;
  std::shared_ptr<LinearImpl> gate;
  std::vector<std::shared_ptr<MLPImpl>> experts;
};

// Pre-RMSNorm block: h = x + attn(norm(x)), then h + mlp(norm(h)).
struct BlockImpl : torch::nn::Module {
  BlockImpl(const ReferenceLlamaConfig& c, bool moe_block) {
    input_layernorm = register_module("input_layernorm", std::make_shared<RMSNormImpl>(c.hidden, c.norm_eps));
    self_attn = register_module("self_attn", std::make_shared<AttentionImpl>(c));
    post_attention_layernorm =
        register_module("post_attention_layernorm", std::make_shared<RMSNormImpl>(c.hidden, c.norm_eps));
    if (moe_block)
      moe = register_module("block_sparse_moe", std::make_shared<MoEImpl>(c));
    else
      mlp = register_module("mlp", std::make_shared<MLPImpl>(c.hidden, c.ffn));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const torch::Tensor h = x + self_attn->forward(input_layernorm->forward(x), cos, sin);
    const torch::Tensor m = post_attention_layernorm->forward(h);
    return h + (moe ? moe->forward(m) : mlp->forward(m));
  }
  std::shared_ptr<RMSNormImpl> input_layernorm, post_attention_layernorm;
  std::shared_ptr<AttentionImpl> self_attn;
  std::shared_ptr<MLPImpl> mlp;
  std::shared_ptr<MoEImpl> moe;
};

// HF's LlamaModel: the "model." prefix of every name but lm_head's.
struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(const ReferenceLlamaConfig& c) {
    embed_tokens = register_module("embed_tokens", std::make_shared<LinearImpl>(c.hidden, c.vocab));  // [vocab, hidden]
    // Submodule names cannot hold a dot: "layers" holds "0", "1", ...
    auto list = register_module("layers", std::make_shared<torch::nn::Module>());
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(std::make_shared<BlockImpl>(c, c.experts > 0 && (i + 1) % c.moe_every == 0));
      list->register_module(std::to_string(i), blocks.back());
    }
    norm = register_module("norm", std::make_shared<RMSNormImpl>(c.hidden, c.norm_eps));
  }
  std::shared_ptr<LinearImpl> embed_tokens;
  std::vector<std::shared_ptr<BlockImpl>> blocks;
  std::shared_ptr<RMSNormImpl> norm;
};

}  // namespace reference_llama_detail

class ReferenceLlamaImpl : public torch::nn::Module {
 public:
  explicit ReferenceLlamaImpl(const ReferenceLlamaConfig& config) : config_(config) {
    const auto& c = config_;
    TORCH_CHECK(c.vocab > 0 && c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.head_dim > 0 &&
                    c.ffn > 0 && c.moe_every > 0,
                "reference Llama: config sizes must be positive");
    TORCH_CHECK(c.heads % c.kv_heads == 0, "reference Llama: heads ", c.heads, " is not a multiple of kv_heads ",
                c.kv_heads);
    TORCH_CHECK(c.head_dim % 2 == 0, "reference Llama: rotary needs an even head_dim, got ", c.head_dim);
    TORCH_CHECK(c.experts == 0 || (c.top_k >= 1 && c.top_k <= c.experts), "reference Llama: top_k ", c.top_k,
                " must lie in [1, experts ", c.experts, "]");
    model_ = register_module("model", std::make_shared<reference_llama_detail::ModelImpl>(c));
    if (!c.tied)
      lm_head_ = register_module("lm_head", std::make_shared<reference_llama_detail::LinearImpl>(c.hidden, c.vocab));
  }

  // ids [b, s] int64, positions 0..s-1 -> logits [b, s, vocab].
  torch::Tensor forward(const torch::Tensor& ids) {
    TORCH_CHECK(ids.dim() == 2, "reference Llama expects token ids [batch, sequence], got shape ", ids.sizes());
    torch::Tensor x = at::embedding(model_->embed_tokens->weight, ids);
    // HF LlamaRotaryEmbedding: float32 angles, cos/sin cast to the activations' dtype.
    const torch::Tensor positions =
        torch::arange(ids.size(1), torch::TensorOptions().dtype(torch::kLong).device(ids.device())).to(torch::kFloat);
    const torch::Tensor freqs = torch::outer(positions, reference_llama_detail::rope_inv_freq(config_, ids.device()));
    const torch::Tensor emb = torch::cat({freqs, freqs}, -1);  // [s, head_dim]
    const torch::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
    for (auto& block : model_->blocks) x = block->forward(x, cos, sin);
    x = model_->norm->forward(x);
    const torch::Tensor& head = config_.tied ? model_->embed_tokens->weight : lm_head_->weight;
    return at::linear(x, head);
  }

  // Mean cross entropy of logits [b, s, vocab] against targets [b, s] (already
  // aligned: no shift here), ignore_index -100; logits upcast to float as HF does.
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                                targets.reshape({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
  }

  // Copies every parameter from `w` by HF name; a missing, extra or misshapen
  // entry is an error (an extra one most likely means a mis-mapped name).
  void load_state(const std::map<std::string, torch::Tensor>& w) {
    torch::NoGradGuard no_grad;
    auto params = named_parameters();
    for (auto& p : params) {
      auto it = w.find(p.key());
      TORCH_CHECK(it != w.end(), "reference Llama: load_state: '", p.key(), "' is missing");
      TORCH_CHECK(it->second.sizes() == p.value().sizes(), "reference Llama: '", p.key(), "' has shape ",
                  it->second.sizes(), ", expected ", p.value().sizes());
      p.value().copy_(it->second);
    }
    for (const auto& kv : w)
      TORCH_CHECK(params.contains(kv.first), "reference Llama: load_state: unexpected tensor '", kv.first, "'");
  }

  // Copies of the parameters (or, with gradients = true, of their gradients,
  // zeros where none) by HF name.
  std::map<std::string, torch::Tensor> state(bool gradients = false) { return module_state(*this, gradients); }

  const ReferenceLlamaConfig& config() const { return config_; }

 private:
  ReferenceLlamaConfig config_;
  std::shared_ptr<reference_llama_detail::ModelImpl> model_;
  std::shared_ptr<reference_llama_detail::LinearImpl> lm_head_;
};

TORCH_MODULE(ReferenceLlama);

// Every parameter of config `c`, drawn in the reference's named_parameters()
// order from a generator seeded with `seed` (never the default one), in float
// and then cast to `dtype`: linear and embedding weights N(0, 0.05), biases
// N(0, 0.1), norm weights 1 + N(0, 0.1), so that a dropped bias or a swapped
// norm changes the output.
inline std::map<std::string, torch::Tensor> random_llama_weights(const ReferenceLlamaConfig& c, uint64_t seed,
                                                                 torch::Dtype dtype = torch::kFloat) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  std::map<std::string, torch::Tensor> out;
  ReferenceLlama shapes(c);
  for (const auto& p : shapes->named_parameters()) {
    torch::Tensor t = torch::empty(p.value().sizes(), torch::kFloat);
    if (ends_with(p.key(), "norm.weight"))  // input_layernorm, post_attention_layernorm, q/k_norm, model.norm
      t.normal_(1.0, 0.1, gen);
    else if (ends_with(p.key(), ".bias"))
      t.normal_(0.0, 0.1, gen);
    else
      t.normal_(0.0, 0.05, gen);
    out[p.key()] = t.to(dtype);
  }
  return out;
}

}  // namespace test
}  // namespace tessera
