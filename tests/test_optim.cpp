// LAMB and LARS against an independent double-precision reference of the
// published update rules and hand-computed cases; bad hyper-parameters;
// exclusion by name; save and load by position. Sharded runs (ZeRO pieces,
// tensor-parallel shards, both) and global gradient clipping are in
// test_optim_sharded.cpp.
#include "test_util.h"

#include "tessera/optim/lamb.h"
#include "tessera/optim/lars.h"
#include "tessera/optim/param_groups.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <sstream>

namespace tessera {
namespace {

using optim::Lamb;
using optim::LambOptions;
using optim::Lars;
using optim::LarsOptions;

using Vec = std::vector<double>;

double norm(const Vec& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// You et al. 2019, Algorithm 2, written from the paper for one parameter.
struct LambReference {
  LambOptions o;
  Vec m, v;
  int t = 0;
  void step(Vec& w, const Vec& g) {
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    if (m.empty()) m.assign(w.size(), 0), v.assign(w.size(), 0);
    ++t;
    Vec u(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double mh = o.bias_correction() ? m[i] / (1 - std::pow(b1, t)) : m[i];
      const double vh = o.bias_correction() ? v[i] / (1 - std::pow(b2, t)) : v[i];
      u[i] = mh / (std::sqrt(vh) + o.eps()) + o.weight_decay() * w[i];
    }
    double r = 1.0;
    if (o.adaptation() && norm(w) > 0 && norm(u) > 0) r = norm(w) / norm(u);
    if (o.adaptation() && o.max_trust_ratio() > 0) r = std::min(r, o.max_trust_ratio());
    for (size_t i = 0; i < w.size(); ++i) w[i] -= o.lr() * r * u[i];
  }
};

// You, Gitman, Ginsburg 2017, Algorithm 1.
struct LarsReference {
  LarsOptions o;
  Vec buf;
  void step(Vec& w, const Vec& g) {
    if (buf.empty()) buf.assign(w.size(), 0);
    double local = 1.0;
    if (o.adaptation() && norm(w) > 0 && norm(g) > 0)
      local = o.trust_coefficient() * norm(w) / (norm(g) + o.weight_decay() * norm(w) + o.eps());
    for (size_t i = 0; i < w.size(); ++i) {
      buf[i] = o.momentum() * buf[i] + o.lr() * local * (g[i] + o.weight_decay() * w[i]);
      w[i] -= buf[i];
    }
  }
};

at::Tensor tensor(const Vec& v) { return at::tensor(v, at::kDouble).to(at::kFloat); }
Vec vec(const at::Tensor& t) {
  at::Tensor d = t.detach().to(at::kDouble).contiguous();
  return Vec(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// Gradients of three steps for three parameters, one of them all zeros.
const std::vector<Vec> kStart = {{1.0, -2.0, 3.0}, {0.5, 0.25}, {0.0, 0.0}};
Vec grad_of(size_t param, int step, size_t n) {
  Vec g(n);
  for (size_t i = 0; i < n; ++i) g[i] = std::sin(1.0 + param * 3 + step * 7 + i) * (param == 1 ? 1e-3 : 1.0);
  return g;
}

template <typename Opt, typename Ref, typename Options>
void expect_steps_match(const Options& o) {
  std::vector<at::Tensor> params;
  std::vector<Vec> ref_w = kStart;
  std::vector<Ref> refs(kStart.size(), Ref{o});
  for (const auto& w : kStart) params.push_back(tensor(w).requires_grad_(true));
  Opt opt(params, o);
  for (int step = 0; step < 3; ++step) {
    for (size_t p = 0; p < params.size(); ++p) {
      const Vec g = grad_of(p, step, kStart[p].size());
      params[p].mutable_grad() = tensor(g);
      refs[p].step(ref_w[p], g);
    }
    opt.step();
    for (size_t p = 0; p < params.size(); ++p) {
      const Vec got = vec(params[p]);
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_NEAR(got[i], ref_w[p][i], 1e-6 * (1 + std::abs(ref_w[p][i]))) << "param " << p << " step " << step;
    }
  }
}

TEST(Lamb, MatchesThePublishedRule) {
  expect_steps_match<Lamb, LambReference>(LambOptions(0.1));
  expect_steps_match<Lamb, LambReference>(LambOptions(0.1).bias_correction(false).weight_decay(0));
  expect_steps_match<Lamb, LambReference>(LambOptions(0.05).weight_decay(0.1).max_trust_ratio(0.5));
  expect_steps_match<Lamb, LambReference>(LambOptions(0.1).adaptation(false).eps(1e-3));
}

TEST(Lars, MatchesThePublishedRule) {
  expect_steps_match<Lars, LarsReference>(LarsOptions(0.1));
  expect_steps_match<Lars, LarsReference>(LarsOptions(1.0).momentum(0).weight_decay(0).trust_coefficient(0.02));
  expect_steps_match<Lars, LarsReference>(LarsOptions(0.1).adaptation(false));
}

// By hand: a scalar's LAMB step moves it by lr·|w| (r·u = |w|·sign(u));
// LARS with w = 2, g = 1: local_lr = 0.001·2/1 = 0.002, v = 0.1·0.002·1.
TEST(Lamb, HandComputedScalars) {
  at::Tensor w = at::full({1}, 2.0f).requires_grad_(true);
  Lamb lamb({w}, LambOptions(0.1).weight_decay(0));
  w.mutable_grad() = at::full({1}, 1.0f);
  lamb.step();
  EXPECT_NEAR(w.item<double>(), 1.8, 1e-6);
  EXPECT_NEAR(lamb.last_trust_ratios().at(0), 2.0, 1e-5);

  at::Tensor x = at::full({1}, 2.0f).requires_grad_(true);
  Lars lars({x}, LarsOptions(0.1).weight_decay(0));
  x.mutable_grad() = at::full({1}, 1.0f);
  lars.step();
  EXPECT_NEAR(x.item<double>(), 2.0 - 0.0002, 1e-7);
  EXPECT_NEAR(lars.last_local_lrs().at(0), 0.002, 1e-9);

  // A zero weight: trust ratio 1, so the step is the plain update.
  at::Tensor z = at::zeros({2}).requires_grad_(true);
  Lamb zero({z}, LambOptions(0.1).weight_decay(0));
  z.mutable_grad() = at::ones({2});
  zero.step();
  EXPECT_EQ(zero.last_trust_ratios().at(0), 1.0);
  EXPECT_NEAR(z[0].item<double>(), -0.1, 1e-6);
}

TEST(Lamb, BadHyperParametersNameTheValue) {
  auto p = std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())};
  EXPECT_ERROR_CONTAINS(Lamb(p, LambOptions(-1)), "LAMB: the learning rate must be >= 0, got -1");
  EXPECT_ERROR_CONTAINS(Lamb(p, LambOptions().betas({1.0, 0.999})), "beta1 must be in [0, 1), got 1");
  EXPECT_ERROR_CONTAINS(Lamb(p, LambOptions().betas({0.9, -0.5})), "beta2 must be in [0, 1), got -0.5");
  EXPECT_ERROR_CONTAINS(Lamb(p, LambOptions().eps(0)), "eps must be > 0, got 0");
  EXPECT_ERROR_CONTAINS(Lamb(p, LambOptions().weight_decay(-0.1)), "weight_decay must be >= 0, got -0.1");
  EXPECT_ERROR_CONTAINS(Lars(p, LarsOptions(-0.5)), "LARS: the learning rate must be >= 0, got -0.5");
  EXPECT_ERROR_CONTAINS(Lars(p, LarsOptions().momentum(1)), "momentum must be in [0, 1), got 1");
  EXPECT_ERROR_CONTAINS(Lars(p, LarsOptions().eps(-1e-9)), "eps must be > 0, got -1e-09");
  EXPECT_ERROR_CONTAINS(Lars(p, LarsOptions().trust_coefficient(0)), "trust_coefficient must be > 0, got 0");
}

TEST(ParamGroups, BiasesAndNormsSkipDecayAndAdaptation) {
  torch::nn::Linear fc(3, 2);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({2}));
  std::vector<std::pair<std::string, at::Tensor>> named = {
      {"fc.weight", fc->weight}, {"fc.bias", fc->bias}, {"ln_f.weight", ln->weight}, {"ln_f.bias", ln->bias}};
  auto groups = optim::param_groups(named, LambOptions(0.1).weight_decay(0.01));
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].params().size(), 1u);
  EXPECT_EQ(groups[1].params().size(), 3u);
  const auto& plain = static_cast<const LambOptions&>(groups[1].options());
  EXPECT_EQ(plain.weight_decay(), 0);
  EXPECT_FALSE(plain.adaptation());
  Lamb lamb(std::move(groups), LambOptions(0.1));
  for (auto& [name, p] : named) p.mutable_grad() = at::ones_like(p);
  lamb.step();
  const auto& r = lamb.last_trust_ratios();
  ASSERT_EQ(r.size(), 4u);
  EXPECT_NE(r[0], 1.0);  // the weight is adapted
  EXPECT_EQ(r[1], 1.0);
  EXPECT_EQ(r[2], 1.0);
  EXPECT_EQ(r[3], 1.0);
}

