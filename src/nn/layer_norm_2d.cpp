#include "tessera/nn/layer_norm_2d.h"

#include "tessera/comm/functional.h"
#include "tessera/nn/rms_norm.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace nn {
namespace {

// Σ over the row group of a per-rank partial sum, differentiable: each
// rank's statistic feeds only its own hidden block, so the backward sums
// the gradients over the group as well (copy_to_group), not identity as
// Megatron's replicated consumers allow.
at::Tensor row_sum(const at::Tensor& partial, const comm::CommunicatorPtr& row) {
  return comm::reduce_from_group(comm::copy_to_group(partial, row), row);
}

}  // namespace

LayerNorm2DImpl::LayerNorm2DImpl(const LayerNorm2DOptions& options_, comm::CommunicatorPtr row,
                                 comm::CommunicatorPtr col, comm::CommunicatorPtr depth)
    : options(options_), row_(std::move(row)), col_(std::move(col)), depth_(std::move(depth)) {
  TORCH_CHECK(row_ && col_, "LayerNorm2D needs the row and column communicators of the 2D grid");
  reset();
}

void LayerNorm2DImpl::reset() {
  TORCH_CHECK(options.hidden() > 0, "LayerNorm2D: hidden must be positive, got ", options.hidden());
  TORCH_CHECK(options.eps() > 0, "LayerNorm2D: eps must be positive, got ", options.eps());
  check_divisible(options.hidden(), row_->size(), "LayerNorm2D hidden", "choose a hidden size divisible by q");
  weight = register_parameter("weight", at::empty({options.hidden() / row_->size()}));
  if (!options.rms()) bias = register_parameter("bias", at::empty({options.hidden() / row_->size()}));
  reset_parameters();
}

void LayerNorm2DImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  weight.fill_(1.0);
  if (bias.defined()) bias.zero_();
}

NamedPlacements LayerNorm2DImpl::local_placements() {
  NamedPlacements out;
  for (auto* p : {&weight, &bias}) {
    if (!p->defined()) continue;
    ParamPlacement placed = replicated_placement(*p).shard(row_->name(), row_, 0).partial(col_->name(), col_);
    if (depth_ && depth_->size() > 1) placed.partial(depth_->name(), depth_);
    out.emplace_back(p == &weight ? "weight" : "bias", placed);
  }
  return out;
}

at::Tensor LayerNorm2DImpl::forward(const at::Tensor& input) {
  const int64_t local = options.hidden() / row_->size();
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == local, "LayerNorm2D: input has ",
              input.dim() >= 1 ? input.size(-1) : 0, " features in its last dimension, hidden / q = ", local,
              " expected (the input is this rank's hidden block)");
  const double n = static_cast<double>(options.hidden());
  if (options.rms()) {
    const at::Tensor mean_square = row_sum(input.to(at::kFloat).pow(2).sum(-1, /*keepdim=*/true), row_) / n;
    return weight * rms_normalize(input, mean_square, options.eps());
  }
  const at::Tensor mean = row_sum(input.sum(-1, /*keepdim=*/true), row_) / n;
  const at::Tensor centered = input - mean;
  const at::Tensor var = row_sum(centered.pow(2).sum(-1, /*keepdim=*/true), row_) / n;
  return centered * at::rsqrt(var + options.eps()) * weight + bias;
}

void LayerNorm2DImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::LayerNorm2D(" << (options.rms() ? "rms, " : "") << "hidden=" << options.hidden()
         << ", q=" << row_->size()
         << ", eps=" << options.eps() << ")";
}

}  // namespace nn
}  // namespace tessera
