#include "tessera/nn/linear_3d.h"

#include "linear_init.h"
#include "tessera/nn/init.h"
#include "tessera/nn/matmul_3d.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>

#include <cmath>

namespace tessera {
namespace nn {

Linear3DImpl::Linear3DImpl(const Linear3DOptions& options_, comm::CommunicatorPtr input, comm::CommunicatorPtr weight,
                           comm::CommunicatorPtr output)
    : options(options_), input_(std::move(input)), weight_(std::move(weight)), output_(std::move(output)) {
  TORCH_CHECK(input_ && weight_ && output_, "Linear3D needs the input, weight and output communicators of the 3D cube");
  TORCH_CHECK(input_->size() == weight_->size() && input_->size() == output_->size(), "Linear3D: the input group has ",
              input_->size(), " ranks, the weight group ", weight_->size(), " and the output group ", output_->size(),
              "; the 3D cube must have q ranks along each (tensor size q³)");
  reset();
}

void Linear3DImpl::reset() {
  const int64_t q = input_->size();
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "Linear3D: in_features and out_features must be positive, got ", options.in_features(), " and ",
              options.out_features());
  const std::string hint = "in 3D the input features must divide by q² and the output features by q (hidden sizes "
                           "are not padded: padding would change the model)";
  check_divisible(options.in_features(), q * q, "Linear3D in_features", hint);
  check_divisible(options.out_features(), q, "Linear3D out_features", hint);
  weight = register_parameter("weight", at::empty({options.out_features() / q, options.in_features() / (q * q)}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features() / q}))
                        : register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void Linear3DImpl::reset_parameters() {
  init_linear_params(local_placements(), options.out_features(), options.in_features(), options.bias(),
                     options.init_seed());
}

NamedPlacements Linear3DImpl::local_placements() {
  NamedPlacements out{{"weight", replicated_placement(weight)
                                     .shard(input_->name(), input_, 0)
                                     .shard(output_->name(), output_, 1)
                                     .shard(weight_->name(), weight_, 1)}};
  if (options.bias()) {
    out.emplace_back("bias", replicated_placement(bias)
                                 .shard(input_->name(), input_, 0)
                                 .partial(output_->name(), output_)
                                 .partial(weight_->name(), weight_));
  }
  return out;
}

void Linear3DImpl::load_full(const at::Tensor& full_w, const at::Tensor& full_b) {
  TORCH_CHECK(full_w.dim() == 2 && full_w.size(0) == options.out_features() && full_w.size(1) == options.in_features(),
              "Linear3D::load_full: weight of shape ", full_w.sizes(), " given, [", options.out_features(), ", ",
              options.in_features(), "] expected");
  TORCH_CHECK(!options.bias() || (full_b.defined() && full_b.dim() == 1 && full_b.size(0) == options.out_features()),
              "Linear3D::load_full: bias of ", options.out_features(), " elements expected");
  for (const auto& [name, p] : local_placements()) nn::load_full(p, name == "weight" ? full_w : full_b);
}

at::Tensor Linear3DImpl::full_weight() { return full_value(local_placements().at(0).second); }

at::Tensor Linear3DImpl::forward(const at::Tensor& input) {
  const int64_t q = input_->size();
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features() / q, "Linear3D: input has ",
              input.dim() >= 1 ? input.size(-1) : 0, " features in its last dimension, in_features / q = ",
              options.in_features(), " / ", q, " = ", options.in_features() / q,
              " expected (the input is this rank's block, Note [3D layouts])");
  at::Tensor y = matmul_3d(input, weight, input_, weight_, output_);
  return options.bias() ? y + bias : y;
}

void Linear3DImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::Linear3D(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", q=" << input_->size() << ", bias=" << std::boolalpha << options.bias() << ")";
}

}  // namespace nn
}  // namespace tessera
