#include "tessera/core/optimizer_state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace tessera {

torch::optim::OptimizerParamState* find_state(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  auto& map = optimizer.state();
  auto it = map.find(state_key(param));
  return it == map.end() ? nullptr : it->second.get();
}

std::vector<at::Tensor> libtorch_state_tensors(const torch::optim::OptimizerParamState& state, bool& known) {
  std::vector<at::Tensor> out;
  auto put = [&](const at::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
  known = true;
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    put(a->exp_avg());
    put(a->exp_avg_sq());
    put(a->max_exp_avg_sq());
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    put(w->exp_avg());
    put(w->exp_avg_sq());
    put(w->max_exp_avg_sq());
  } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    put(g->momentum_buffer());
  } else if (auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    put(r->square_avg());
    put(r->momentum_buffer());
    put(r->grad_avg());
  } else if (auto* ad = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    put(ad->sum());
  } else {
    known = false;
  }
  return out;
}

}  // namespace tessera
