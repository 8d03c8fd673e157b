#pragma once
// Optimizers by name, for commands and configuration files, and the name of
// an optimizer's family, which checkpoints record: the one table of names
// both directions read.
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace optim {

struct OptimizerByName {
  // One of optimizer_names().
  TORCH_ARG(std::string, name) = "adamw";
  TORCH_ARG(double, lr) = 1e-3;
  // AdamW, Adam, LAMB, LARS; SGD takes none.
  TORCH_ARG(double, weight_decay) = 0.0;
  // SGD's momentum.
  TORCH_ARG(double, momentum) = 0.9;

 public:
  OptimizerByName() = default;
};

// "adamw", "adam", "sgd", "lamb", "lars".
const std::vector<std::string>& optimizer_names();

// The optimizer over (name, parameter) pairs. LAMB and LARS get
// param_groups(): biases and norms without weight decay or adaptation.
// Throws naming the valid names when options.name() is none of them.
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerByName& options,
                                                        const std::vector<std::pair<std::string, at::Tensor>>& named);

// The family of `optimizer` among optimizer_names(); empty for any other.
std::string optimizer_name(const torch::optim::Optimizer& optimizer);

}  // namespace optim
}  // namespace tessera
