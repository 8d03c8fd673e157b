#include "tessera/optim/param_state.h"

#include "tessera/optim/lamb.h"
#include "tessera/optim/lars.h"

#include "indexed_state.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace tessera {
namespace optim {
namespace {

void put(ParamState& out, const char* name, const at::Tensor& t) {
  if (t.defined()) out.tensors[name] = t;
}

// A copy of state.tensors[name] shaped and typed like param (undefined when absent).
at::Tensor take(const ParamState& state, const char* name, const at::Tensor& param) {
  auto it = state.tensors.find(name);
  if (it == state.tensors.end()) return {};
  TORCH_CHECK(it->second.numel() == param.numel(), "optimizer state '", name, "' has ", it->second.numel(),
              " elements for a parameter of ", param.numel());
  return it->second.detach().to(param.options()).reshape(param.sizes()).clone();
}

template <typename State>
State& fresh(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  return detail::state_of<State>(optimizer, param, [](State&) {});
}

}  // namespace

ParamState get_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  ParamState out;
  auto* s = tessera::find_state(optimizer, param);
  if (s == nullptr) return out;
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(s)) {
    out.step = a->step();
    put(out, "exp_avg", a->exp_avg());
    put(out, "exp_avg_sq", a->exp_avg_sq());
    put(out, "max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s)) {
    out.step = a->step();
    put(out, "exp_avg", a->exp_avg());
    put(out, "exp_avg_sq", a->exp_avg_sq());
    put(out, "max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(s)) {
    put(out, "momentum_buffer", g->momentum_buffer());
  } else if (auto* l = dynamic_cast<LambParamState*>(s)) {
    out.step = l->step();
    put(out, "exp_avg", l->exp_avg());
    put(out, "exp_avg_sq", l->exp_avg_sq());
  } else if (auto* l = dynamic_cast<LarsParamState*>(s)) {
    out.step = l->step();
    put(out, "momentum_buffer", l->momentum_buffer());
  } else {
    TORCH_CHECK(false, "get_param_state: unknown optimizer state type; checkpoints know Adam, AdamW, SGD, LAMB, LARS");
  }
  return out;
}

void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param, const ParamState& state) {
  if (state.tensors.empty() && state.step == 0) return;  // never stepped: no state, as before its first step
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    auto& a = fresh<torch::optim::AdamWParamState>(optimizer, param);
    a.step(state.step);
    a.exp_avg(take(state, "exp_avg", param));
    a.exp_avg_sq(take(state, "exp_avg_sq", param));
    a.max_exp_avg_sq(take(state, "max_exp_avg_sq", param));
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    auto& a = fresh<torch::optim::AdamParamState>(optimizer, param);
    a.step(state.step);
    a.exp_avg(take(state, "exp_avg", param));
    a.exp_avg_sq(take(state, "exp_avg_sq", param));
    a.max_exp_avg_sq(take(state, "max_exp_avg_sq", param));
  } else if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    fresh<torch::optim::SGDParamState>(optimizer, param).momentum_buffer(take(state, "momentum_buffer", param));
  } else if (dynamic_cast<Lamb*>(&optimizer)) {
    auto& l = fresh<LambParamState>(optimizer, param);
    l.step(state.step);
    l.exp_avg(take(state, "exp_avg", param));
    l.exp_avg_sq(take(state, "exp_avg_sq", param));
  } else if (dynamic_cast<Lars*>(&optimizer)) {
    auto& l = fresh<LarsParamState>(optimizer, param);
    l.step(state.step);
    l.momentum_buffer(take(state, "momentum_buffer", param));
  } else {
    TORCH_CHECK(false, "set_param_state: unknown optimizer type; checkpoints know Adam, AdamW, SGD, LAMB, LARS");
  }
}

}  // namespace optim
}  // namespace tessera
