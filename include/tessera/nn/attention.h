#pragma once
// Causal self-attention over the tokens a rank holds, the core_attention
// slot of the layer factory when every key a query needs is local (1D and
// its sequence-parallel variant, whose c_attn gathers the whole sequence).
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>

namespace tessera {
namespace nn {

class LocalAttentionImpl : public torch::nn::Module {
 public:
  // `dropout`: applied to the attention probabilities (a ParallelDropout).
  LocalAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout);
  // q, k, v [b, heads, tokens, head_dim]; positions [tokens] (their places
  // in the sequence): a query attends to keys at positions <= its own.
  // With LibTorch 2.x and no dropout drawn it runs the fused kernel (Note
  // [Fused attention] in attention.cpp).
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

 private:
  // The dropout is an Identity, or a ParallelDropout that draws nothing (eval, or p = 0).
  bool draws_nothing() const;

  int64_t head_dim_;
  torch::nn::AnyModule dropout_;
};

TORCH_MODULE(LocalAttention);

// The MLP of a block: GPT-2's c_proj(gelu(c_fc(x))), or Llama's SwiGLU
// c_proj(silu(c_gate(x)) · c_fc(x)) (Shazeer 2020; c_gate is Hugging Face's
// gate_proj, c_fc its up_proj, c_proj its down_proj). kGeluTanh: GELU's
// tanh approximation, Hugging Face GPT-2's "gelu_new".
enum class MLPKind { kGelu, kSwiGLU, kGeluTanh };

// The mlp slot: the linears made by a factory (column, then row in 1D), so
// that block layout goes in and comes out.
class MLPImpl : public torch::nn::Module {
 public:
  MLPImpl(torch::nn::AnyModule c_fc, torch::nn::AnyModule c_proj, bool tanh_gelu = false);
  // SwiGLU: c_gate and c_fc read entry(x) (LayerFactory::column_entry).
  MLPImpl(torch::nn::AnyModule c_gate, torch::nn::AnyModule c_fc, torch::nn::AnyModule c_proj,
          std::function<at::Tensor(const at::Tensor&)> entry);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::AnyModule c_gate, c_fc, c_proj;  // c_gate empty for GELU

 private:
  std::function<at::Tensor(const at::Tensor&)> entry_;
  bool tanh_gelu_ = false;
};

TORCH_MODULE(MLP);

}  // namespace nn
}  // namespace tessera
