#include "tessera/optim/loss_scaler.h"

#include "tessera/parallel/sharded_optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>

namespace tessera {
namespace optim {

void LossScalerOptions::validate() const {
  TORCH_CHECK(init_scale() > 0 && std::isfinite(init_scale()), "LossScaler: init_scale must be a positive number, got ",
              init_scale());
  TORCH_CHECK(growth_factor() > 1, "LossScaler: growth_factor must be > 1, got ", growth_factor());
  TORCH_CHECK(backoff_factor() > 0 && backoff_factor() < 1, "LossScaler: backoff_factor must be in (0, 1), got ",
              backoff_factor());
  TORCH_CHECK(growth_interval() >= 1, "LossScaler: growth_interval must be >= 1, got ", growth_interval());
  TORCH_CHECK(hysteresis() >= 1, "LossScaler: hysteresis must be >= 1, got ", hysteresis());
  TORCH_CHECK(min_scale() > 0 && min_scale() <= init_scale(), "LossScaler: min_scale must be in (0, init_scale], got ",
              min_scale());
}

LossScaler::LossScaler(comm::CommunicatorPtr group, LossScalerOptions options)
    : group_(std::move(group)),
      options_(options),
      scale_(options.init_scale()),
      hysteresis_left_(options.hysteresis()) {
  TORCH_CHECK(group_ != nullptr, "LossScaler needs the group whose ranks agree on overflows");
  options_.validate();
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const { return loss * scale_; }

bool LossScaler::unscale(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  // One flag on the gradients' device, read once after the all-reduce (Note
  // [One host sync per step] in whole_norms.cpp).
  at::Tensor overflow;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad();
    g.mul_(1.0 / scale_);
    const at::Tensor bad = at::isfinite(g).logical_not().any().to(at::kFloat).view({1});
    overflow = overflow.defined() ? at::maximum(overflow, bad) : bad;
  }
  if (!overflow.defined()) {
    c10::Device device(c10::kCPU);
    for (const auto& p : params) {
      device = p.device();
      break;
    }
    overflow = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  comm::AllReduceOptions max;
  max.op = comm::ReduceOp::kMax;
  group_->all_reduce(overflow, max);
  return overflow.item<float>() == 0;
}

void LossScaler::update(bool overflow) {
  if (overflow) {
    ++skipped_;
    clean_steps_ = 0;
    if (hysteresis_left_ <= 1) {
      scale_ = std::max(scale_ * options_.backoff_factor(), options_.min_scale());
    } else {
      --hysteresis_left_;
    }
    return;
  }
  if (++clean_steps_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    clean_steps_ = 0;
    hysteresis_left_ = options_.hysteresis();
  }
}

bool LossScaler::step(parallel::ShardedOptimizer& optimizer) {
  const bool ok = unscale(optimizer.pieces_for_step());
  if (ok) {
    optimizer.step();
  } else {
    optimizer.skip_step();
  }
  update(!ok);
  return ok;
}

void LossScaler::load_state(const State& s) {
  TORCH_CHECK(s.scale > 0 && std::isfinite(s.scale), "LossScaler: a loaded scale must be positive and finite, got ",
              s.scale);
  scale_ = s.scale;
  clean_steps_ = s.clean_steps;
  hysteresis_left_ = s.hysteresis_left;
  skipped_ = s.skipped;
}

}  // namespace optim
}  // namespace tessera
