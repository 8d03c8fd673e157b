#include "tessera/nn/attention.h"

#include "tessera/nn/parallel_dropout.h"

#include "tiled_attention.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

namespace tessera {
namespace nn {

LocalAttentionImpl::LocalAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout)
    : head_dim_(head_dim), dropout_(std::move(dropout)) {
  TORCH_CHECK(head_dim_ > 0, "LocalAttention: head_dim must be positive, got ", head_dim_);
  register_module("dropout", dropout_.ptr());
}

bool LocalAttentionImpl::draws_nothing() const {
  if (dropout_.ptr()->as<torch::nn::IdentityImpl>() != nullptr) return true;
  const auto* drop = dropout_.ptr()->as<ParallelDropoutImpl>();
  return drop != nullptr && (!drop->is_training() || drop->options.p() == 0.0);
}

at::Tensor LocalAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes() && q.size(-1) == head_dim_,
              "LocalAttention: q, k, v must be [batch, heads, tokens, ", head_dim_, "] alike, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(2), "LocalAttention: positions must be [",
              q.size(2), "], got ", positions.sizes());
  auto future = [&] {  // [query, key]: the key comes later
    const at::Tensor pos = positions.to(q.device());
    return pos.unsqueeze(0) > pos.unsqueeze(1);
  };
  // Note [Fused attention]
  // With nothing to drop, the fused kernel (flash or memory-efficient
  // attention where the device has one) computes the same
  // softmax(q k^T / sqrt(d)) v without holding the [tokens, tokens] scores.
  // Consecutive positions are the causal mask; others (zigzag sequence
  // shards) pass it explicitly. On CPU it is used in fp32 and fp64 only:
  // LibTorch 2.15's CPU kernel, forward and backward of [8, 8, 128, 32] on
  // one thread, took 9.3 ms against 15.3 ms for the explicit form in fp32,
  // but 21.7 ms against 7.9 ms in bf16. LibTorch 1.13 has no fused kernel:
  // there fp32 and fp64 run ring attention's tiles on the whole sequence
  // (Note [Ring attention tiles]), which hold no [tokens, tokens] matrix either.
  const bool reduced = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  if (draws_nothing() && !(q.is_cpu() && reduced) && q.size(2) > 0) {
#if TORCH_VERSION_MAJOR >= 2
    const int64_t n = positions.size(0);
    const bool consecutive =
        positions.is_cpu() && (n == 0 || positions.equal(at::arange(n, positions.options()) + positions[0]));
    return consecutive ? at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true)
                       : at::scaled_dot_product_attention(q, k, v, future().logical_not(), 0.0, false);
#else
    if (!reduced) return detail::tiled_causal_attention(q, k, v, positions);
#endif
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  scores = scores.masked_fill(future(), -std::numeric_limits<float>::infinity());
  return at::matmul(dropout_.forward(at::softmax(scores, -1)), v);
}

MLPImpl::MLPImpl(torch::nn::AnyModule fc, torch::nn::AnyModule proj, bool tanh_gelu)
    : c_fc(std::move(fc)), c_proj(std::move(proj)), tanh_gelu_(tanh_gelu) {
  register_module("c_fc", c_fc.ptr());
  register_module("c_proj", c_proj.ptr());
}

MLPImpl::MLPImpl(torch::nn::AnyModule gate, torch::nn::AnyModule fc, torch::nn::AnyModule proj,
                 std::function<at::Tensor(const at::Tensor&)> entry)
    : c_gate(std::move(gate)), c_fc(std::move(fc)), c_proj(std::move(proj)), entry_(std::move(entry)) {
  register_module("c_gate", c_gate.ptr());
  register_module("c_fc", c_fc.ptr());
  register_module("c_proj", c_proj.ptr());
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  if (c_gate.is_empty()) return c_proj.forward(at::gelu(c_fc.forward(x), tanh_gelu_ ? "tanh" : "none"));
  const at::Tensor in = entry_(x);
  return c_proj.forward(at::silu(c_gate.forward(in)) * c_fc.forward(in));
}

}  // namespace nn
}  // namespace tessera
