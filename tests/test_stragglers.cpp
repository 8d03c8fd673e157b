// Note [Stragglers] in trainer.h: a rank made slower than the others is
// named on every rank, with its lag; the others' time goes to waiting.
#include "tessera/context/parallel_context.h"
#include "tessera/train/link_probe.h"
#include "tessera/train/trainer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <thread>

namespace tessera {
namespace {

constexpr double kDelay = 0.1;  // seconds the slow rank adds to each forward

// Linear, a layer that sleeps on world rank `slow`, Linear: data parallel over the world.
std::unique_ptr<train::Trainer> make_trainer(int slow, bool rank_times) {
  auto world = test::world();
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().data(world->size()));
  torch::manual_seed(3);
  const bool me_slow = world->rank() == slow;
  torch::nn::Sequential layers(torch::nn::Linear(16, 16), torch::nn::Functional([me_slow](const at::Tensor& x) {
                                 if (me_slow) std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
                                 return x;
                               }),
                               torch::nn::Linear(16, 4));
  train::TrainModel model;
  model.layers = layers;
  model.loss = [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); };
  model.owner = layers.ptr();
  auto sgd = [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    std::vector<at::Tensor> params;
    for (const auto& p : named) params.push_back(p.second);
    return std::shared_ptr<torch::optim::Optimizer>(std::make_shared<torch::optim::SGD>(params, 0.1));
  };
  return std::make_unique<train::Trainer>(ctx, model, sgd, train::TrainerOptions().rank_times(rank_times));
}

TEST(Stragglers, TheSlowRankIsNamedWithItsLagOnEveryRank) {
  auto world = test::world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const int slow = n - 1;
  auto trainer = make_trainer(slow, true);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const at::Tensor x = test::seeded_randn({2, 16}, 10 + step), y = test::seeded_randn({2, 4}, 20 + step);
    const train::StepStats st = trainer->train_step(x, y);
    ASSERT_EQ(st.rank_compute_seconds.size(), static_cast<size_t>(n));
    ASSERT_EQ(st.rank_wait_seconds.size(), static_cast<size_t>(n));
    EXPECT_EQ(st.slowest_rank, slow);
    // The others wait out the delay in the gradients' reduction; the slow rank computes it.
    EXPECT_GE(st.straggler_lag, 0.8 * kDelay);
    EXPECT_LT(st.straggler_lag, kDelay + 0.5);
    for (int r = 0; r < n; ++r) {
      if (r == slow) {
        EXPECT_GE(st.rank_compute_seconds[static_cast<size_t>(r)], kDelay) << "rank " << r;
        EXPECT_LT(st.rank_wait_seconds[static_cast<size_t>(r)], 0.5 * kDelay) << "rank " << r;
      } else {
        EXPECT_GE(st.rank_wait_seconds[static_cast<size_t>(r)], 0.8 * kDelay) << "rank " << r;
        EXPECT_LT(st.rank_compute_seconds[static_cast<size_t>(r)], 0.8 * kDelay) << "rank " << r;
      }
    }
    // This rank's own pair: what it measured, split in two.
    const size_t me = static_cast<size_t>(world->rank());
    EXPECT_DOUBLE_EQ(st.rank_wait_seconds[me], st.wait_seconds);
    EXPECT_NEAR(st.rank_compute_seconds[me] + st.rank_wait_seconds[me], st.seconds, 1e-12);
    // Every rank says the same.
    at::Tensor lag = at::tensor({st.straggler_lag, -st.straggler_lag}, at::kDouble);
    world->all_reduce(lag, {comm::ReduceOp::kMax});
    EXPECT_EQ(lag[0].item<double>(), -lag[1].item<double>()) << "the lag differs between ranks";
  }
}

