#pragma once
// Root-mean-square layer normalization (Zhang & Sennrich 2019), as Llama,
// Mistral and Qwen use it: y = x / sqrt(mean(x²) + eps) · weight, computed in
// fp32 and cast back to the input's type before the weight, no bias.
// LibTorch 1.13 has no RMSNorm module.
//
// A factory may give the layer a placement (LayerFactory::head_norm): Qwen 3's
// per-head q/k norms see only the heads and tokens of their rank, so their
// gradient is partial over the groups that split those. Without one the layer
// is placed like any replicated parameter.
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <ostream>

namespace tessera {
namespace nn {

struct RMSNormOptions {
  /* implicit */ RMSNormOptions(int64_t dim) : dim_(dim) {}  // NOLINT
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, eps) = 1e-5;
};

class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl>, public PlacedModule {
 public:
  using Placer = std::function<ParamPlacement(const at::Tensor&)>;
  explicit RMSNormImpl(const RMSNormOptions& options, Placer placer = nullptr);

  void reset() override;
  void reset_parameters();  // weight 1
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // x [..., dim] -> the same shape and type.
  at::Tensor forward(const at::Tensor& x);

  RMSNormOptions options;
  at::Tensor weight;  // [dim]

 private:
  Placer placer_;
};

TORCH_MODULE(RMSNorm);

// The normalization itself, for layers whose statistics span a group
// (LayerNorm2D): x · rsqrt(mean_square + eps), in x's type.
at::Tensor rms_normalize(const at::Tensor& x, const at::Tensor& mean_square, double eps);

}  // namespace nn
}  // namespace tessera
