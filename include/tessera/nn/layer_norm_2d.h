#pragma once
// Layer (or RMS) normalization over the hidden dimension of a 2D / 2.5D activation
// [b/q, s, h/q] (Note [2D and 2.5D layouts] in linear_2d.h): the mean and
// variance of each token are sums over the row group, whose ranks hold the
// token's hidden blocks. Weight and bias [h/q] are hidden block j:
// Shard(0) over row, Partial over col (each grid row normalizes its own
// batch rows) and, in 2.5D, over depth. 3D uses it as well, with row =
// 3d_output (layout A's hidden blocks), col = 3d_input and depth = 3d_weight
// (Note [3D layouts] in linear_3d.h).
#include "tessera/comm/communicator.h"
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>

namespace tessera {
namespace nn {

struct LayerNorm2DOptions {
  /* implicit */ LayerNorm2DOptions(int64_t hidden) : hidden_(hidden) {}  // NOLINT
  TORCH_ARG(int64_t, hidden);  // full size; divisible by q
  TORCH_ARG(double, eps) = 1e-5;
  // RMSNorm (nn/rms_norm.h) instead: no mean, no bias.
  TORCH_ARG(bool, rms) = false;
};

class LayerNorm2DImpl : public torch::nn::Cloneable<LayerNorm2DImpl>, public PlacedModule {
 public:
  // `depth` (2.5D) may be null or of size 1 for 2D.
  LayerNorm2DImpl(const LayerNorm2DOptions& options, comm::CommunicatorPtr row, comm::CommunicatorPtr col,
                  comm::CommunicatorPtr depth = nullptr);

  void reset() override;
  // Ones and zeros, as torch::nn::LayerNorm (no bias under rms).
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  NamedPlacements local_placements() override;
  // input [..., h/q]; returns the same shape.
  at::Tensor forward(const at::Tensor& input);

  LayerNorm2DOptions options;
  at::Tensor weight;  // [h/q]
  at::Tensor bias;    // [h/q]; undefined under rms

 private:
  comm::CommunicatorPtr row_, col_, depth_;
};

TORCH_MODULE(LayerNorm2D);

}  // namespace nn
}  // namespace tessera
