#pragma once
// Finding one parameter's state in a torch::optim::Optimizer, and the
// tensors of the state types LibTorch ships. LibTorch's state map is keyed
// by the parameter's address, as a string in 1.13 and as a pointer in 2.x
// (docs/latest-libtorch.md, difference 1); state_key hides which.
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace tessera {

using OptimizerStateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// A template so that only the branch of this LibTorch's key type is compiled.
template <typename Key = OptimizerStateMap::key_type>
Key state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// The state of `param`, or null before its first step.
torch::optim::OptimizerParamState* find_state(torch::optim::Optimizer& optimizer, const at::Tensor& param);

// The defined tensors of a state of Adam, AdamW, SGD, RMSprop or Adagrad;
// `known` is set false (and nothing returned) for any other state type.
std::vector<at::Tensor> libtorch_state_tensors(const torch::optim::OptimizerParamState& state, bool& known);

}  // namespace tessera
