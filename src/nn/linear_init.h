#pragma once
// The full weight and bias of an [out, in] linear layer, drawn exactly as
// torch::nn::Linear::reset_parameters draws them (same generator calls in the
// same order), so a parallel layer sharding them equals the serial layer.
#include "tessera/nn/init.h"
#include "tessera/nn/placement.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Optional.h>
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

// A linear layer's placed "weight" (and "bias") with torch::nn::Linear's
// distributions: drawn blockwise from `seed` (Note [Layout-independent
// initialization]) or, without one, drawn full as Linear draws them and cut.
inline void init_linear_params(const NamedPlacements& placements, int64_t out_features, int64_t in_features,
                               bool with_bias, const c10::optional<uint64_t>& seed) {
  if (seed) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    for (const auto& [name, p] : placements) init_blockwise(p, *seed, name, uniform_draw(-bound, bound));
    return;
  }
  auto full = linear_init(out_features, in_features, with_bias);
  for (const auto& [name, p] : placements) load_full(p, name == "weight" ? full.first : full.second);
}

// An embedding table's placed "weight", N(0, 1) as torch::nn::Embedding's:
// blockwise from `seed`, or the unpadded [rows, cols] table drawn full (the
// same random stream as Embedding(rows, cols)) and cut, padding zero.
inline void init_embedding_params(const ParamPlacement& p, int64_t rows, int64_t cols,
                                  const c10::optional<uint64_t>& seed) {
  if (seed) {
    init_blockwise(p, *seed, "weight", normal_draw(0.0, 1.0));
    return;
  }
  at::Tensor full = at::empty({rows, cols}, p.param.options());
  {
    at::NoGradGuard no_grad;
    full.normal_(0, 1);
  }
  load_full(p, full);
}

}  // namespace nn
}  // namespace tessera
