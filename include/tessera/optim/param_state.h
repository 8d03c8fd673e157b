#pragma once
// One parameter's optimizer state as named tensors and a step count, read
// from and written into LibTorch's optimizers (Adam, AdamW, SGD) and
// tessera's (LAMB, LARS), so that a checkpoint can store it by parameter
// name and element range and load it into another sharding (resharding).
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>

namespace tessera {
namespace optim {

struct ParamState {
  int64_t step = 0;
  std::map<std::string, at::Tensor> tensors;  // "exp_avg", "exp_avg_sq", "momentum_buffer", ...
};

// The state of `param` in `optimizer` (the tensors themselves, not copies);
// nullopt-like empty tensors map when the parameter has not stepped yet.
// Throws for an optimizer type it does not know.
ParamState get_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param);

// Creates or replaces the state of `param`: tensors are copied into state
// tensors shaped and typed like `param`. Names must be the ones
// get_param_state gives for this optimizer type.
void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param, const ParamState& state);

}  // namespace optim
}  // namespace tessera
