#pragma once
// Learning-rate schedules: linear warm-up to the peak, then constant,
// cosine, linear or polynomial decay to min_ratio · peak at total_steps
// (cosine for AdamW and LAMB, polynomial of power 2 for LARS, as the papers).
#include <torch/arg.h>

#include <cstdint>
#include <string>

namespace tessera {
namespace train {

enum class LrDecay { kConstant, kCosine, kLinear, kPolynomial };

// "constant", "cosine", "linear", "polynomial"; throws listing them.
LrDecay lr_decay_from_string(const std::string& name);
std::string lr_decay_name(LrDecay decay);

struct LrSchedule {
  TORCH_ARG(double, peak) = 1e-3;
  TORCH_ARG(int64_t, warmup_steps) = 0;
  TORCH_ARG(int64_t, total_steps) = 0;  // where the decay ends; needed unless constant
  TORCH_ARG(LrDecay, decay) = LrDecay::kConstant;
  TORCH_ARG(double, min_ratio) = 0.0;
  TORCH_ARG(double, power) = 2.0;  // polynomial decay

 public:
  // Throws naming the value that breaks its rule.
  void validate() const;
  // The rate of step `step` (0-based): warm-up gives peak·(step+1)/warmup.
  double at(int64_t step) const;
};

}  // namespace train
}  // namespace tessera
