#pragma once
// SyncBatchNorm: batch normalization whose batch statistics are those of the
// whole data-parallel batch (the mean and variance over every rank's
// samples), as PyTorch's torch.nn.SyncBatchNorm. For inputs [N, C, *]
// (BatchNorm1d/2d/3d alike). Same parameters and buffers as LibTorch's
// BatchNorm (weight, bias, running_mean, running_var, num_batches_tracked),
// so weights move between the two.
//
//   auto bn = tessera::nn::SyncBatchNorm(
//       tessera::nn::SyncBatchNormOptions(64).group(ctx->comm(context::ParallelMode::kData)));
//
// Note [Synchronized batch statistics]
// Training: each rank sums its samples per channel and the sums (and the
// sample count) are all-reduced; then the squared deviations from the global
// mean likewise (two passes: no cancellation, equal to the serial layer to
// rounding). The all-reduce's adjoint is an all-reduce, since every rank's
// loss depends on the global statistics: the gradient of each rank's input
// is that of the whole batch's loss, as in the serial layer. Four all-reduces
// of C + 1 values per layer and step (two forward, two backward); the global
// count is read to the host only when a rank holds at most one value per
// channel (to refuse a batch of one value per channel over the group). Evaluation uses the running statistics and communicates nothing.
// Running statistics are updated from the global statistics, so they are the
// same on every rank. A null group or a group of one is plain BatchNorm.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>

namespace tessera {
namespace nn {

struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  TORCH_ARG(int64_t, num_features);
  TORCH_ARG(double, eps) = 1e-5;
  // Unset: the cumulative average, as LibTorch's BatchNorm.
  TORCH_ARG(c10::optional<double>, momentum) = 0.1;
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, track_running_stats) = true;
  // The ranks whose batches are normalized together (the data group).
  TORCH_ARG(comm::CommunicatorPtr, group) = nullptr;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(const SyncBatchNormOptions& options);

  void reset() override;
  void reset_parameters();
  void reset_running_stats();
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& input);

  SyncBatchNormOptions options;
  at::Tensor weight, bias;
  at::Tensor running_mean, running_var, num_batches_tracked;
};

TORCH_MODULE(SyncBatchNorm);

}  // namespace nn
}  // namespace tessera
