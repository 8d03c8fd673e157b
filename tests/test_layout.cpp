// The context as the authority on layouts: the rank grid's arithmetic for
// every tensor mode, the combinations of modes the layers carry out, and
// the shapes a model needs in each layout, with their messages.
#include "tessera/context/layout.h"
#include "tessera/context/rank_grid.h"

#include "test_util.h"

#include <gtest/gtest.h>

namespace tessera {
namespace context {
namespace {

RankGrid grid_of(const ParallelConfig& c) { return RankGrid(c, c.data() * c.pipeline() * c.tensor() * c.sequence()); }

TEST(LayoutArithmetic, EveryTensorMode) {
  struct Case {
    ParallelConfig c;
    int q, batch_blocks, hidden_blocks, vocab_unit;
  };
  const Case cases[] = {
      {ParallelConfig().data(1), 1, 1, 1, 1},
      {ParallelConfig().data(1).tensor(4), 4, 1, 4, 4},
      {ParallelConfig().data(1).tensor(4).tensor_mode(TensorMode::k2D), 2, 2, 4, 2},
      {ParallelConfig().data(1).tensor(9).tensor_mode(TensorMode::k2D), 3, 3, 9, 3},
      {ParallelConfig().data(1).tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2), 2, 4, 4, 2},
      {ParallelConfig().data(1).tensor(8).tensor_mode(TensorMode::k3D), 2, 4, 8, 2},
      {ParallelConfig().data(1).tensor(27).tensor_mode(TensorMode::k3D), 3, 9, 27, 3},
  };
  for (const auto& k : cases) {
    const RankGrid g = grid_of(k.c);
    EXPECT_EQ(g.q(), k.q) << to_string(k.c);
    EXPECT_EQ(g.batch_blocks(), k.batch_blocks) << to_string(k.c);
    EXPECT_EQ(g.hidden_blocks(), k.hidden_blocks) << to_string(k.c);
    EXPECT_EQ(g.vocab_unit(), k.vocab_unit) << to_string(k.c);
    EXPECT_EQ(grid_side(k.c), k.q);
  }
  EXPECT_EQ(grid_of(ParallelConfig().data(2)).token_mode(), ParallelMode::kData);
  EXPECT_EQ(grid_of(ParallelConfig().data(2).sequence(2)).token_mode(), ParallelMode::kDataSequence);
}

TEST(LayoutRules, CombinationsTheLayersRefuse) {
  const ParallelConfig grid2d = ParallelConfig().data(1).tensor(4).tensor_mode(TensorMode::k2D);
  EXPECT_ERROR_CONTAINS(check_supported(Layout(ParallelConfig(grid2d).sequence(2))), "sequence size 2",
                        "runs on tensor mode 1d", "tensor mode 2d");
  EXPECT_ERROR_CONTAINS(check_supported(Layout(ParallelConfig(grid2d).data(2).expert(2))),
                        "expert size 2 runs on tensor mode 1d");
  EXPECT_ERROR_CONTAINS(check_supported(Layout(grid2d).sequence_parallel(true)), "belongs to tensor mode 1d");
  EXPECT_ERROR_CONTAINS(check_supported(Layout(ParallelConfig().sequence(2)).sequence_parallel(true)),
                        "both split the sequence");
  EXPECT_ERROR_CONTAINS(check_supported(Layout(ParallelConfig().data(2).expert(2)).sequence_parallel(true)),
                        "expert size 2", "sequence-parallel variant");
  EXPECT_ERROR_CONTAINS(check_supported(Layout(ParallelConfig().sequence(2)).row_keyed_dropout(true)),
                        "row-keyed dropout");
  check_supported(Layout(ParallelConfig().tensor(4)).sequence_parallel(true));
  check_supported(Layout(ParallelConfig().data(4).sequence(2).expert(2)));
  check_supported(Layout(ParallelConfig(grid2d)));
}

TEST(LayoutRules, ShapesEachLayoutNeeds) {
  const ModelShape gpt = ModelShape().hidden(32).heads(4).ffn(128).seq(16);
  const ParallelConfig t3d = ParallelConfig().data(1).tensor(8).tensor_mode(TensorMode::k3D);
  check_shape(Layout(t3d), ModelShape(gpt).rows(4));
  EXPECT_ERROR_CONTAINS(check_shape(Layout(t3d), ModelShape(gpt).hidden(34)), "the hidden size 34",
                        "tensor mode 3d", "(q²)");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(t3d), ModelShape(gpt).rows(2)), "batch size 2", "q*q = 4");
  const ParallelConfig t2d = ParallelConfig().data(1).tensor(4).tensor_mode(TensorMode::k2D);
  EXPECT_ERROR_CONTAINS(check_shape(Layout(t2d), ModelShape(gpt).heads(3)), "attention heads 3");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(t2d), ModelShape(gpt).rows(3)), "batch size 3", "q*depth = 2");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig().tensor(8)), gpt), "attention heads 4", "tensor size 8");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig().sequence(2).sequence_split(SequenceSplit::kZigzag)),
                                    ModelShape(gpt).seq(6)),
                        "sequence length 6", "zigzag");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig().tensor(2).sequence(4)), ModelShape(gpt).seq(16)),
                        "heads per tensor rank 2", "Ulysses");
  check_shape(Layout(ParallelConfig().tensor(2).sequence(4).sequence_mode(SequenceMode::kRing)), gpt);
  const ParallelConfig hybrid = ParallelConfig().tensor(2).sequence(8).sequence_mode(SequenceMode::kHybrid);
  check_shape(Layout(ParallelConfig(hybrid).sequence_ulysses(2)), gpt);
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig(hybrid).sequence_ulysses(4)), gpt), "heads per tensor rank 2",
                        "hybrid", "Ulysses groups");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig().data(2).expert(2)), gpt), "expert size 2",
                        "no mixture-of-experts blocks");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig().data(2).expert(2)), ModelShape(gpt).experts(3)),
                        "number of experts 3");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(t2d), ModelShape(gpt).experts(4)), "mixture-of-experts layers run on "
                        "tensor mode 1d");
  check_shape(Layout(ParallelConfig().data(4).expert(2).sequence(2)), ModelShape(gpt).experts(4));
  // Grouped-query attention: 1D splits kv heads or replicates them; the grids only split them.
  check_shape(Layout(ParallelConfig().tensor(4)), ModelShape(gpt).kv_heads(2));
  check_shape(Layout(ParallelConfig().tensor(4)), ModelShape(gpt).kv_heads(1));
  EXPECT_ERROR_CONTAINS(check_shape(Layout(ParallelConfig().tensor(4)), ModelShape(gpt).heads(12).kv_heads(6)),
                        "the 6 key/value heads can neither be split over the 4 head blocks",
                        "the tensor size must be a multiple of them");
  EXPECT_ERROR_CONTAINS(check_shape(Layout(t2d), ModelShape(gpt).kv_heads(1)),
                        "the 1 key/value heads can neither be split over the 2 head blocks of tensor mode 2d",
                        "only tensor mode 1d replicates kv heads");
}

}  // namespace
}  // namespace context
}  // namespace tessera
