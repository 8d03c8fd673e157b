#pragma once
// The full weight and bias of an [out, in] linear layer, drawn exactly as
// torch::nn::Linear::reset_parameters draws them (same generator calls in the
// same order), so a parallel layer sharding them equals the serial layer.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/init.h>

#include <cmath>
#include <utility>

namespace tessera {
namespace nn {

inline std::pair<at::Tensor, at::Tensor> linear_init(int64_t out_features, int64_t in_features, bool with_bias) {
  at::NoGradGuard no_grad;
  at::Tensor weight = at::empty({out_features, in_features});
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  at::Tensor bias;
  if (with_bias) {
    bias = at::empty({out_features});
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    torch::nn::init::uniform_(bias, -bound, bound);
  }
  return {weight, bias};
}

}  // namespace nn
}  // namespace tessera
