#pragma once
// Copies of a module's parameters (or, with gradients = true, of their
// gradients, zeros where none) by named_parameters() name: how the plain
// LibTorch references of the tests hand back their state. Nothing from tessera.
#include <torch/torch.h>

#include <map>
#include <string>

namespace tessera {
namespace test {

inline std::map<std::string, torch::Tensor> module_state(torch::nn::Module& module, bool gradients) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : module.named_parameters()) {
    const torch::Tensor& t = p.value();
    if (!gradients)
      out[p.key()] = t.detach().clone();
    else
      out[p.key()] = t.grad().defined() ? t.grad().detach().clone() : torch::zeros_like(t).detach();
  }
  return out;
}

}  // namespace test
}  // namespace tessera
