#pragma once
// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning",
// Algorithm 2) as a torch::optim::Optimizer. Per parameter w with gradient g
// at step t:
//   m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
//   m^ = m / (1 - b1^t), v^ = v / (1 - b2^t)   (bias_correction; else m, v)
//   u = m^ / (sqrt(v^) + eps) + weight_decay w        (eps outside the root)
//   r = ||w|| / ||u||, 1 when either norm is 0, at most max_trust_ratio if > 0
//   w = w - lr r u
// with r = 1 for groups whose adaptation is off (biases and norms by
// param_groups.h). The norms are of whole parameters when the optimizer is
// given a WholeNorms (Note [Whole-parameter norms]); ShardedOptimizer gives
// it one for ZeRO pieces. See docs/optimizers.md.
#include "tessera/parallel/whole_norms.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <tuple>
#include <vector>

namespace tessera {
namespace optim {

struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  LambOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(bool, bias_correction) = true;
  // Upper bound of the trust ratio; 0 leaves it unbounded.
  TORCH_ARG(double, max_trust_ratio) = 0;
  // Layer-wise adaptation (the trust ratio); off gives Adam with decoupled decay.
  TORCH_ARG(bool, adaptation) = true;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  // Throws naming the value that breaks its rule (lr >= 0, 0 <= beta < 1, eps > 0, ...).
  void validate() const;
};

struct LambParamState : public torch::optim::OptimizerCloneableParamState<LambParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
};

class Lamb : public torch::optim::Optimizer, public parallel::NormAware, public parallel::StateTensors {
 public:
  explicit Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults = {});
  explicit Lamb(std::vector<at::Tensor> params, LambOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
  void set_whole_norms(parallel::WholeNormsPtr norms) override { norms_ = std::move(norms); }
  std::vector<at::Tensor> state_tensors() const override;
  // State by the parameter's position in the groups, not by address
  // (readable by 1.13 and 2.x builds alike).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // The trust ratio each parameter got at the last step, in group order.
  const std::vector<double>& last_trust_ratios() const { return trust_; }

 private:
  parallel::WholeNormsPtr norms_;
  std::vector<double> trust_;
};

}  // namespace optim
}  // namespace tessera
