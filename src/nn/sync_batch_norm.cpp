#include "tessera/nn/sync_batch_norm.h"

#include "tessera/comm/functional.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <vector>

namespace tessera {
namespace nn {
namespace {

// All-reduce (sum) whose adjoint is an all-reduce (Note [Synchronized batch statistics]).
at::Tensor sum_over(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  if (!group || group->size() == 1) return x;
  return comm::reduce_from_group(comm::copy_to_group(x, group), group);
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const SyncBatchNormOptions& options_) : options(options_) { reset(); }

void SyncBatchNormImpl::reset() {
  TORCH_CHECK(options.num_features() > 0, "SyncBatchNorm: num_features must be positive, got ",
              options.num_features());
  TORCH_CHECK(options.eps() > 0, "SyncBatchNorm: eps must be positive, got ", options.eps());
  TORCH_CHECK(!options.momentum() || (*options.momentum() >= 0 && *options.momentum() <= 1),
              "SyncBatchNorm: momentum must lie in [0, 1], got ", options.momentum() ? *options.momentum() : 0.0);
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", at::empty({c}));
    bias = register_parameter("bias", at::empty({c}));
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", at::zeros({c}));
    running_var = register_buffer("running_var", at::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", at::zeros({}, at::kLong));
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  at::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  at::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats()
         << ", ranks=" << (options.group() ? options.group()->size() : 1) << ")";
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  const int64_t c = options.num_features();
  TORCH_CHECK(input.dim() >= 2 && input.size(1) == c, "SyncBatchNorm: expects input [N, ", c,
              ", *] (channels in dimension 1), got ", input.sizes());
  if (!is_training() && options.track_running_stats()) {
    return at::batch_norm(input, weight, bias, running_mean, running_var, /*training=*/false, 0.0, options.eps(),
                          /*cudnn_enabled=*/true);
  }
  std::vector<int64_t> dims{0};
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = c;
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  // Statistics in fp32 at least (bf16 inputs), the output in the input's dtype.
  const auto acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor x = input.to(acc);

  const at::Tensor local_count = at::full({1}, static_cast<double>(input.numel() / c), x.options());
  const at::Tensor sums = sum_over(at::cat({x.sum(dims), local_count}), options.group());
  const at::Tensor count = sums.narrow(0, c, 1).detach();
  // Read the global count only when the local one cannot vouch for it: no
  // device-to-host synchronisation in the common case.
  if (input.numel() / c <= 1) {
    const double n = count.item<double>();
    TORCH_CHECK(n > 1, "SyncBatchNorm: expected more than 1 value per channel when training over the group, got ",
                n, " (input ", input.sizes(), ")");
  }
  const at::Tensor mean = sums.narrow(0, 0, c) / count;
  const at::Tensor centered = x - mean.view(shape);
  const at::Tensor var = sum_over((centered * centered).sum(dims), options.group()) / count;
  at::Tensor out = centered * at::rsqrt(var + options.eps()).view(shape);
  if (options.affine()) out = out * weight.to(acc).view(shape) + bias.to(acc).view(shape);

  if (is_training() && options.track_running_stats()) {
    at::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
    const double m = options.momentum() ? *options.momentum() : 1.0 / num_batches_tracked.item<double>();
    running_mean.mul_(1 - m).add_(mean.detach().to(running_mean.scalar_type()), m);
    running_var.mul_(1 - m).add_((var.detach() * count / (count - 1)).to(running_var.scalar_type()), m);
  }
  return out.to(input.scalar_type());
}

}  // namespace nn
}  // namespace tessera
