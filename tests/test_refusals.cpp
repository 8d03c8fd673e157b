// Nothing silently ignored: dimensions, modes and options that the layers or
// the trainer do not carry out yet are refused at construction, on every
// rank, with the value, the rule and what to do.
#include "test_util.h"

#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

context::ParallelContextPtr context_of(const context::ParallelConfig& config) {
  return context::ParallelContext::create(test::world(), config);
}

// A one-layer model for the trainer.
train::TrainModel tiny_model() {
  train::TrainModel m;
  m.layers = torch::nn::Sequential(torch::nn::Linear(4, 2));
  m.loss = [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); };
  return m;
}

std::shared_ptr<torch::optim::Optimizer> adamw(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> params;
  for (const auto& p : named) params.push_back(p.second);
  return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
}

// Sequence parallelism runs on plain 1D layers only.
TEST(Refusals, SequenceSizeOutsidePlain1DIsRefused) {
  if (test::world()->size() % 2 != 0) GTEST_SKIP() << "sequence size 2 needs an even world";
  auto ctx = context_of(context::ParallelConfig().sequence(2));
  EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, /*sequence_parallel=*/true), "sequence size 2",
                        "both split the sequence");
  if (test::world()->size() % 8 != 0) return;
  auto grid = context_of(context::ParallelConfig().sequence(2).tensor(4).tensor_mode(context::TensorMode::k2D));
  EXPECT_ERROR_CONTAINS(nn::make_layer_factory(grid), "sequence size 2", "runs on tensor mode 1d", "tensor mode 2d");
}

// An expert group needs layers that carry experts: a dense model, the 1D
// sequence-parallel variant and the grid modes refuse it.
TEST(Refusals, ExpertSizeWithoutExpertsIsRefused) {
  if (test::world()->size() % 2 != 0) GTEST_SKIP() << "expert size 2 needs an even data size";
  auto ctx = context_of(context::ParallelConfig().expert(2));
  EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, /*sequence_parallel=*/true), "expert size 2",
                        "sequence-parallel variant");
  EXPECT_ERROR_CONTAINS((train::Trainer(ctx, tiny_model(), adamw)), "expert size 2",
                        "no mixture-of-experts layer", "set expert size 1");
  if (test::world()->size() % 8 != 0) return;
  auto grid = context_of(context::ParallelConfig().expert(2).tensor(4).tensor_mode(context::TensorMode::k2D));
  EXPECT_ERROR_CONTAINS(nn::make_layer_factory(grid), "expert size 2 runs on tensor mode 1d", "tensor mode 2d");
}

TEST(Refusals, SequenceParallelVariantIsRefusedIn2D) {
  if (test::world()->size() % 4 != 0) GTEST_SKIP() << "tensor mode 2d needs tensor size 4 here";
  auto ctx = context_of(context::ParallelConfig().tensor(4).tensor_mode(context::TensorMode::k2D));
  EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, /*sequence_parallel=*/true), "belongs to tensor mode 1d",
                        "tensor mode 2d");
}

TEST(Refusals, PipelineOptionsTheTrainerCannotCarryOut) {
  if (test::world()->size() % 2 != 0) GTEST_SKIP() << "pipeline size 2 needs an even world";
  auto ctx = context_of(context::ParallelConfig().pipeline(2));
  train::TrainModel m = tiny_model();
  m.layers = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  EXPECT_ERROR_CONTAINS((train::Trainer(ctx, m, adamw, train::TrainerOptions().accumulation(2))),
                        "accumulate through pipeline micro-batches", "got 2");
}

TEST(Refusals, AnOptimizerCheckpointsCannotSaveIsRefused) {
  auto ctx = context_of(context::ParallelConfig());
  auto rmsprop = [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    std::vector<at::Tensor> params;
    for (const auto& p : named) params.push_back(p.second);
    return std::make_shared<torch::optim::RMSprop>(params, torch::optim::RMSpropOptions(1e-3));
  };
  EXPECT_ERROR_CONTAINS((train::Trainer(ctx, tiny_model(), rmsprop)), "none of AdamW, Adam, SGD, LAMB, LARS",
                        "use one of those");
}

// A plain 1D context gets the 1D factory, or its sequence-parallel variant.
TEST(Refusals, MakeLayerFactoryPicks1D) {
  auto ctx = context_of(context::ParallelConfig().tensor(test::world()->size() % 2 == 0 ? 2 : 1));
  auto f = nn::make_layer_factory(ctx);
  EXPECT_EQ(f->mode(), "1d");
  EXPECT_EQ(nn::make_layer_factory(ctx, true)->mode(), "1d-sp");
}

}  // namespace
}  // namespace tessera
