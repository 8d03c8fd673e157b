#include "tessera/nn/column_parallel_linear.h"

#include "linear_init.h"
#include "tessera/comm/functional.h"
#include "tessera/nn/init.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace tessera {
namespace nn {

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options_,
                                                   comm::CommunicatorPtr tensor_group)
    : options(options_), group_(std::move(tensor_group)) {
  TORCH_CHECK(group_ != nullptr, "ColumnParallelLinear needs a tensor-parallel communicator");
  reset();
}

void ColumnParallelLinearImpl::reset() {
  const int64_t n = group_->size();
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "ColumnParallelLinear: in_features and out_features must be positive, got ", options.in_features(),
              " and ", options.out_features());
  check_divisible(options.out_features(), n, "ColumnParallelLinear out_features",
                  "choose a size divisible by it (hidden sizes are not padded: padding would change the model)");
  weight = register_parameter("weight", at::empty({options.out_features() / n, options.in_features()}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features() / n}))
                        : register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void ColumnParallelLinearImpl::reset_parameters() {
  init_linear_params(local_placements(), options.out_features(), options.in_features(), options.bias(),
                     options.init_seed());
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& full_w, const at::Tensor& full_b) {
  TORCH_CHECK(full_w.dim() == 2 && full_w.size(0) == options.out_features() && full_w.size(1) == options.in_features(),
              "ColumnParallelLinear::load_full: weight of shape ", full_w.sizes(), " given, [", options.out_features(),
              ", ", options.in_features(), "] expected");
  at::NoGradGuard no_grad;
  weight.copy_(shard_of(full_w, 0, *group_));
  if (options.bias()) {
    TORCH_CHECK(full_b.defined() && full_b.dim() == 1 && full_b.size(0) == options.out_features(),
                "ColumnParallelLinear::load_full: bias of ", options.out_features(), " elements expected");
    bias.copy_(shard_of(full_b, 0, *group_));
  }
}

at::Tensor ColumnParallelLinearImpl::full_weight() const { return unshard(weight, 0, *group_); }

at::Tensor ColumnParallelLinearImpl::full_bias() const {
  return options.bias() ? unshard(bias, 0, *group_) : at::Tensor();
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  TORCH_CHECK(input.size(-1) == options.in_features(), "ColumnParallelLinear: input has ", input.size(-1),
              " features in its last dimension, ", options.in_features(), " expected");
  const at::Tensor x = options.input_entered()        ? input
                       : options.sequence_parallel() ? comm::all_gather_along_dim(input, options.sequence_dim(), group_)
                                                     : comm::copy_to_group(input, group_);
  at::Tensor y = at::linear(x, weight, bias);
  return options.gather_output() ? comm::gather_along_dim(y, -1, group_) : y;
}

NamedPlacements ColumnParallelLinearImpl::local_placements() {
  NamedPlacements out;
  out.emplace_back("weight", sharded_placement(weight, 0, options.out_features(), group_));
  if (options.bias()) out.emplace_back("bias", sharded_placement(bias, 0, options.out_features(), group_));
  return out;
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::ColumnParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << " (" << weight.size(0) << " per rank of " << group_->size()
         << "), bias=" << std::boolalpha << options.bias() << ", gather_output=" << options.gather_output()
         << ", sequence_parallel=" << options.sequence_parallel() << ")";
}

}  // namespace nn
}  // namespace tessera
