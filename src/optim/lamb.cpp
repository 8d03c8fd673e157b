#include "tessera/optim/lamb.h"

#include "indexed_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace tessera {
namespace optim {

void LambOptions::validate() const {
  TORCH_CHECK(lr() >= 0 && std::isfinite(lr()), "LAMB: the learning rate must be >= 0, got ", lr());
  TORCH_CHECK(std::get<0>(betas()) >= 0 && std::get<0>(betas()) < 1, "LAMB: beta1 must be in [0, 1), got ",
              std::get<0>(betas()));
  TORCH_CHECK(std::get<1>(betas()) >= 0 && std::get<1>(betas()) < 1, "LAMB: beta2 must be in [0, 1), got ",
              std::get<1>(betas()));
  TORCH_CHECK(eps() > 0, "LAMB: eps must be > 0, got ", eps());
  TORCH_CHECK(weight_decay() >= 0, "LAMB: weight_decay must be >= 0, got ", weight_decay());
  TORCH_CHECK(max_trust_ratio() >= 0, "LAMB: max_trust_ratio must be >= 0 (0: unbounded), got ", max_trust_ratio());
}

Lamb::Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults)
    : Optimizer(param_groups, std::make_unique<LambOptions>(defaults)) {
  detail::restore_group_options(*this, param_groups);
  defaults.validate();
  for (const auto& g : this->param_groups()) static_cast<const LambOptions&>(g.options()).validate();
}

Lamb::Lamb(std::vector<at::Tensor> params, LambOptions defaults)
    : Lamb({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor Lamb::step(LossClosure closure) {
  at::Tensor loss = detail::run_closure(closure);
  at::NoGradGuard no_grad;
  // Pass 1: the Adam direction with decay, u, for every parameter.
  std::vector<at::Tensor> params, updates, norms;
  std::vector<const LambOptions*> options;
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const LambOptions&>(group.options());
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor g = p.grad();
      auto& s = detail::state_of<LambParamState>(*this, p, [&](LambParamState& st) {
        st.exp_avg(at::zeros_like(p));
        st.exp_avg_sq(at::zeros_like(p));
      });
      s.step(s.step() + 1);
      s.exp_avg().mul_(b1).add_(g, 1 - b1);
      s.exp_avg_sq().mul_(b2).addcmul_(g, g, 1 - b2);
      const double c1 = o.bias_correction() ? 1 - std::pow(b1, static_cast<double>(s.step())) : 1.0;
      const double c2 = o.bias_correction() ? 1 - std::pow(b2, static_cast<double>(s.step())) : 1.0;
      at::Tensor u = (s.exp_avg() / c1) / ((s.exp_avg_sq() / c2).sqrt() + o.eps());
      if (o.weight_decay() != 0) u.add_(p, o.weight_decay());
      params.push_back(p);
      updates.push_back(u);
      options.push_back(&o);
      norms.push_back(p.norm());
      norms.push_back(u.norm());
    }
  }
  // Pass 2: whole-parameter norms in one exchange, then the trust ratios.
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Tensor squares = detail::pair_squares(params, norms, norms_.get()).cpu();  // read by accessor
  auto sq = squares.accessor<double, 2>();
  trust_.assign(params.size(), 1.0);
  for (int64_t i = 0; i < n; ++i) {
    const LambOptions& o = *options[i];
    const double w = std::sqrt(sq[i][0]), u = std::sqrt(sq[i][1]);
    double r = o.adaptation() && w > 0 && u > 0 ? w / u : 1.0;
    if (o.adaptation() && o.max_trust_ratio() > 0) r = std::min(r, o.max_trust_ratio());
    trust_[i] = r;
    params[i].add_(updates[i], -o.lr() * r);
  }
  return loss;
}

std::vector<at::Tensor> Lamb::state_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& entry : state()) {
    const auto& s = static_cast<const LambParamState&>(*entry.second);
    out.push_back(s.exp_avg());
    out.push_back(s.exp_avg_sq());
  }
  return out;
}

void Lamb::save(torch::serialize::OutputArchive& archive) const {
  detail::for_each_param(*this, [&](int64_t i, const at::Tensor& p) {
    auto it = state().find(detail::state_key(p));
    if (it == state().end()) return;
    const auto& s = static_cast<const LambParamState&>(*it->second);
    archive.write(detail::key("lamb", i, "step"), at::tensor({s.step()}, at::kLong));
    archive.write(detail::key("lamb", i, "exp_avg"), s.exp_avg());
    archive.write(detail::key("lamb", i, "exp_avg_sq"), s.exp_avg_sq());
  });
}

void Lamb::load(torch::serialize::InputArchive& archive) {
  detail::for_each_param(*this, [&](int64_t i, const at::Tensor& p) {
    at::Tensor step;
    if (!archive.try_read(detail::key("lamb", i, "step"), step)) return;
    auto& s = detail::state_of<LambParamState>(*this, p, [](LambParamState&) {});
    at::Tensor m, v;
    archive.read(detail::key("lamb", i, "exp_avg"), m);
    archive.read(detail::key("lamb", i, "exp_avg_sq"), v);
    TORCH_CHECK(m.sizes() == p.sizes(), "LAMB::load: parameter ", i, " has shape ", p.sizes(),
                " but the saved state has ", m.sizes());
    s.step(step.item<int64_t>());
    s.exp_avg(m.to(p.device()));
    s.exp_avg_sq(v.to(p.device()));
  });
}

}  // namespace optim
}  // namespace tessera
