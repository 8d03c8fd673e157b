#pragma once
// Which parameters skip weight decay and layer adaptation, chosen by name,
// as BERT's LAMB does: by default biases and normalization weights.
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace optim {

// "bias", "ln_", "norm": a parameter whose name contains one of them is excluded.
std::vector<std::string> default_exclusion_patterns();

// True when `name` contains one of `patterns`.
bool excluded(const std::string& name, const std::vector<std::string>& patterns);

// Two groups: the parameters that get `options` as given, then the excluded
// ones with weight_decay 0 and adaptation off (an empty group is left out).
// Options is LambOptions or LarsOptions.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> param_groups(
    const std::vector<std::pair<std::string, at::Tensor>>& named, const Options& options,
    const std::vector<std::string>& patterns = default_exclusion_patterns()) {
  std::vector<at::Tensor> adapted, plain;
  for (const auto& [name, p] : named) (excluded(name, patterns) ? plain : adapted).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!adapted.empty()) groups.emplace_back(adapted, std::make_unique<Options>(options));
  if (!plain.empty()) {
    Options o = options;
    o.weight_decay(0).adaptation(false);
    groups.emplace_back(plain, std::make_unique<Options>(o));
  }
  return groups;
}

}  // namespace optim
}  // namespace tessera
