#include "tessera/nn/linear_2d.h"

#include "linear_init.h"
#include "tessera/nn/init.h"
#include "tessera/nn/shard.h"
#include "tessera/nn/summa.h"

#include <ATen/ATen.h>

#include <cmath>

namespace tessera {
namespace nn {

Linear2DImpl::Linear2DImpl(const Linear2DOptions& options_, comm::CommunicatorPtr row, comm::CommunicatorPtr col,
                           comm::CommunicatorPtr depth)
    : options(options_), row_(std::move(row)), col_(std::move(col)), depth_(std::move(depth)) {
  TORCH_CHECK(row_ && col_, "Linear2D needs the row and column communicators of the 2D grid");
  TORCH_CHECK(row_->size() == col_->size(), "Linear2D: the row group has ", row_->size(),
              " ranks and the column group ", col_->size(), "; the 2D grid must be square (tensor size q*q)");
  reset();
}

void Linear2DImpl::reset() {
  const int64_t q = row_->size();
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "Linear2D: in_features and out_features must be positive, got ", options.in_features(), " and ",
              options.out_features());
  const std::string hint = "choose sizes divisible by q (hidden sizes are not padded: padding would change the model)";
  check_divisible(options.in_features(), q, "Linear2D in_features", hint);
  check_divisible(options.out_features(), q, "Linear2D out_features", hint);
  weight = register_parameter("weight", at::empty({options.out_features() / q, options.in_features() / q}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features() / q}))
                        : register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void Linear2DImpl::reset_parameters() {
  init_linear_params(local_placements(), options.out_features(), options.in_features(), options.bias(),
                     options.init_seed());
}

NamedPlacements Linear2DImpl::local_placements() {
  const bool deep = depth_ && depth_->size() > 1;
  ParamPlacement w = replicated_placement(weight).shard(row_->name(), row_, 0).shard(col_->name(), col_, 1);
  if (deep) w.partial(depth_->name(), depth_);
  NamedPlacements out{{"weight", w}};
  if (options.bias()) {
    ParamPlacement b = replicated_placement(bias).shard(row_->name(), row_, 0).partial(col_->name(), col_);
    if (deep) b.partial(depth_->name(), depth_);
    out.emplace_back("bias", b);
  }
  return out;
}

void Linear2DImpl::load_full(const at::Tensor& full_w, const at::Tensor& full_b) {
  TORCH_CHECK(full_w.dim() == 2 && full_w.size(0) == options.out_features() && full_w.size(1) == options.in_features(),
              "Linear2D::load_full: weight of shape ", full_w.sizes(), " given, [", options.out_features(), ", ",
              options.in_features(), "] expected");
  TORCH_CHECK(!options.bias() || (full_b.defined() && full_b.dim() == 1 && full_b.size(0) == options.out_features()),
              "Linear2D::load_full: bias of ", options.out_features(), " elements expected");
  for (const auto& [name, p] : local_placements()) nn::load_full(p, name == "weight" ? full_w : full_b);
}

at::Tensor Linear2DImpl::full_weight() { return full_value(local_placements().at(0).second); }

at::Tensor Linear2DImpl::full_bias() {
  return options.bias() ? full_value(local_placements().at(1).second) : at::Tensor();
}

at::Tensor Linear2DImpl::forward(const at::Tensor& input) {
  const int64_t q = row_->size();
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features() / q, "Linear2D: input has ",
              input.dim() >= 1 ? input.size(-1) : 0, " features in its last dimension, in_features / q = ",
              options.in_features(), " / ", q, " = ", options.in_features() / q,
              " expected (the input is this rank's hidden block, Note [2D and 2.5D layouts])");
  at::Tensor y = summa_matmul(input, weight.t(), row_, col_);
  return options.bias() ? y + bias : y;
}

void Linear2DImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::Linear2D(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", q=" << row_->size() << ", depth=" << (depth_ ? depth_->size() : 1) << ", bias=" << std::boolalpha
         << options.bias() << ")";
}

}  // namespace nn
}  // namespace tessera
