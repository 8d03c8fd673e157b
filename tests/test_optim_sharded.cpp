// LAMB, LARS and global gradient clipping on split parameters equal the
// single-process unsharded optimizer (Note [Whole-parameter norms]): ZeRO
// pieces at shard degree 2 and 4, tensor-parallel shards at tensor size 2
// and 4, and both at once; 5 steps within 1e-5 relative (fp32).
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/context/parallel_context.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/optim/lamb.h"
#include "tessera/optim/lars.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

using parallel::ShardedModule;
using parallel::ShardedModuleOptions;
using parallel::ShardedOptimizer;
using parallel::ShardedOptimizerOptions;
using parallel::ShardingSpec;

constexpr double kTolerance = 1e-5;
constexpr int64_t kBatch = 24;  // every data size tested (1, 2, 3, 4, 8) divides it
constexpr int kSteps = 5;

enum class Which { kLamb, kLars, kClippedSGD };
constexpr double kClip = 0.05;  // below the gradient norm of every step here

std::shared_ptr<torch::optim::Optimizer> make_optimizer(Which which, const std::vector<at::Tensor>& params) {
  switch (which) {
    case Which::kLamb:
      return std::make_shared<optim::Lamb>(params, optim::LambOptions(0.05).weight_decay(0.01));
    case Which::kLars:
      return std::make_shared<optim::Lars>(params, optim::LarsOptions(0.5).weight_decay(1e-3).trust_coefficient(0.02));
    default:
      return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.5).momentum(0.9));
  }
}

const char* name_of(Which w) { return w == Which::kLamb ? "lamb" : w == Which::kLars ? "lars" : "clipped sgd"; }

// An MLP made by a layer factory: column-parallel, row-parallel, then a
// replicated-output row layer, so weights and biases are split and
// replicated in every way the 1D factory knows.
struct TPMLPImpl : torch::nn::Module {
  TPMLPImpl(nn::LayerFactory& f) {
    fc1 = f.linear(12, 16, nn::LinearRole::kColumn, true);
    fc2 = f.linear(16, 8, nn::LinearRole::kRow, true);
    register_module("fc1", fc1.ptr());
    register_module("fc2", fc2.ptr());
  }
  at::Tensor forward(const at::Tensor& x) { return fc2.forward(at::tanh(fc1.forward(x))); }
  torch::nn::AnyModule fc1, fc2;
};
TORCH_MODULE(TPMLP);

// Full weights drawn once, loaded into the serial and the parallel model alike.
void load_weights(nn::LayerFactory& f, TPMLPImpl& m) {
  const std::map<std::string, at::Tensor> full = {{"fc1.weight", test::device_randn({16, 12}, 1) * 0.3},
                                                  {"fc1.bias", test::device_randn({16}, 2) * 0.1},
                                                  {"fc2.weight", test::device_randn({8, 16}, 3) * 0.3},
                                                  {"fc2.bias", test::device_randn({8}, 4) * 0.1}};
  for (const auto& [name, p] : f.placements(m)) nn::load_full(p, full.at(name));
}

at::Tensor inputs(int step) { return test::device_randn({kBatch, 12}, 100 + step); }
at::Tensor targets(int step) { return test::device_randn({kBatch, 8}, 200 + step); }

std::vector<at::Tensor> full_weights(nn::LayerFactory& f, TPMLPImpl& m) {
  std::vector<at::Tensor> out;  // fc1.weight, fc1.bias, fc2.weight, fc2.bias
  for (const auto& [name, p] : f.placements(m)) out.push_back(nn::full_value(p));
  return out;
}

struct Serial {
  std::vector<double> losses, norms;
  std::vector<at::Tensor> weights;
};

Serial serial_run(Which which) {
  auto w = test::world();
  auto f = nn::make_1d_factory(w->split(w->rank(), 0, "self"), false, 1, 2);
  TPMLP m(*f);
  m->to(test::device());
  load_weights(*f, *m);
  auto opt = make_optimizer(which, m->parameters());
  Serial s;
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    at::Tensor loss = torch::mse_loss(m->forward(inputs(step)), targets(step));
    loss.backward();
    if (which == Which::kClippedSGD) s.norms.push_back(torch::nn::utils::clip_grad_norm_(m->parameters(), kClip));
    opt->step();
    s.losses.push_back(loss.item<double>());
  }
  s.weights = full_weights(*f, *m);
  return s;
}

