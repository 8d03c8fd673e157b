#pragma once
// The Llama-shaped baseline of bench/gpt_step: RMSNorm, rotary positions,
// grouped-query attention, a SwiGLU MLP and an untied head written with plain
// LibTorch modules, nothing from tessera, so that tessera's overhead on the
// Llama family shows. It loads tessera's full state (Note [GPT full weights]:
// q_proj rows per head, kv_proj rows per kv head as k then v, c_gate / c_fc /
// c_proj). Attention is at::scaled_dot_product_attention on LibTorch 2.x.
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace baseline {

struct LlamaShape {
  int64_t vocab, layers, heads, kv_heads, hidden, ffn;
  double theta = 500000, eps = 1e-5;
};

inline torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const torch::Tensor x32 = x.to(torch::kFloat);
  return w * (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

struct LlamaBlockImpl : torch::nn::Module {
  explicit LlamaBlockImpl(const LlamaShape& s) : s(s), d(s.hidden / s.heads) {
    auto linear = [&](const char* name, int64_t in, int64_t out) {
      return register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
    };
    norm_1 = register_parameter("norm_1", torch::ones({s.hidden}));
    norm_2 = register_parameter("norm_2", torch::ones({s.hidden}));
    q = linear("q", s.hidden, s.heads * d);
    kv = linear("kv", s.hidden, 2 * s.kv_heads * d);
    o = linear("o", s.heads * d, s.hidden);
    gate = linear("gate", s.hidden, s.ffn);
    up = linear("up", s.hidden, s.ffn);
    down = linear("down", s.ffn, s.hidden);
  }
  // cos, sin: [s, d].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t b = x.size(0), n = x.size(1);
    const torch::Tensor in = rms(x, norm_1, s.eps);
    torch::Tensor qh = q(in).view({b, n, s.heads, d}).transpose(1, 2);
    const torch::Tensor kvh = kv(in).view({b, n, s.kv_heads, 2, d}).permute({3, 0, 2, 1, 4});
    torch::Tensor kh = kvh[0], vh = kvh[1];
    auto rotate = [&](const torch::Tensor& t) {
      return t * cos + torch::cat({-t.narrow(-1, d / 2, d / 2), t.narrow(-1, 0, d / 2)}, -1) * sin;
    };
    qh = rotate(qh), kh = rotate(kh);
    kh = kh.repeat_interleave(s.heads / s.kv_heads, 1), vh = vh.repeat_interleave(s.heads / s.kv_heads, 1);
#if TORCH_VERSION_MAJOR >= 2
    torch::Tensor y = at::scaled_dot_product_attention(qh, kh, vh, {}, 0.0, /*is_causal=*/true);
#else
    torch::Tensor scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(double(d));
    scores = scores.masked_fill(torch::ones({n, n}, x.options().dtype(torch::kBool)).triu(1),
                                -std::numeric_limits<float>::infinity());
    torch::Tensor y = torch::matmul(torch::softmax(scores, -1), vh);
#endif
    const torch::Tensor h = x + o(y.transpose(1, 2).reshape({b, n, -1}));
    const torch::Tensor m = rms(h, norm_2, s.eps);
    return h + down(torch::silu(gate(m)) * up(m));
  }
  LlamaShape s;
  int64_t d;
  torch::Tensor norm_1, norm_2;
  torch::nn::Linear q{nullptr}, kv{nullptr}, o{nullptr}, gate{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(LlamaBlock);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const LlamaShape& s) : s(s) {
    embed = register_module("embed", torch::nn::Embedding(s.vocab, s.hidden));
    for (int64_t i = 0; i < s.layers; ++i) blocks.push_back(register_module("h" + std::to_string(i), LlamaBlock(s)));
    norm = register_parameter("norm", torch::ones({s.hidden}));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(s.hidden, s.vocab).bias(false)));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    const int64_t d = s.hidden / s.heads, n = ids.size(1);
    const torch::Tensor inv = torch::pow(s.theta, torch::arange(0, d, 2, torch::kFloat) / double(d)).reciprocal();
    const torch::Tensor angles = torch::outer(torch::arange(n, torch::kFloat), inv).to(ids.device());
    const torch::Tensor both = torch::cat({angles, angles}, -1);
    torch::Tensor x = embed(ids);
    const torch::Tensor cos = both.cos().to(x.scalar_type()), sin = both.sin().to(x.scalar_type());
    for (auto& b : blocks) x = b->forward(x, cos, sin);
    const torch::Tensor logits = head(rms(x, norm, s.eps));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }
  // Loads tessera's full state (models::GPT::full_state names).
  void load(const std::map<std::string, torch::Tensor>& w) {
    torch::NoGradGuard no_grad;
    embed->weight.copy_(w.at("wte.weight"));
    norm.copy_(w.at("ln_f.weight"));
    head->weight.copy_(w.at("lm_head.weight"));
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string p = "h." + std::to_string(i) + ".";
      auto& b = *blocks[i];
      b.norm_1.copy_(w.at(p + "ln_1.weight"));
      b.norm_2.copy_(w.at(p + "ln_2.weight"));
      b.q->weight.copy_(w.at(p + "attn.q_proj.weight"));
      b.kv->weight.copy_(w.at(p + "attn.kv_proj.weight"));
      b.o->weight.copy_(w.at(p + "attn.c_proj.weight"));
      b.gate->weight.copy_(w.at(p + "mlp.c_gate.weight"));
      b.up->weight.copy_(w.at(p + "mlp.c_fc.weight"));
      b.down->weight.copy_(w.at(p + "mlp.c_proj.weight"));
    }
  }
  LlamaShape s;
  torch::nn::Embedding embed{nullptr};
  std::vector<LlamaBlock> blocks;
  torch::Tensor norm;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Llama);

}  // namespace baseline
