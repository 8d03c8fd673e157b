#pragma once
// Per-parameter optimizer state found by the parameter's address (LibTorch's
// own map, whose key type differs between 1.13 and 2.x: docs/latest-libtorch.md, difference 1) and
// saved by the parameter's position in the param groups, so a checkpoint
// does not depend on addresses or on the LibTorch version.
#include "tessera/core/optimizer_state.h"
#include "tessera/parallel/whole_norms.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <string>

namespace tessera {
namespace optim {
namespace detail {

using tessera::state_key;

// The state of p, created by `init` on first use.
template <typename State, typename Init>
State& state_of(torch::optim::Optimizer& opt, const at::Tensor& p, Init&& init) {
  auto& map = opt.state();
  const auto key = state_key(p);
  auto it = map.find(key);
  if (it == map.end()) {
    auto s = std::make_unique<State>();
    init(*s);
    it = map.emplace(key, std::move(s)).first;
  }
  return static_cast<State&>(*it->second);
}

// Calls fn(index, param) for every parameter of every group, in order.
template <typename Fn>
void for_each_param(const torch::optim::Optimizer& opt, Fn&& fn) {
  int64_t i = 0;
  for (const auto& group : opt.param_groups())
    for (const auto& p : group.params()) fn(i++, p);
}

// LibTorch 2.x replaces the options of a param group by the defaults merged
// with them field by field, but only for its own optimizer types; for ours
// it keeps the defaults alone. Puts back the options each group was given.
inline void restore_group_options(torch::optim::Optimizer& opt,
                                  const std::vector<torch::optim::OptimizerParamGroup>& given) {
  auto& groups = opt.param_groups();
  TORCH_INTERNAL_ASSERT(groups.size() == given.size());
  for (size_t i = 0; i < given.size(); ++i)
    if (given[i].has_options()) groups[i].set_options(given[i].options().clone());
}

// Runs the optimizer's closure, if any, with gradients on.
inline at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable(true);
  return closure();
}

// [n, 2] squared norms from two norms per parameter (in order), made whole
// by `whole` when given (Note [Whole-parameter norms]): one exchange per step.
inline at::Tensor pair_squares(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& norms,
                               const parallel::WholeNorms* whole) {
  const int64_t n = static_cast<int64_t>(params.size());
  at::Tensor squares = n == 0 ? at::zeros({0, 2}, at::kDouble) : at::stack(norms).to(at::kDouble).pow(2).view({n, 2});
  if (whole != nullptr) whole->reduce(params, squares);
  return squares;
}

inline std::string key(const char* optimizer, int64_t index, const char* field) {
  return std::string(optimizer) + "/" + std::to_string(index) + "/" + field;
}

}  // namespace detail
}  // namespace optim
}  // namespace tessera