// tp x dp over the world, with the data-parallel wrapper under `spec`.
void expect_matches_serial(int tp, const std::string& spec, Which which) {
  SCOPED_TRACE("tp " + std::to_string(tp) + " spec " + spec + " " + name_of(which));
  const Serial serial = serial_run(which);
  auto world = test::world();
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().tensor(tp));
  auto tensor = ctx->comm(context::ParallelMode::kTensor);
  auto data = ctx->comm(context::ParallelMode::kData);
  auto f = nn::make_1d_factory(tensor, false, 1, 2);
  TPMLP m(*f);
  m->to(test::device());
  load_weights(*f, *m);
  auto sharded = std::make_shared<ShardedModule>(
      m.ptr(), ctx, ShardedModuleOptions().spec(ShardingSpec::parse(spec)).bucket_bytes(256));
  auto tp_norms = std::make_shared<parallel::PlacementNorms>(f->placements(*m));
  ShardedOptimizer opt(sharded, make_optimizer(which, m->parameters()),
                       ShardedOptimizerOptions().whole_norms(tp_norms));
  ASSERT_EQ(kBatch % data->size(), 0) << "the test's batch does not split over the data ranks";
  const int64_t rows = kBatch / data->size();
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor x = inputs(step).narrow(0, data->rank() * rows, rows);
    at::Tensor y = targets(step).narrow(0, data->rank() * rows, rows);
    at::Tensor loss = torch::mse_loss(sharded->run([&] { return m->forward(x); }), y);
    loss.backward();
    if (which == Which::kClippedSGD) {
      const double norm = opt.clip_grad_norm(kClip);
      EXPECT_NEAR(norm, serial.norms[step], 1e-5 * serial.norms[step]) << "gradient norm, step " << step;
      EXPECT_GT(norm, kClip) << "the test must clip";
    }
    opt.step();
    at::Tensor total = at::tensor({loss.item<double>()}, at::kDouble);
    data->all_reduce(total);
    EXPECT_NEAR(total.item<double>() / data->size(), serial.losses[step], kTolerance * serial.losses[step])
        << "step " << step;
  }
  auto gathered = sharded->full_params();
  const auto weights = full_weights(*f, *m);
  for (size_t i = 0; i < weights.size(); ++i)
    EXPECT_LE(test::rel_error(weights[i], serial.weights[i]), kTolerance) << "tensor " << i;
}

class SplitParameters : public ::testing::TestWithParam<Which> {};

// Shard degree = the data size: 2 and 4 (and P(2) inside 4).
TEST_P(SplitParameters, ZeroShardsEqualSerial) {
  const int dp = test::world()->size();
  if (dp > 4) GTEST_SKIP() << "ZeRO alone runs at 1, 2 and 4 ranks";
  for (const char* spec : {"ddp", "zero1", "zero2", "zero3"}) expect_matches_serial(1, spec, GetParam());
  if (dp == 4) expect_matches_serial(1, "{R,P(2),S}", GetParam());
}

TEST_P(SplitParameters, TensorShardsEqualSerial) {
  const int n = test::world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "tensor size 2 and 4";
  expect_matches_serial(n, "ddp", GetParam());
}

TEST_P(SplitParameters, TensorAndZeroShardsTogetherEqualSerial) {
  const int n = test::world()->size();
  if (n < 4) GTEST_SKIP() << "needs 4 or 8 ranks";
  for (int tp : {2, 4}) {
    if (tp >= n) continue;
    for (const char* spec : {"zero2", "zero3"}) expect_matches_serial(tp, spec, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, SplitParameters, ::testing::Values(Which::kLamb, Which::kLars, Which::kClippedSGD),
                         [](const ::testing::TestParamInfo<Which>& info) {
                           return std::string(info.param == Which::kLamb   ? "Lamb"
                                              : info.param == Which::kLars ? "Lars"
                                                                           : "ClippedSGD");
                         });

}  // namespace
}  // namespace tessera
