// ParallelDropout draws the same mask on every tensor rank when seeded for a
// replicated activation and different masks when seeded for a sharded one
// (Note [Dropout seeds]).
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/context/parallel_context.h"
#include "tessera/nn/parallel_dropout.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

using context::ParallelMode;

// Every rank's mask of ones(shape), gathered: [size, numel].
at::Tensor gathered_masks(nn::ParallelDropout& dropout, const comm::CommunicatorPtr& group) {
  at::Tensor mask =
      dropout->forward(at::ones({64, 32}, test::device_options())).ne(0).to(at::kFloat).reshape(-1).contiguous();
  at::Tensor all = at::empty({group->size() * mask.numel()}, test::device_options());
  group->all_gather(all, mask);
  return all.reshape({group->size(), -1});
}

TEST(ParallelDropout, ReplicatedSeedGivesOneMaskShardedSeedsDiffer) {
  auto world = test::world();
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().tensor(world->size()));
  auto tp = ctx->comm(ParallelMode::kTensor);
  nn::ParallelDropout replicated(nn::ParallelDropoutOptions(0.3, ctx->seed(ParallelMode::kData)));
  replicated->to(test::device());
  at::Tensor same = gathered_masks(replicated, tp);
  for (int r = 1; r < tp->size(); ++r) EXPECT_TRUE(at::equal(same[r], same[0])) << "rank " << r;
  nn::ParallelDropout sharded(nn::ParallelDropoutOptions(0.3, ctx->seed(ParallelMode::kTensor)));
  sharded->to(test::device());
  at::Tensor different = gathered_masks(sharded, tp);
  for (int r = 1; r < tp->size(); ++r) EXPECT_FALSE(at::equal(different[r], different[0])) << "rank " << r;
  // About 30% dropped (2048 draws: 5 standard deviations is ~0.05).
  EXPECT_NEAR(1.0 - different[0].mean().item<double>(), 0.3, 0.05);
}

TEST(ParallelDropout, ScalesKeptValuesResetsAndEvalIsIdentity) {
  nn::ParallelDropout dropout(nn::ParallelDropoutOptions(0.25, 7));
  dropout->to(test::device());
  at::Tensor x = at::full({100}, 3.0, test::device_options());
  at::Tensor y = dropout->forward(x);
  at::Tensor kept = y.masked_select(y.ne(0));
  EXPECT_TRUE(at::allclose(kept, at::full_like(kept, 4.0)));  // 3 / (1 - 0.25)
  dropout->reset();
  EXPECT_TRUE(at::equal(dropout->forward(x), y));  // the stream restarts from the seed
  dropout->eval();
  EXPECT_TRUE(at::equal(dropout->forward(x), x));
  EXPECT_ERROR_CONTAINS(nn::ParallelDropout(nn::ParallelDropoutOptions(1.0, 0)), "p must be in [0, 1)");
}

TEST(ParallelDropout, GradientFollowsTheMask) {
  nn::ParallelDropout dropout(nn::ParallelDropoutOptions(0.5, 11));
  dropout->to(test::device());
  at::Tensor x = at::randn({50}, test::device_options()).requires_grad_(true);
  at::Tensor y = dropout->forward(x);
  y.sum().backward();
  // dy/dx is mask / (1 - p): 2 where kept, 0 where dropped (randn is never exactly 0).
  EXPECT_TRUE(at::equal(x.grad().ne(0), y.ne(0)));
  EXPECT_TRUE(at::equal(x.grad().eq(0) | x.grad().eq(2.0), at::ones_like(x.grad(), at::kBool)));
}

}  // namespace
}  // namespace tessera
