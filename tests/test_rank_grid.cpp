// RankGrid: group membership of every mode against hand-derived lists, the
// partition property over many configs, order strings, and seeds.
#include "tessera/context/rank_grid.h"

#include "test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <tuple>

namespace tessera {
namespace context {
namespace {

using Groups = std::vector<std::vector<int>>;
using M = ParallelMode;

Groups singletons(int world) {
  Groups groups;
  for (int r = 0; r < world; ++r) groups.push_back({r});
  return groups;
}

std::vector<int> iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Checks groups(mode) and, for every rank, group_of / local_rank / group_index.
void expect_groups(const RankGrid& grid, ParallelMode mode, const Groups& expected) {
  SCOPED_TRACE("mode " + mode_name(mode));
  ASSERT_TRUE(grid.has_mode(mode));
  EXPECT_EQ(grid.groups(mode), expected);
  for (size_t g = 0; g < expected.size(); ++g) {
    for (size_t i = 0; i < expected[g].size(); ++i) {
      const int r = expected[g][i];
      EXPECT_EQ(grid.group_of(mode, r), expected[g]) << "rank " << r;
      EXPECT_EQ(grid.local_rank(mode, r), static_cast<int>(i)) << "rank " << r;
      EXPECT_EQ(grid.group_index(mode, r), static_cast<int>(g)) << "rank " << r;
    }
    EXPECT_EQ(grid.group_size(mode), static_cast<int>(expected[g].size()));
  }
}

void expect_tensor_modes(const RankGrid& grid, TensorMode mode) {
  const std::map<TensorMode, std::vector<ParallelMode>> sub_modes = {
      {TensorMode::k1D, {M::k1D}},
      {TensorMode::k2D, {M::k2DRow, M::k2DCol}},
      {TensorMode::k2p5D, {M::k2p5DRow, M::k2p5DCol, M::k2p5DDep, M::k2p5DXZ}},
      {TensorMode::k3D, {M::k3DInput, M::k3DWeight, M::k3DOutput, M::k3DInputWeight, M::k3DOutputWeight}},
  };
  for (const auto& entry : sub_modes) {
    for (ParallelMode m : entry.second) {
      EXPECT_EQ(grid.has_mode(m), entry.first == mode) << mode_name(m);
    }
  }
  for (ParallelMode m : {M::kGlobal, M::kData, M::kPipeline, M::kTensor, M::kSequence, M::kDataSequence, M::kModel,
                         M::kExpert, M::kExpertData}) {
    EXPECT_TRUE(grid.has_mode(m)) << mode_name(m);
  }
}

TEST(ModeNames, AllModesHaveDistinctNames) {
  const std::vector<std::string> expected = {"global",
                                             "data",
                                             "pipeline",
                                             "tensor",
                                             "sequence",
                                             "data_sequence",
                                             "model",
                                             "1d",
                                             "2d_row",
                                             "2d_col",
                                             "2.5d_row",
                                             "2.5d_col",
                                             "2.5d_dep",
                                             "2.5d_xz",
                                             "3d_input",
                                             "3d_weight",
                                             "3d_output",
                                             "3d_input_weight",
                                             "3d_output_weight",
                                             "expert",
                                             "expert_data",
                                             "sequence_ulysses",
                                             "sequence_ring"};
  ASSERT_EQ(all_modes().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(mode_name(all_modes()[i]), expected[i]);
    EXPECT_EQ(static_cast<size_t>(all_modes()[i]), i);
  }
}

TEST(RankGrid, Dp2Pp2Tp2) {
  const RankGrid grid(ParallelConfig().data(2).pipeline(2).tensor(2), 8);
  expect_tensor_modes(grid, TensorMode::k1D);
  EXPECT_EQ(grid.stride(Dim::kTensor), 1);
  EXPECT_EQ(grid.stride(Dim::kSequence), 2);
  EXPECT_EQ(grid.stride(Dim::kData), 2);
  EXPECT_EQ(grid.stride(Dim::kPipeline), 4);
  EXPECT_EQ(grid.coordinate(Dim::kTensor, 5), 1);
  EXPECT_EQ(grid.coordinate(Dim::kData, 5), 0);
  EXPECT_EQ(grid.coordinate(Dim::kPipeline, 5), 1);

  expect_groups(grid, M::kGlobal, {iota(8)});
  expect_groups(grid, M::kData, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::kPipeline, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::kTensor, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::k1D, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::kSequence, singletons(8));
  expect_groups(grid, M::kDataSequence, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::kModel, {{0, 1, 4, 5}, {2, 3, 6, 7}});
  expect_groups(grid, M::kExpert, singletons(8));
  expect_groups(grid, M::kExpertData, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
}

TEST(RankGrid, Tp4In2D) {
  const RankGrid grid(ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D), 4);
  expect_tensor_modes(grid, TensorMode::k2D);
  EXPECT_EQ(grid.config().data(), 1);
  expect_groups(grid, M::kTensor, {{0, 1, 2, 3}});
  // t = i·q + j: row i fixed varies j; column j fixed varies i.
  expect_groups(grid, M::k2DRow, {{0, 1}, {2, 3}});
  expect_groups(grid, M::k2DCol, {{0, 2}, {1, 3}});
  expect_groups(grid, M::kModel, {{0, 1, 2, 3}});
  expect_groups(grid, M::kData, singletons(4));
  expect_groups(grid, M::kPipeline, singletons(4));
  expect_groups(grid, M::kSequence, singletons(4));
  expect_groups(grid, M::kDataSequence, singletons(4));
  // Local rank in the column group is the row index i, and vice versa.
  EXPECT_EQ(grid.local_rank(M::k2DCol, 2), 1);
  EXPECT_EQ(grid.local_rank(M::k2DRow, 2), 0);
}

TEST(RankGrid, Tp8In2p5DDepth2) {
  const RankGrid grid(ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2), 8);
  expect_tensor_modes(grid, TensorMode::k2p5D);
  // q = 2, t = k·4 + i·2 + j.
  expect_groups(grid, M::k2p5DRow, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::k2p5DCol, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::k2p5DDep, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::k2p5DXZ, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  expect_groups(grid, M::kTensor, {iota(8)});
}

TEST(RankGrid, Tp8In3D) {
  const RankGrid grid(ParallelConfig().tensor(8).tensor_mode(TensorMode::k3D), 8);
  expect_tensor_modes(grid, TensorMode::k3D);
  // q = 2, t = i + 2j + 4k.
  expect_groups(grid, M::k3DInput, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::k3DWeight, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::k3DOutput, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::k3DInputWeight, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  expect_groups(grid, M::k3DOutputWeight, {{0, 1, 4, 5}, {2, 3, 6, 7}});
}

TEST(RankGrid, Tp2Sp2Dp2) {
  const RankGrid grid(ParallelConfig().tensor(2).sequence(2).data(2), 8);
  // tp stride 1, sp stride 2, dp stride 4.
  expect_groups(grid, M::kTensor, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::kSequence, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::kData, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::kDataSequence, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  expect_groups(grid, M::kModel, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::kPipeline, singletons(8));
  EXPECT_EQ(grid.local_rank(M::kDataSequence, 6), 3);
}

// Hybrid sp 4 = Ulysses 2 x ring 2 beside tp 2: sequence rank s = 2r + u
// at global rank 2s + t; the Ulysses pairs are adjacent sequence ranks.
TEST(RankGrid, HybridSequenceSubGroups) {
  const RankGrid grid(ParallelConfig().tensor(2).sequence(4).sequence_mode(SequenceMode::kHybrid).sequence_ulysses(2),
                      8);
  expect_groups(grid, M::kSequence, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  expect_groups(grid, M::kSequenceUlysses, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::kSequenceRing, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::kDataSequence, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  EXPECT_EQ(grid.local_rank(M::kSequence, 6), 3);
  EXPECT_EQ(grid.local_rank(M::kSequenceRing, 6), 1);
  EXPECT_EQ(grid.local_rank(M::kSequenceUlysses, 6), 1);
  // Only hybrid has them.
  const RankGrid ring(ParallelConfig().sequence(4).sequence_mode(SequenceMode::kRing), 4);
  EXPECT_FALSE(ring.has_mode(M::kSequenceRing));
  EXPECT_ERROR_CONTAINS(ring.group_size(M::kSequenceUlysses), "sequence_ulysses is not available",
                        "only in sequence mode hybrid", "mode ring");
}

TEST(RankGrid, Ep2WithinDp4) {
  const RankGrid grid(ParallelConfig().expert(2), 4);
  EXPECT_EQ(grid.config().data(), 4);
  expect_groups(grid, M::kData, {{0, 1, 2, 3}});
  expect_groups(grid, M::kExpert, {{0, 1}, {2, 3}});
  expect_groups(grid, M::kExpertData, {{0, 2}, {1, 3}});
}

TEST(RankGrid, Ep2WithinDp4Tp2) {
  const RankGrid grid(ParallelConfig().data(4).tensor(2).expert(2), 8);
  // Data rank d = global / 2.
  expect_groups(grid, M::kData, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  expect_groups(grid, M::kExpert, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::kExpertData, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
}

TEST(RankGrid, DataInnermostOrder) {
  const RankGrid grid(ParallelConfig().data(2).pipeline(2).tensor(2).order("dp-tp-sp-pp"), 8);
  EXPECT_EQ(grid.stride(Dim::kData), 1);
  EXPECT_EQ(grid.stride(Dim::kTensor), 2);
  EXPECT_EQ(grid.stride(Dim::kPipeline), 4);
  expect_groups(grid, M::kGlobal, {iota(8)});
  expect_groups(grid, M::kData, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::kTensor, {{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  expect_groups(grid, M::kPipeline, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::kModel, {{0, 2, 4, 6}, {1, 3, 5, 7}});
}

TEST(RankGrid, PipelineInnermostOrderKeepsGroupOrder) {
  const RankGrid grid(ParallelConfig().data(2).pipeline(2).tensor(2).order("pp-dp-sp-tp"), 8);
  // pp stride 1, dp stride 2, tp stride 4: group order is tp inner, not sorted.
  expect_groups(grid, M::kTensor, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(grid, M::kPipeline, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(grid, M::kModel, {{0, 4, 1, 5}, {2, 6, 3, 7}});
  expect_groups(grid, M::kGlobal, {iota(8)});
  EXPECT_EQ(grid.global_rank_at({1, 0, 1, 1}), 7);  // indexed tp, sp, dp, pp
}

std::vector<std::pair<ParallelConfig, int>> property_configs() {
  return {
      {ParallelConfig(), 1},
      {ParallelConfig().data(2).pipeline(2).tensor(2), 8},
      {ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D).pipeline(2), 16},
      {ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2).data(2), 16},
      {ParallelConfig().tensor(18).tensor_mode(TensorMode::k2p5D).tensor_depth(2), 36},
      {ParallelConfig().tensor(8).tensor_mode(TensorMode::k3D).pipeline(3), 24},
      {ParallelConfig().tensor(27).tensor_mode(TensorMode::k3D), 27},
      {ParallelConfig().tensor(2).sequence(3).data(2).pipeline(2).order("sp-pp-tp-dp"), 24},
      {ParallelConfig().data(6).expert(3).tensor(2).sequence(2), 24},
      {ParallelConfig().tensor(9).tensor_mode(TensorMode::k2D).sequence(2).expert(2).order("dp-sp-pp-tp"), 36},
  };
}

TEST(RankGrid, EveryModePartitionsTheWorld) {
  for (const auto& entry : property_configs()) {
    const RankGrid grid(entry.first, entry.second);
    const ParallelConfig& c = grid.config();
    SCOPED_TRACE(to_string(c));
    for (ParallelMode mode : grid.modes()) {
      SCOPED_TRACE(mode_name(mode));
      const Groups groups = grid.groups(mode);
      std::vector<int> seen(entry.second, 0);
      for (size_t g = 0; g < groups.size(); ++g) {
        ASSERT_EQ(static_cast<int>(groups[g].size()), grid.group_size(mode));
        EXPECT_EQ(groups[g].front(), *std::min_element(groups[g].begin(), groups[g].end()));
        if (g > 0) {
          EXPECT_LT(groups[g - 1].front(), groups[g].front());
        }
        for (size_t i = 0; i < groups[g].size(); ++i) {
          const int r = groups[g][i];
          ++seen[r];
          EXPECT_EQ(grid.local_rank(mode, r), static_cast<int>(i));
          EXPECT_EQ(grid.group_index(mode, r), static_cast<int>(g));
          EXPECT_EQ(grid.group_of(mode, r), groups[g]);
        }
      }
      EXPECT_EQ(seen, std::vector<int>(entry.second, 1));
    }
    // Group sizes follow from the config.
    const int q2 = grid.has_mode(M::k2DRow) ? grid.group_size(M::k2DRow) : 0;
    EXPECT_EQ(grid.group_size(M::kGlobal), entry.second);
    EXPECT_EQ(grid.group_size(M::kData), c.data());
    EXPECT_EQ(grid.group_size(M::kPipeline), c.pipeline());
    EXPECT_EQ(grid.group_size(M::kTensor), c.tensor());
    EXPECT_EQ(grid.group_size(M::kSequence), c.sequence());
    EXPECT_EQ(grid.group_size(M::kDataSequence), c.data() * c.sequence());
    EXPECT_EQ(grid.group_size(M::kModel), c.tensor() * c.pipeline());
    EXPECT_EQ(grid.group_size(M::kExpert), c.expert());
    EXPECT_EQ(grid.group_size(M::kExpertData), c.data() / c.expert());
    if (q2 > 0) {
      EXPECT_EQ(q2 * grid.group_size(M::k2DCol), c.tensor());
    }
    if (grid.has_mode(M::k2p5DRow)) {
      EXPECT_EQ(grid.group_size(M::k2p5DDep), c.tensor_depth());
      EXPECT_EQ(grid.group_size(M::k2p5DXZ), grid.group_size(M::k2p5DCol) * grid.group_size(M::k2p5DDep));
      EXPECT_EQ(grid.group_size(M::k2p5DRow) * grid.group_size(M::k2p5DXZ), c.tensor());
    }
    if (grid.has_mode(M::k3DInput)) {
      const int q = grid.group_size(M::k3DInput);
      EXPECT_EQ(q * q * q, c.tensor());
      EXPECT_EQ(grid.group_size(M::k3DInputWeight), q * q);
      EXPECT_EQ(grid.group_size(M::k3DOutputWeight), q * q);
    }
    // Coordinates and ranks are inverse.
    for (int r = 0; r < entry.second; ++r) {
      std::array<int, kNumDims> coords{};
      for (int d = 0; d < kNumDims; ++d) coords[d] = grid.coordinate(static_cast<Dim>(d), r);
      EXPECT_EQ(grid.global_rank_at(coords), r);
    }
  }
}

// Combined modes are exactly the unions of the single ones.
TEST(RankGrid, CombinedModesAreUnions) {
  for (const auto& entry : property_configs()) {
    const RankGrid grid(entry.first, entry.second);
    SCOPED_TRACE(to_string(grid.config()));
    const std::vector<std::tuple<M, M, M>> unions = {{M::kDataSequence, M::kData, M::kSequence},
                                                     {M::kModel, M::kTensor, M::kPipeline},
                                                     {M::k2p5DXZ, M::k2p5DCol, M::k2p5DDep},
                                                     {M::k3DInputWeight, M::k3DInput, M::k3DWeight},
                                                     {M::k3DOutputWeight, M::k3DOutput, M::k3DWeight}};
    for (const auto& u : unions) {
      if (!grid.has_mode(std::get<0>(u))) continue;
      SCOPED_TRACE(mode_name(std::get<0>(u)));
      for (int r = 0; r < entry.second; ++r) {
        std::set<int> expected;
        for (int a : grid.group_of(std::get<1>(u), r)) {
          for (int b : grid.group_of(std::get<2>(u), a)) expected.insert(b);
        }
        const std::vector<int> group = grid.group_of(std::get<0>(u), r);
        EXPECT_EQ(std::set<int>(group.begin(), group.end()), expected);
      }
    }
  }
}

TEST(RankGrid, SeedsFollowShardingAndStages) {
  const uint64_t base = 1234;
  for (const auto& entry : property_configs()) {
    const RankGrid grid(entry.first, entry.second);
    SCOPED_TRACE(to_string(grid.config()));
    for (ParallelMode mode : grid.modes()) {
      SCOPED_TRACE(mode_name(mode));
      for (int a = 0; a < entry.second; ++a) {
        for (int b = 0; b < entry.second; ++b) {
          const uint64_t sa = grid.seed_for(mode, a, base);
          const uint64_t sb = grid.seed_for(mode, b, base);
          if (mode == M::kGlobal) {
            EXPECT_EQ(sa, base);
            continue;
          }
          const bool same = grid.local_rank(mode, a) == grid.local_rank(mode, b) &&
                            grid.coordinate(Dim::kPipeline, a) == grid.coordinate(Dim::kPipeline, b);
          EXPECT_EQ(sa == sb, same) << "ranks " << a << " and " << b;
        }
      }
    }
  }
}

TEST(RankGrid, SeedsDependOnBaseAndMode) {
  const RankGrid grid(ParallelConfig().data(2).pipeline(2).tensor(2), 8);
  // Tensor ranks 0 and 1 differ; 0 and 2 (other data rank) agree; 0 and 4
  // (other stage) differ.
  EXPECT_NE(grid.seed_for(M::kTensor, 0, 7), grid.seed_for(M::kTensor, 1, 7));
  EXPECT_EQ(grid.seed_for(M::kTensor, 0, 7), grid.seed_for(M::kTensor, 2, 7));
  EXPECT_NE(grid.seed_for(M::kTensor, 0, 7), grid.seed_for(M::kTensor, 4, 7));
  EXPECT_NE(grid.seed_for(M::kTensor, 0, 7), grid.seed_for(M::kTensor, 0, 8));
  EXPECT_NE(grid.seed_for(M::kTensor, 0, 7), grid.seed_for(M::kData, 0, 7));
  EXPECT_EQ(grid.seed_for(M::kGlobal, 5, 7), 7u);
}

TEST(RankGrid, MissingModesThrowNamingTheTensorMode) {
  const RankGrid grid(ParallelConfig().tensor(2), 2);
  EXPECT_FALSE(grid.has_mode(M::k2DRow));
  EXPECT_ERROR_CONTAINS(grid.group_of(M::k2DRow, 0), "2d_row", "tensor mode is 1d", "only in tensor mode 2d");
  EXPECT_ERROR_CONTAINS(grid.groups(M::k3DInput), "3d_input", "tensor mode 3d");
  EXPECT_ERROR_CONTAINS(grid.seed_for(M::k2p5DXZ, 0, 1), "2.5d_xz");
  EXPECT_ERROR_CONTAINS(grid.local_rank(M::kTensor, 2), "global rank 2", "[0, 2)");
}

TEST(RankGrid, ConstructorResolvesTheConfig) {
  EXPECT_ERROR_CONTAINS(RankGrid(ParallelConfig().tensor(3), 8), "world size 8", "not divisible");
  const RankGrid grid(ParallelConfig().tensor(2), 8);
  EXPECT_EQ(grid.config().data(), 4);
  EXPECT_EQ(grid.dim_size(Dim::kData), 4);
}

TEST(RankGrid, DescribeListsCoordinatesAndGroups) {
  const RankGrid grid(ParallelConfig().data(2).pipeline(2).tensor(2), 8);
  const std::string text = grid.describe(5);
  for (const char* part :
       {"rank 5 of 8", "tp=1 sp=0 dp=0 pp=1", "tensor", "[4, 5]", "model", "[0, 1, 4, 5]", "pipeline", "[1, 5]"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " not in\n" << text;
  }
  const RankGrid big(ParallelConfig(), 64);
  EXPECT_NE(big.describe(0).find("(64 ranks)"), std::string::npos) << big.describe(0);
}

}  // namespace
}  // namespace context
}  // namespace tessera
