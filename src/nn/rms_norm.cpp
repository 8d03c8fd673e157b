#include "tessera/nn/rms_norm.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace nn {

RMSNormImpl::RMSNormImpl(const RMSNormOptions& options_, Placer placer)
    : options(options_), placer_(std::move(placer)) {
  reset();
}

void RMSNormImpl::reset() {
  TORCH_CHECK(options.dim() > 0, "RMSNorm: dim must be positive, got ", options.dim());
  TORCH_CHECK(options.eps() > 0, "RMSNorm: eps must be positive, got ", options.eps());
  weight = register_parameter("weight", at::empty({options.dim()}));
  reset_parameters();
}

void RMSNormImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  weight.fill_(1.0);
}

NamedPlacements RMSNormImpl::local_placements() {
  if (!placer_) return {};
  return {{"weight", placer_(weight)}};
}

at::Tensor rms_normalize(const at::Tensor& x, const at::Tensor& mean_square, double eps) {
  // fp32 statistics whatever the activations' type, as Hugging Face's models compute them.
  return (x.to(at::kFloat) * at::rsqrt(mean_square.to(at::kFloat) + eps)).to(x.scalar_type());
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == options.dim(), "RMSNorm: expected inputs [..., ", options.dim(),
              "], got shape ", x.sizes());
  const at::Tensor mean_square = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  return weight * rms_normalize(x, mean_square, options.eps());
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::RMSNorm(" << options.dim() << ", eps=" << options.eps() << ")";
}

}  // namespace nn
}  // namespace tessera
