#pragma once
// The baseline of bench/gpt_step: the same GPT written with plain LibTorch
// modules, nothing from tessera, so that tessera's overhead at tensor size 1
// shows. Same shapes, same attention arithmetic, c_attn rows grouped per head
// as in Note [GPT full weights], so tessera's full weights load into it.
// With LibTorch 2.x its attention is at::scaled_dot_product_attention.
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>

namespace baseline {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t hidden, int64_t heads) : heads(heads), head_dim(hidden / heads) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
    c_attn = register_module("c_attn", torch::nn::Linear(hidden, 3 * hidden));
    attn_proj = register_module("attn_proj", torch::nn::Linear(hidden, hidden));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
    c_fc = register_module("c_fc", torch::nn::Linear(hidden, 4 * hidden));
    mlp_proj = register_module("mlp_proj", torch::nn::Linear(4 * hidden, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor qkv = c_attn(ln_1(x));
    const int64_t b = qkv.size(0), s = qkv.size(1);
    qkv = qkv.view({b, s, heads, 3, head_dim}).permute({3, 0, 2, 1, 4});
#if TORCH_VERSION_MAJOR >= 2
    // The fused kernel (flash or memory-efficient where the device has one).
    torch::Tensor y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, /*is_causal=*/true);
#else
    torch::Tensor scores = torch::matmul(qkv[0], qkv[1].transpose(-2, -1)) / std::sqrt(double(head_dim));
    torch::Tensor causal = torch::ones({s, s}, x.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
    torch::Tensor y = torch::matmul(torch::softmax(scores, -1), qkv[2]);
#endif
    y = y.permute({0, 2, 1, 3}).reshape({b, s, -1});
    torch::Tensor h = x + attn_proj(y);
    return h + mlp_proj(torch::gelu(c_fc(ln_2(h))));
  }
  int64_t heads, head_dim;
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  torch::nn::Linear c_attn{nullptr}, attn_proj{nullptr}, c_fc{nullptr}, mlp_proj{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  GPTImpl(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t hidden) {
    wte = register_module("wte", torch::nn::Embedding(vocab, hidden));
    wpe = register_module("wpe", torch::nn::Embedding(context, hidden));
    for (int64_t i = 0; i < layers; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), Block(hidden, heads)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    torch::Tensor x = wte(ids) + wpe(torch::arange(ids.size(1), ids.options()));
    for (auto& b : blocks) x = b(x);
    torch::Tensor logits = torch::matmul(ln_f(x), wte->weight.t());  // tied head
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }
  // Loads tessera's full state (models::GPT::full_state names).
  void load(const std::map<std::string, torch::Tensor>& s) {
    torch::NoGradGuard no_grad;
    wte->weight.copy_(s.at("wte.weight"));
    wpe->weight.copy_(s.at("wpe.weight"));
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string p = "h." + std::to_string(i) + ".";
      auto& b = *blocks[i];
      b.ln_1->weight.copy_(s.at(p + "ln_1.weight"));
      b.ln_1->bias.copy_(s.at(p + "ln_1.bias"));
      b.c_attn->weight.copy_(s.at(p + "attn.c_attn.weight"));
      b.c_attn->bias.copy_(s.at(p + "attn.c_attn.bias"));
      b.attn_proj->weight.copy_(s.at(p + "attn.c_proj.weight"));
      b.attn_proj->bias.copy_(s.at(p + "attn.c_proj.bias"));
      b.ln_2->weight.copy_(s.at(p + "ln_2.weight"));
      b.ln_2->bias.copy_(s.at(p + "ln_2.bias"));
      b.c_fc->weight.copy_(s.at(p + "mlp.c_fc.weight"));
      b.c_fc->bias.copy_(s.at(p + "mlp.c_fc.bias"));
      b.mlp_proj->weight.copy_(s.at(p + "mlp.c_proj.weight"));
      b.mlp_proj->bias.copy_(s.at(p + "mlp.c_proj.bias"));
    }
    ln_f->weight.copy_(s.at("ln_f.weight"));
    ln_f->bias.copy_(s.at("ln_f.bias"));
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(GPT);

}  // namespace baseline
