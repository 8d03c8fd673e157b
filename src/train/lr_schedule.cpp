#include "tessera/train/lr_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace tessera {
namespace train {

LrDecay lr_decay_from_string(const std::string& name) {
  if (name == "constant") return LrDecay::kConstant;
  if (name == "cosine") return LrDecay::kCosine;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "polynomial") return LrDecay::kPolynomial;
  TORCH_CHECK(false, "unknown learning-rate decay '", name, "'; use constant, cosine, linear or polynomial");
}

std::string lr_decay_name(LrDecay decay) {
  switch (decay) {
    case LrDecay::kConstant:
      return "constant";
    case LrDecay::kCosine:
      return "cosine";
    case LrDecay::kLinear:
      return "linear";
    case LrDecay::kPolynomial:
      return "polynomial";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown learning-rate decay");
}

void LrSchedule::validate() const {
  TORCH_CHECK(peak() >= 0 && std::isfinite(peak()), "learning rate: the peak must be >= 0 and finite, got ", peak());
  TORCH_CHECK(warmup_steps() >= 0, "learning rate: warmup_steps must be >= 0, got ", warmup_steps());
  TORCH_CHECK(decay() == LrDecay::kConstant || total_steps() > warmup_steps(), "learning rate: total_steps (",
              total_steps(), ") must exceed warmup_steps (", warmup_steps(), ") for a decaying schedule");
  TORCH_CHECK(min_ratio() >= 0 && min_ratio() <= 1, "learning rate: min_ratio must be in [0, 1], got ", min_ratio());
  TORCH_CHECK(power() > 0, "learning rate: power must be > 0, got ", power());
}

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps()) return peak() * static_cast<double>(step + 1) / static_cast<double>(warmup_steps());
  if (decay() == LrDecay::kConstant) return peak();
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps() - warmup_steps()));
  const double p = std::min(1.0, static_cast<double>(step - warmup_steps()) / span);
  double f = 1;
  switch (decay()) {
    case LrDecay::kCosine:
      f = 0.5 * (1 + std::cos(M_PI * p));
      break;
    case LrDecay::kLinear:
      f = 1 - p;
      break;
    case LrDecay::kPolynomial:
      f = std::pow(1 - p, power());
      break;
    case LrDecay::kConstant:
      break;
  }
  return peak() * (min_ratio() + (1 - min_ratio()) * f);
}

}  // namespace train
}  // namespace tessera
