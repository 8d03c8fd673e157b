#include "tessera/nn/row_parallel_linear.h"

#include "linear_init.h"
#include "tessera/comm/functional.h"
#include "tessera/nn/init.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace tessera {
namespace nn {

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& options_,
                                             comm::CommunicatorPtr tensor_group)
    : options(options_), group_(std::move(tensor_group)) {
  TORCH_CHECK(group_ != nullptr, "RowParallelLinear needs a tensor-parallel communicator");
  reset();
}

void RowParallelLinearImpl::reset() {
  const int64_t n = group_->size();
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "RowParallelLinear: in_features and out_features must be positive, got ", options.in_features(), " and ",
              options.out_features());
  check_divisible(options.in_features(), n, "RowParallelLinear in_features",
                  "choose a size divisible by it (hidden sizes are not padded: padding would change the model)");
  weight = register_parameter("weight", at::empty({options.out_features(), options.in_features() / n}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features()}))
                        : register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void RowParallelLinearImpl::reset_parameters() {
  init_linear_params(local_placements(), options.out_features(), options.in_features(), options.bias(),
                     options.init_seed());
}

void RowParallelLinearImpl::load_full(const at::Tensor& full_w, const at::Tensor& full_b) {
  TORCH_CHECK(full_w.dim() == 2 && full_w.size(0) == options.out_features() && full_w.size(1) == options.in_features(),
              "RowParallelLinear::load_full: weight of shape ", full_w.sizes(), " given, [", options.out_features(),
              ", ", options.in_features(), "] expected");
  at::NoGradGuard no_grad;
  weight.copy_(shard_of(full_w, 1, *group_));
  if (options.bias()) {
    TORCH_CHECK(full_b.defined() && full_b.dim() == 1 && full_b.size(0) == options.out_features(),
                "RowParallelLinear::load_full: bias of ", options.out_features(), " elements expected");
    bias.copy_(full_b);
  }
}

at::Tensor RowParallelLinearImpl::full_weight() const { return unshard(weight, 1, *group_); }

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const int64_t local_in = weight.size(1);
  const at::Tensor x = options.input_is_parallel() ? input : comm::split_along_dim(input, -1, group_);
  TORCH_CHECK(x.size(-1) == local_in, "RowParallelLinear: this rank's input shard has ", x.size(-1), " features, ",
              local_in, " expected (in_features ", options.in_features(), " over ", group_->size(), " ranks",
              options.input_is_parallel() ? "; set input_is_parallel(false) to pass the full input" : "", ")");
  const at::Tensor partial = at::linear(x, weight);
  at::Tensor y = options.sequence_parallel() ? comm::reduce_scatter_along_dim(partial, options.sequence_dim(), group_)
                                             : comm::reduce_from_group(partial, group_);
  return options.bias() ? y + bias : y;
}

void RowParallelLinearImpl::reduce_partial_gradients() {
  if (!options.sequence_parallel() || !options.bias() || !bias.grad().defined()) return;
  at::NoGradGuard no_grad;
  group_->all_reduce(bias.mutable_grad());
}

NamedPlacements RowParallelLinearImpl::local_placements() {
  NamedPlacements out;
  out.emplace_back("weight", sharded_placement(weight, 1, options.in_features(), group_));
  if (options.bias()) {
    // Added after the reduction: replicated, but fed by this rank's sequence
    // shard only in the sequence-parallel variant.
    ParamPlacement b = replicated_placement(bias);
    if (options.sequence_parallel()) {
      b.partial("tensor", group_);
    } else {
      b.replicate("tensor", group_);
    }
    out.emplace_back("bias", std::move(b));
  }
  return out;
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::RowParallelLinear(in_features=" << options.in_features() << " (" << weight.size(1)
         << " per rank of " << group_->size() << "), out_features=" << options.out_features()
         << ", bias=" << std::boolalpha << options.bias() << ", input_is_parallel=" << options.input_is_parallel()
         << ", sequence_parallel=" << options.sequence_parallel() << ")";
}

}  // namespace nn
}  // namespace tessera