template <typename Opt, typename Options>
void expect_save_load_resumes(const Options& o) {
  auto make = [] {
    std::vector<at::Tensor> ps;
    for (const auto& w : kStart) ps.push_back(tensor(w).requires_grad_(true));
    return ps;
  };
  auto a = make();
  Opt first(a, o);
  for (int step = 0; step < 2; ++step) {
    for (size_t p = 0; p < a.size(); ++p) a[p].mutable_grad() = tensor(grad_of(p, step, kStart[p].size()));
    first.step();
  }
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    first.save(archive);
    archive.save_to(saved);
  }
  auto b = make();
  for (size_t p = 0; p < a.size(); ++p) b[p].detach().copy_(a[p].detach());
  Opt second(b, o);
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  second.load(archive);
  for (size_t p = 0; p < a.size(); ++p) {
    a[p].mutable_grad() = tensor(grad_of(p, 2, kStart[p].size()));
    b[p].mutable_grad() = tensor(grad_of(p, 2, kStart[p].size()));
  }
  first.step();
  second.step();
  for (size_t p = 0; p < a.size(); ++p) EXPECT_TRUE(at::equal(a[p], b[p])) << "param " << p;
}

TEST(Lamb, SaveAndLoadByPositionResumeExactly) {
  expect_save_load_resumes<Lamb>(LambOptions(0.1));
  expect_save_load_resumes<Lars>(LarsOptions(0.1));
}

}  // namespace
}  // namespace tessera
