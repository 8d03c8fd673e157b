// ParallelContext over MPI: the communicators it builds contain exactly the
// ranks RankGrid's formulas say, in group order, for every mode of the
// configurations the design names; invalid configs throw on every rank.
#include "test_util.h"

#include "tessera/comm/factory.h"
#include "tessera/context/parallel_context.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

using context::ParallelConfig;
using context::ParallelContext;
using context::ParallelMode;
using context::TensorMode;

struct NamedConfig {
  std::string name;
  int world;
  ParallelConfig config;
};

std::vector<NamedConfig> configs() {
  return {
      {"dp2_pp2_tp2", 8, ParallelConfig().data(2).pipeline(2).tensor(2)},
      {"tp4_2d", 4, ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D)},
      {"tp8_2p5d_depth2", 8, ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2)},
      {"tp8_3d", 8, ParallelConfig().tensor(8).tensor_mode(TensorMode::k3D)},
      {"tp2_sp2_dp2", 8, ParallelConfig().tensor(2).sequence(2).data(2)},
      {"ep2_dp4", 4, ParallelConfig().data(4).expert(2)},
      {"dp_derived", 0, ParallelConfig()},  // any world size: everything data parallel
      {"pp_dp_reordered", 4, ParallelConfig().pipeline(2).order("pp-tp-sp-dp")},
      {"dp3", 3, ParallelConfig().data(3)},
  };
}

// The global ranks of this rank's group, as the communicator itself sees them.
std::vector<int> members_via_comm(const comm::CommunicatorPtr& c, int global_rank) {
  at::Tensor mine = at::full({1}, global_rank, at::kInt);
  at::Tensor all = at::empty({c->size()}, at::kInt);
  c->all_gather(all, mine);
  return std::vector<int>(all.data_ptr<int>(), all.data_ptr<int>() + c->size());
}

TEST(ParallelContext, GroupsMatchTheGridFormulas) {
  auto world = test::world();
  int checked = 0;
  for (const auto& nc : configs()) {
    if (nc.world != 0 && nc.world != world->size()) continue;
    SCOPED_TRACE(nc.name);
    auto ctx = ParallelContext::create(world, nc.config);
    const int me = world->rank();
    EXPECT_EQ(ctx->global_rank(), me);
    for (auto mode : context::all_modes()) {
      SCOPED_TRACE(context::mode_name(mode));
      if (!ctx->has(mode)) {
        EXPECT_THROW(ctx->comm(mode), c10::Error);
        continue;
      }
      auto c = ctx->comm(mode);
      ASSERT_TRUE(c != nullptr);
      EXPECT_EQ(c->size(), ctx->grid().group_size(mode));
      EXPECT_EQ(c->rank(), ctx->grid().local_rank(mode, me));
      EXPECT_EQ(members_via_comm(c, me), ctx->grid().group_of(mode, me));
    }
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(ParallelContext, SeedsDifferAlongTheModeAndAgreeAcrossIt) {
  auto world = test::world();
  if (world->size() != 8) GTEST_SKIP() << "uses dp2 x pp2 x tp2";
  auto ctx = ParallelContext::create(world, ParallelConfig().data(2).pipeline(2).tensor(2));
  auto gather_seed = [](const comm::CommunicatorPtr& c, uint64_t seed) {
    at::Tensor mine = at::full({1}, static_cast<int64_t>(seed), at::kLong);
    at::Tensor all = at::empty({c->size()}, at::kLong);
    c->all_gather(all, mine);
    return all;
  };
  // Tensor seed: different between tensor ranks, equal between data ranks.
  at::Tensor along = gather_seed(ctx->comm(ParallelMode::kTensor), ctx->seed(ParallelMode::kTensor));
  EXPECT_NE(along[0].item<int64_t>(), along[1].item<int64_t>());
  at::Tensor across = gather_seed(ctx->comm(ParallelMode::kData), ctx->seed(ParallelMode::kTensor));
  EXPECT_EQ(across[0].item<int64_t>(), across[1].item<int64_t>());
  // The global seed is the same everywhere.
  at::Tensor global = gather_seed(world, ctx->seed(ParallelMode::kGlobal));
  EXPECT_TRUE(at::equal(global, at::full_like(global, global[0].item<int64_t>())));
}

TEST(ParallelContext, InvalidConfigThrowsOnEveryRankWithoutCommunicating) {
  auto trace = std::make_shared<comm::CommTrace>();
  auto world = std::make_shared<comm::TracingCommunicator>(test::world(), trace);
  const int n = world->size();
  EXPECT_TRUE(test::throws_with([&] { ParallelContext::create(world, ParallelConfig().data(n + 1)); },
                                "world size " + std::to_string(n)));
  EXPECT_EQ(trace->total().calls, 0) << trace->to_string();
}

TEST(ParallelContext, DifferentConfigsOnDifferentRanksThrow) {
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs two ranks";
  if (world->size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  // Valid on every rank, but not the same: ranks must refuse, not pair up wrongly.
  ParallelConfig config = world->rank() == 0 ? ParallelConfig().tensor(2) : ParallelConfig();
  EXPECT_THROW(ParallelContext::create(world, config), c10::Error);
}

TEST(ParallelContext, DescribeNamesEveryMode) {
  auto world = test::world();
  auto ctx = ParallelContext::create(world, ParallelConfig());
  const std::string text = ctx->describe();
  for (auto mode : ctx->grid().modes()) EXPECT_NE(text.find(context::mode_name(mode)), std::string::npos) << text;
}

}  // namespace
}  // namespace tessera
