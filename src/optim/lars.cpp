#include "tessera/optim/lars.h"

#include "indexed_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace tessera {
namespace optim {

void LarsOptions::validate() const {
  TORCH_CHECK(lr() >= 0 && std::isfinite(lr()), "LARS: the learning rate must be >= 0, got ", lr());
  TORCH_CHECK(momentum() >= 0 && momentum() < 1, "LARS: momentum must be in [0, 1), got ", momentum());
  TORCH_CHECK(weight_decay() >= 0, "LARS: weight_decay must be >= 0, got ", weight_decay());
  TORCH_CHECK(trust_coefficient() > 0, "LARS: trust_coefficient must be > 0, got ", trust_coefficient());
  TORCH_CHECK(eps() > 0, "LARS: eps must be > 0, got ", eps());
}

Lars::Lars(std::vector<torch::optim::OptimizerParamGroup> param_groups, LarsOptions defaults)
    : Optimizer(param_groups, std::make_unique<LarsOptions>(defaults)) {
  detail::restore_group_options(*this, param_groups);
  defaults.validate();
  for (const auto& g : this->param_groups()) static_cast<const LarsOptions&>(g.options()).validate();
}

Lars::Lars(std::vector<at::Tensor> params, LarsOptions defaults)
    : Lars({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor Lars::step(LossClosure closure) {
  at::Tensor loss = detail::run_closure(closure);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> params, norms;
  std::vector<const LarsOptions*> options;
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const LarsOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      params.push_back(p);
      options.push_back(&o);
      norms.push_back(p.norm());
      norms.push_back(p.grad().norm());
    }
  }
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Tensor squares = detail::pair_squares(params, norms, norms_.get()).cpu();  // read by accessor
  auto sq = squares.accessor<double, 2>();
  local_lr_.assign(params.size(), 1.0);
  for (int64_t i = 0; i < n; ++i) {
    const LarsOptions& o = *options[i];
    at::Tensor& p = params[i];
    const double w = std::sqrt(sq[i][0]), g = std::sqrt(sq[i][1]);
    const double local =
        o.adaptation() && w > 0 && g > 0 ? o.trust_coefficient() * w / (g + o.weight_decay() * w + o.eps()) : 1.0;
    local_lr_[i] = local;
    at::Tensor d = p.grad().add(p, o.weight_decay());
    auto& s =
        detail::state_of<LarsParamState>(*this, p, [&](LarsParamState& st) { st.momentum_buffer(at::zeros_like(p)); });
    s.step(s.step() + 1);
    s.momentum_buffer().mul_(o.momentum()).add_(d, o.lr() * local);
    p.sub_(s.momentum_buffer());
  }
  return loss;
}

std::vector<at::Tensor> Lars::state_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& entry : state()) out.push_back(static_cast<const LarsParamState&>(*entry.second).momentum_buffer());
  return out;
}

void Lars::save(torch::serialize::OutputArchive& archive) const {
  detail::for_each_param(*this, [&](int64_t i, const at::Tensor& p) {
    auto it = state().find(detail::state_key(p));
    if (it == state().end()) return;
    const auto& s = static_cast<const LarsParamState&>(*it->second);
    archive.write(detail::key("lars", i, "step"), at::tensor({s.step()}, at::kLong));
    archive.write(detail::key("lars", i, "momentum_buffer"), s.momentum_buffer());
  });
}

void Lars::load(torch::serialize::InputArchive& archive) {
  detail::for_each_param(*this, [&](int64_t i, const at::Tensor& p) {
    at::Tensor step;
    if (!archive.try_read(detail::key("lars", i, "step"), step)) return;
    at::Tensor buf;
    archive.read(detail::key("lars", i, "momentum_buffer"), buf);
    TORCH_CHECK(buf.sizes() == p.sizes(), "LARS::load: parameter ", i, " has shape ", p.sizes(),
                " but the saved state has ", buf.sizes());
    auto& s = detail::state_of<LarsParamState>(*this, p, [](LarsParamState&) {});
    s.step(step.item<int64_t>());
    s.momentum_buffer(buf.to(p.device()));
  });
}

}  // namespace optim
}  // namespace tessera