TEST(Stragglers, OffUnlessAskedForButTheWaitIsMeasured) {
  auto world = test::world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  auto trainer = make_trainer(0, false);
  const train::StepStats st = trainer->train_step(test::seeded_randn({2, 16}, 1), test::seeded_randn({2, 4}, 2));
  EXPECT_TRUE(st.rank_compute_seconds.empty());
  EXPECT_EQ(st.slowest_rank, -1);
  EXPECT_EQ(st.straggler_lag, 0);
  if (world->rank() != 0) EXPECT_GE(st.wait_seconds, 0.8 * kDelay) << "rank 0 sleeps; this rank waits for it";
}

// Note [Slow links]: the rule on hand-written times. A host whose every
// exchange is slow is named with its slowdown; two hosts, or a slowdown
// within the factor, name none.
TEST(SlowLinks, TheHostWhoseEveryExchangeIsSlowIsNamed) {
  const double f = 0.008, s = 0.08;  // 1 MiB at 1 Gbit/s and at a tenth
  const auto three = train::name_slow_host({{0, f, s}, {f, 0, s}, {s, s, 0}}, 2.0);
  EXPECT_EQ(three.slow_host, 2);
  EXPECT_DOUBLE_EQ(three.slowdown, 10.0);
  EXPECT_EQ(three.host_seconds, (std::vector<double>{f, f, s}));
  const auto four = train::name_slow_host({{0, s, f, f}, {s, 0, s, s}, {f, s, 0, f}, {f, s, f, 0}}, 2.0);
  EXPECT_EQ(four.slow_host, 1);
  EXPECT_EQ(train::name_slow_host({{0, f, 1.5 * f}, {f, 0, 1.5 * f}, {1.5 * f, 1.5 * f, 0}}, 2.0).slow_host, -1)
      << "1.5x is within the factor";
  const auto two = train::name_slow_host({{0, s}, {s, 0}}, 2.0);
  EXPECT_EQ(two.slow_host, -1) << "two hosts share one path";
  EXPECT_EQ(two.host_seconds, (std::vector<double>{s, s}));
  EXPECT_TRUE(test::throws_with([] { train::name_slow_host({{0}}, 2.0); }, "needs two hosts or more, got 1"));
  EXPECT_TRUE(test::throws_with(
      [&] {
        train::name_slow_host({{0, f}, {-1, 0}}, 2.0);
      },
      "the exchange of hosts 1 and 0 took -1 s"));
}

// The collective on this machine with the ranks split into made-up hosts
// (every rank its own, then pairs): every host's time measured, alike on
// every rank; one host is refused with the reason.
TEST(SlowLinks, TheProbeTimesEveryHostAlikeOnEveryRank) {
  auto world = test::world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int per_host : {1, 2}) {
    if (n % per_host != 0 || n / per_host < 2) continue;
    context::HostMap hosts;
    for (int r = 0; r < n; ++r) hosts.host_of_rank.push_back(r / per_host);
    for (int h = 0; h < n / per_host; ++h) hosts.names.push_back("h" + std::to_string(h));
    const train::LinkProbe probe = train::probe_links(*world, hosts, 1 << 16);
    ASSERT_EQ(probe.host_seconds.size(), static_cast<size_t>(n / per_host));
    for (double t : probe.host_seconds) EXPECT_TRUE(std::isfinite(t) && t > 0) << t;
    at::Tensor mine = at::tensor(probe.host_seconds, at::kDouble);
    at::Tensor high = mine.clone(), low = -mine;
    world->all_reduce(high, {comm::ReduceOp::kMax});
    world->all_reduce(low, {comm::ReduceOp::kMax});
    EXPECT_TRUE(at::equal(high, -low)) << "ranks disagree on the hosts' times";
  }
  context::HostMap one;
  one.host_of_rank.assign(static_cast<size_t>(n), 0);
  one.names = {"h0"};
  EXPECT_TRUE(test::throws_with([&] { train::probe_links(*world, one); }, "the run is on one host"));
}

}  // namespace
}  // namespace tessera
