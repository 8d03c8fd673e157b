#pragma once
// Dynamic loss scaling for fp16 (and, if wanted, bf16) training: the loss is
// multiplied by a scale before backward so that small gradients survive the
// half-precision range; before the step the gradients are divided by it and
// checked for inf/NaN. The verdict is agreed by every rank of a group (one
// all-reduce), so an overflow anywhere skips the step everywhere: no weight
// and no optimizer state changes, and the scale backs off. After
// growth_interval clean steps it grows. See docs/optimizers.md.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <vector>

namespace tessera {
namespace parallel {
class ShardedOptimizer;
}

namespace optim {

struct LossScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  // Overflowing steps tolerated before the scale backs off (DeepSpeed's
  // hysteresis): 1 backs off at every overflow; the count resets when the
  // scale grows.
  TORCH_ARG(int64_t, hysteresis) = 2;
  TORCH_ARG(double, min_scale) = 1.0;

 public:
  // Throws naming the value that breaks its rule.
  void validate() const;
};

class LossScaler {
 public:
  // `group`: every rank whose gradients take part in a step (usually the world).
  LossScaler(comm::CommunicatorPtr group, LossScalerOptions options = {});

  // loss · scale, to call backward on.
  at::Tensor scale(const at::Tensor& loss) const;
  // Divides the gradients of `params` by the scale in place and checks them;
  // collective over the group. True when every rank's gradients are finite.
  bool unscale(const std::vector<at::Tensor>& params);
  // Records a step's verdict and adjusts the scale.
  void update(bool overflow);
  // unscale + ShardedOptimizer::step or skip_step + update; true if stepped.
  bool step(parallel::ShardedOptimizer& optimizer);

  // What a checkpoint keeps of the scaler.
  struct State {
    double scale = 0;
    int64_t clean_steps = 0;
    int64_t hysteresis_left = 0;
    int64_t skipped = 0;
  };
  State state() const { return {scale_, clean_steps_, hysteresis_left_, skipped_}; }
  void load_state(const State& s);

  double current_scale() const { return scale_; }
  int64_t skipped_steps() const { return skipped_; }
  const LossScalerOptions& options() const { return options_; }

 private:
  comm::CommunicatorPtr group_;
  LossScalerOptions options_;
  double scale_;
  int64_t clean_steps_ = 0;
  int64_t hysteresis_left_;
  int64_t skipped_ = 0;
};

}  // namespace optim
}  // namespace tessera
