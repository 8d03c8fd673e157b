#pragma once
// The Llama family's weights between the plain-LibTorch reference
// (reference_llama.h: Hugging Face's names and layouts) and tessera's
// models::GPT (Note [GPT full weights]), for the tests that compare them.
#include "reference_llama.h"

#include "tessera/models/gpt.h"

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace tessera {
namespace test {

inline ReferenceLlamaConfig reference_llama_config(const models::GPTConfig& c) {
  ReferenceLlamaConfig r;
  r.vocab = c.vocab(), r.hidden = c.hidden(), r.layers = c.layers(), r.heads = c.heads();
  r.kv_heads = c.num_kv_heads(), r.head_dim = c.dim_per_head(), r.ffn = c.ffn_size();
  r.norm_eps = c.norm_eps(), r.rope_theta = c.rope_theta();
  if (c.rope_scaling()) {
    const auto& s = *c.rope_scaling();
    r.llama3_scaling = true, r.rope_factor = s.factor(), r.low_freq_factor = s.low_freq_factor();
    r.high_freq_factor = s.high_freq_factor(), r.original_context = s.original_context();
  }
  r.qkv_bias = c.qkv_bias(), r.qk_norm = c.qk_norm(), r.tied = c.tied();
  r.experts = c.experts(), r.moe_every = c.moe_every(), r.top_k = c.top_k(), r.renormalize = c.renormalize();
  return r;
}

// Hugging Face's names and layouts -> tessera's (Note [GPT full weights]):
// q, k, v rows packed per head (multi-head) or k, v per kv head (grouped),
// the experts' w1, w3, w2 stacked. A permutation, so it maps gradients too.
inline std::map<std::string, at::Tensor> to_tessera(const std::map<std::string, at::Tensor>& hf,
                                                   const models::GPTConfig& c) {
  std::map<std::string, at::Tensor> t;
  const int64_t heads = c.heads(), kv = c.num_kv_heads(), d = c.dim_per_head();
  t["wte.weight"] = hf.at("model.embed_tokens.weight");
  t["ln_f.weight"] = hf.at("model.norm.weight");
  if (!c.tied()) t["lm_head.weight"] = hf.at("lm_head.weight");
  // [n·d, ...] -> [n, d, ...]
  auto per_head = [&](const at::Tensor& x, int64_t n) {
    std::vector<int64_t> shape = {n, d};
    for (int64_t i = 1; i < x.dim(); ++i) shape.push_back(x.size(i));
    return x.reshape(shape);
  };
  for (int64_t i = 0; i < c.layers(); ++i) {
    const std::string hp = "model.layers." + std::to_string(i) + ".", tp = "h." + std::to_string(i) + ".";
    t[tp + "ln_1.weight"] = hf.at(hp + "input_layernorm.weight");
    t[tp + "ln_2.weight"] = hf.at(hp + "post_attention_layernorm.weight");
    t[tp + "attn.c_proj.weight"] = hf.at(hp + "self_attn.o_proj.weight");
    for (const std::string kind : {"weight", "bias"}) {
      if (kind == "bias" && !c.qkv_bias()) continue;
      const at::Tensor q = hf.at(hp + "self_attn.q_proj." + kind), k = hf.at(hp + "self_attn.k_proj." + kind),
                       v = hf.at(hp + "self_attn.v_proj." + kind);
      if (c.grouped_attention()) {
        t[tp + "attn.q_proj." + kind] = q;
        t[tp + "attn.kv_proj." + kind] = at::stack({per_head(k, kv), per_head(v, kv)}, 1).flatten(0, 2);
      } else {
        t[tp + "attn.c_attn." + kind] =
            at::stack({per_head(q, heads), per_head(k, heads), per_head(v, heads)}, 1).flatten(0, 2);
      }
    }
    if (c.qk_norm()) {
      t[tp + "attn.q_norm.weight"] = hf.at(hp + "self_attn.q_norm.weight");
      t[tp + "attn.k_norm.weight"] = hf.at(hp + "self_attn.k_norm.weight");
    }
    if (c.moe_block(i)) {
      const std::string moe = hp + "block_sparse_moe.";
      t[tp + "mlp.router.weight"] = hf.at(moe + "gate.weight");
      std::vector<at::Tensor> gate, up, down;
      for (int64_t e = 0; e < c.experts(); ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        gate.push_back(hf.at(expert + "w1.weight"));
        up.push_back(hf.at(expert + "w3.weight"));
        down.push_back(hf.at(expert + "w2.weight"));
      }
      t[tp + "mlp.c_gate.weight"] = at::stack(gate);
      t[tp + "mlp.c_fc.weight"] = at::stack(up);
      t[tp + "mlp.c_proj.weight"] = at::stack(down);
    } else {
      t[tp + "mlp.c_gate.weight"] = hf.at(hp + "mlp.gate_proj.weight");
      t[tp + "mlp.c_fc.weight"] = hf.at(hp + "mlp.up_proj.weight");
      t[tp + "mlp.c_proj.weight"] = hf.at(hp + "mlp.down_proj.weight");
    }
  }
  return t;
}

}  // namespace test
}  // namespace tessera
