#include "tessera/nn/attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace tessera {
namespace nn {

LocalAttentionImpl::LocalAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout)
    : head_dim_(head_dim), dropout_(std::move(dropout)) {
  TORCH_CHECK(head_dim_ > 0, "LocalAttention: head_dim must be positive, got ", head_dim_);
  register_module("dropout", dropout_.ptr());
}

at::Tensor LocalAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes() && q.size(-1) == head_dim_,
              "LocalAttention: q, k, v must be [batch, heads, tokens, ", head_dim_, "] alike, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(2), "LocalAttention: positions must be [",
              q.size(2), "], got ", positions.sizes());
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  const at::Tensor pos = positions.to(q.device());
  const at::Tensor future = pos.unsqueeze(0) > pos.unsqueeze(1);  // [query, key]: the key comes later
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  return at::matmul(dropout_.forward(at::softmax(scores, -1)), v);
}

MLPImpl::MLPImpl(torch::nn::AnyModule fc, torch::nn::AnyModule proj) : c_fc(std::move(fc)), c_proj(std::move(proj)) {
  register_module("c_fc", c_fc.ptr());
  register_module("c_proj", c_proj.ptr());
}

at::Tensor MLPImpl::forward(const at::Tensor& x) { return c_proj.forward(at::gelu(c_fc.forward(x))); }

}  // namespace nn
}  // namespace tessera
