#pragma once
// LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional
// Networks", Algorithm 1) as a torch::optim::Optimizer. Per parameter w with
// gradient g, weight decay beta and trust coefficient eta:
//   local_lr = eta ||w|| / (||g|| + beta ||w|| + eps)   (1 when ||w|| or ||g|| is 0)
//   v = momentum v + lr local_lr (g + beta w)
//   w = w - v
// The weight decay sits inside the local learning rate, as in the paper;
// local_lr = 1 for groups whose adaptation is off (param_groups.h). Norms
// are whole-parameter norms when a WholeNorms is given (Note
// [Whole-parameter norms]). See docs/optimizers.md.
#include "tessera/parallel/whole_norms.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace tessera {
namespace optim {

struct LarsOptions : public torch::optim::OptimizerCloneableOptions<LarsOptions> {
  LarsOptions(double lr = 0.1) : lr_(lr) {}  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 0.1;
  TORCH_ARG(double, momentum) = 0.9;
  TORCH_ARG(double, weight_decay) = 5e-4;
  TORCH_ARG(double, trust_coefficient) = 1e-3;
  TORCH_ARG(double, eps) = 1e-9;
  TORCH_ARG(bool, adaptation) = true;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void validate() const;
};

struct LarsParamState : public torch::optim::OptimizerCloneableParamState<LarsParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, momentum_buffer);
};

class Lars : public torch::optim::Optimizer, public parallel::NormAware, public parallel::StateTensors {
 public:
  explicit Lars(std::vector<torch::optim::OptimizerParamGroup> param_groups, LarsOptions defaults = {});
  explicit Lars(std::vector<at::Tensor> params, LarsOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
  void set_whole_norms(parallel::WholeNormsPtr norms) override { norms_ = std::move(norms); }
  std::vector<at::Tensor> state_tensors() const override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // The local learning rate (before lr) each parameter got at the last step.
  const std::vector<double>& last_local_lrs() const { return local_lr_; }

 private:
  parallel::WholeNormsPtr norms_;
  std::vector<double> local_lr_;
};

}  // namespace optim
}  // namespace tessera
