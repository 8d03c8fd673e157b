// A tensor-parallel GPT sharded over its data group (shards of tensor
// shards) against the serial reference GPT (tests/reference_gpt.h: plain
// LibTorch, nothing from tessera) with the same initial weights, on the same
// global batch: the loss of each of three optimizer steps and the full
// weights after them.
//
// SGD with momentum, not AdamW: the key part of c_attn.bias has a gradient
// that is exactly zero in exact arithmetic (softmax ignores a constant added
// to every key's score), so its computed gradient is rounding noise of about
// 1e-9 that Adam normalizes into full-size steps, different for any other
// order of summation. The MLP and conv tests cover AdamW.
#include "test_util.h"

#include "reference_gpt.h"

#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

constexpr double kRelTolerance = 1e-5;
constexpr int64_t kSeq = 16;

models::GPTConfig tiny() { return models::GPTConfig::preset("tiny"); }

at::Tensor seeded_ids(uint64_t seed, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(tiny().vocab(), {rows, kSeq}, gen, at::kLong);
}

torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(0.5).momentum(0.9).weight_decay(0.01); }

// (spec, sequence-parallel variant): in the variant, LayerNorm, position
// embedding and row-bias gradients are partial over the tensor group and the
// wrapper sums them (ShardedModuleOptions::placements).
class DataTensorParallel : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(DataTensorParallel, ThreeStepsOfGPTEqualSerial) {
  auto world = test::world();
  if (world->size() % 2 != 0) GTEST_SKIP() << "needs tensor size 2";
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().tensor(2));
  const int dp = ctx->size(context::ParallelMode::kData);
  const std::string spec_text = std::get<0>(GetParam());
  const bool sp = std::get<1>(GetParam());
  const auto spec = parallel::ShardingSpec::parse(spec_text);
  if (spec_text.find('2') != std::string::npos && dp % 2 != 0) GTEST_SKIP() << "P(2) needs an even data size";
  const int64_t global_batch = 8;

  // Initial weights: tessera's GPT-2 initialisation (the source of weights only).
  torch::manual_seed(0);
  std::map<std::string, at::Tensor> initial;
  {
    models::GPT source(tiny(), nn::make_1d_factory(world->split(world->rank(), 0, "self"), false, 1, 2));
    for (const auto& entry : source->full_state()) initial[entry.first] = entry.second.clone();
  }
  test::ReferenceGPT serial(test::reference_config(tiny()));
  serial->load_full_state(initial);
  torch::optim::SGD serial_opt(serial->parameters(), sgd());
  std::vector<double> serial_losses;
  for (int step = 0; step < 3; ++step) {
    serial_opt.zero_grad();
    at::Tensor ids = seeded_ids(10 + step, global_batch), targets = seeded_ids(20 + step, global_batch);
    at::Tensor loss = serial->loss(serial->forward(ids), targets);
    loss.backward();
    serial_opt.step();
    serial_losses.push_back(loss.item<double>());
  }

  models::GPT gpt(tiny(), nn::make_1d_factory(ctx->comm(context::ParallelMode::kTensor), sp, 1, 2));
  gpt->load_full_state(initial);
  auto sharded = std::make_shared<parallel::ShardedModule>(
      gpt.ptr(), ctx, parallel::ShardedModuleOptions().spec(spec).placements(gpt->placements()));
  parallel::ShardedOptimizer opt(sharded, std::make_shared<torch::optim::SGD>(gpt->parameters(), sgd()));
  const int64_t rows = global_batch / dp;
  const int64_t first = ctx->rank(context::ParallelMode::kData) * rows;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    at::Tensor ids = seeded_ids(10 + step, global_batch).narrow(0, first, rows);
    at::Tensor targets = seeded_ids(20 + step, global_batch).narrow(0, first, rows);
    at::Tensor loss = sharded->run([&] { return gpt->loss(gpt->forward(ids), targets); });
    loss.backward();
    opt.step();
    at::Tensor mean = loss.detach().clone();
    ctx->comm(context::ParallelMode::kData)->all_reduce(mean);
    EXPECT_NEAR(mean.item<double>() / dp, serial_losses[step], kRelTolerance * serial_losses[step]) << "step " << step;
  }
  auto full_params = sharded->full_params();
  const auto expected = serial->full_state();
  for (const auto& entry : gpt->full_state()) {
    EXPECT_LE(test::rel_error(entry.second, expected.at(entry.first)), kRelTolerance) << entry.first;
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, DataTensorParallel,
                         ::testing::Combine(::testing::Values("ddp", "zero1", "zero2", "zero3", "{P(2),S,S}",
                                                              "{R,P(2),S}"),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, bool>>& info) {
                           std::string name = std::get<0>(info.param) + (std::get<1>(info.param) ? "_sp" : "_1d");
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

}  // namespace
}  // namespace tessera
