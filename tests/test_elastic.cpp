// Elastic training (train/elastic.h). The piece exchange against the full
// tensor it cuts up, along each of its three paths (equal boxes, whole boxes,
// index lists), with replicas, scalars, several dtypes and holes. Row-keyed
// dropout gives a sample the same mask however the batch is split. A run
// that goes dp 1 -> 2 -> 4 -> 2 at steps 10, 20, 30 (fp32, AdamW, dropout on)
// has the losses of a fixed dp 4 run with the same global batch, under
// ZeRO-1, ZeRO-2, ZeRO-3 and {R,P(2),S}; one through tensor and pipeline
// sizes has a fixed run's losses too. Idle ranks wait without taking a core.
// Bad input is refused on every rank.
#include "test_util.h"
#include "saved_state.h"

#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/train/batch_schedule.h"
#include "tessera/train/elastic.h"
#include "tessera/train/piece_exchange.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <regex>

namespace tessera {
namespace {

using context::ParallelConfig;

// ---------------------------------------------------------------- exchange

// A piece of `full`: the box [offset, offset + length), of which the flat
// range [begin, end) (-1: all of it).
train::TensorPiece cut(const std::string& name, const at::Tensor& full, std::vector<int64_t> offset,
                       std::vector<int64_t> length, int64_t begin = 0, int64_t end = -1) {
  train::TensorPiece p;
  p.name = name;
  p.full_shape = full.sizes().vec();
  at::Tensor box = full;
  for (size_t d = 0; d < offset.size(); ++d) box = box.narrow(static_cast<int64_t>(d), offset[d], length[d]);
  at::Tensor flat = box.contiguous().view({-1});
  p.offset = std::move(offset);
  p.length = std::move(length);
  p.flat_begin = end < 0 ? 0 : begin;
  p.flat_end = end;
  p.data = end < 0 ? flat.clone() : flat.narrow(0, begin, end - begin).clone();
  return p;
}

// What a request should receive, computed from the full tensor directly.
at::Tensor expected(const at::Tensor& full, const infer::PieceRequest& r) {
  at::Tensor box = full;
  for (size_t d = 0; d < r.offset.size(); ++d) box = box.narrow(static_cast<int64_t>(d), r.offset[d], r.length[d]);
  at::Tensor flat = box.contiguous().view({-1});
  return r.flat_end < 0 ? flat : flat.narrow(0, r.flat_begin, r.flat_end - r.flat_begin);
}

// Splits [0, n) into `parts` ranges as ZeRO does (ceil-sized).
std::pair<int64_t, int64_t> part(int64_t n, int parts, int i) {
  const int64_t size = (n + parts - 1) / parts;
  const int64_t begin = std::min(n, i * size);
  return {begin, std::min(n, begin + size)};
}

TEST(PieceExchange, AnyLayoutToAnyLayout) {
  auto world = test::world();
  const int n = world->size(), me = world->rank();
  const at::Tensor a = test::seeded_randn({6, 10}, 1);
  const at::Tensor b = at::arange(0, 7 * 4, at::kLong).view({7, 4});
  const at::Tensor c = test::seeded_randn({5, 3}, 2).to(at::kBFloat16);
  const at::Tensor s = at::full({}, 17, at::kLong);
  std::vector<train::TensorPiece> held;
  std::vector<infer::PieceRequest> wanted;
  // "a" held as two column boxes [6, 5], each cut into ZeRO ranges over the
  // ranks; wanted as flat ranges of the whole tensor (index lists).
  for (int box = 0; box < 2; ++box)
    for (int r = 0; r < n; ++r)
      if ((box * n + r) % n == me) {
        const auto [lo, hi] = part(30, n, r);
        if (lo < hi) held.push_back(cut("a", a, {0, 5 * box}, {6, 5}, lo, hi));
      }
  const int wanted_parts = n + 1;
  for (int r = me; r < wanted_parts; r += n) {
    const auto [lo, hi] = part(60, wanted_parts, r);
    wanted.push_back({"a", {}, {}, lo, hi});
  }
  // "b" held as row boxes, wanted as column boxes (strided boxes).
  for (int r = 0; r < 7; ++r)
    if (r % n == me) held.push_back(cut("b", b, {r, 0}, {1, 4}));
  wanted.push_back({"b", {0, me % 4}, {7, 1}, 0, -1});
  // "c" (bf16) replicated: every rank holds it whole and wants ranges of it
  // (local copies only).
  held.push_back(cut("c", c, {}, {}));
  wanted.push_back({"c", {}, {}, me, me + 3});
  // A scalar held by the last rank, wanted by every rank.
  if (me == n - 1) held.push_back(cut("s", s, {}, {}));
  wanted.push_back({"s", {}, {}, 0, -1});

  const auto directory = train::PieceDirectory::gather(*world, held, me == 0 ? "meta of 0" : "");
  EXPECT_EQ(directory.metadata(0), "meta of 0");
  EXPECT_EQ(directory.names(), (std::vector<std::string>{"a", "b", "c", "s"}));
  train::PieceExchangeStats stats;
  const auto got = train::exchange_pieces(world, directory, held, wanted, c10::Device(c10::kCPU), "test", &stats);
  for (const auto& r : wanted) {
    SCOPED_TRACE(r.name);
    const at::Tensor full = r.name == "a" ? a : r.name == "b" ? b : r.name == "c" ? c : s;
    const at::Tensor value = got.flat(r.name, r.offset, r.length, r.flat_begin, r.flat_end);
    EXPECT_EQ(value.scalar_type(), full.scalar_type());
    EXPECT_TRUE(at::equal(value, expected(full, r)));
  }
  EXPECT_EQ(got.full("s").item<int64_t>(), 17);
  // Replicated "c" is copied, never sent.
  EXPECT_GE(stats.bytes_copied, 3 * 2);
  if (n == 1) EXPECT_EQ(stats.bytes_sent, 0);
}

TEST(PieceExchange, HolesAndStrangersAreRefusedOnEveryRank) {
  auto world = test::world();
  const at::Tensor a = test::seeded_randn({4, 4}, 3);
  // Rows 0 and 1 only.
  std::vector<train::TensorPiece> held;
  if (world->rank() == 0) held = {cut("a", a, {0, 0}, {2, 4})};
  const auto directory = train::PieceDirectory::gather(*world, held);
  // Rank 0 alone asks for what nobody holds; every rank throws.
  std::vector<infer::PieceRequest> hole = {{"a", {}, {}, 0, -1}};
  std::vector<infer::PieceRequest> fine = {{"a", {0, 0}, {2, 4}, 0, -1}};
  EXPECT_TRUE(test::throws_with(
      [&] {
        train::exchange_pieces(world, directory, held, world->rank() == 0 ? hole : fine, c10::Device(c10::kCPU),
                               "test");
      },
      world->rank() == 0 ? "8 of the 16 elements asked for are held" : "live resharding"));
  std::vector<infer::PieceRequest> stranger = {{"nobody", {}, {}, 0, -1}};
  EXPECT_TRUE(test::throws_with(
      [&] {
        train::exchange_pieces(world, directory, held, world->rank() == 0 ? stranger : fine,
                               c10::Device(c10::kCPU), "test");
      },
      world->rank() == 0 ? "no rank holds 'nobody'" : "live resharding"));
}

// ------------------------------------------------------- row-keyed dropout

TEST(RowKeyedDropout, ASampleGetsOneMaskHoweverTheBatchIsSplit) {
  const at::Tensor x = at::ones({8, 5, 6});
  auto make = [] { return nn::ParallelDropout(nn::ParallelDropoutOptions(0.5, 99).row_keyed(true)); };
  auto whole = make();
  const at::Tensor all = whole(x);
  // Four "data ranks" of two rows each, every one a fresh layer at the same stream position.
  for (int d = 0; d < 4; ++d) {
    auto layer = make();
    layer->set_first_row(2 * d);
    EXPECT_TRUE(at::equal(layer(x.narrow(0, 2 * d, 2)), all.narrow(0, 2 * d, 2))) << "rows of part " << d;
  }
  // Rows differ from each other, and the next call draws new masks.
  EXPECT_FALSE(at::equal(all[0], all[1]));
  EXPECT_FALSE(at::equal(whole(x), all));
  // Without row keys, the split changes the masks.
  auto plain = nn::ParallelDropout(nn::ParallelDropoutOptions(0.5, 99));
  auto plain_part = nn::ParallelDropout(nn::ParallelDropoutOptions(0.5, 99));
  plain(x);
  EXPECT_FALSE(at::equal(plain_part(x.narrow(0, 2, 2)), plain(x).narrow(0, 2, 2)));
}

// -------------------------------------------------------------- elastic

constexpr int64_t kSeq = 8;
constexpr int64_t kBatch = 8;

models::GPTConfig gpt_config(double dropout) {
  auto c = models::GPTConfig::preset("tiny");
  c.dropout(dropout);
  return c;
}

// The global batch of a step, the same on every rank.
std::pair<at::Tensor, at::Tensor> batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  const at::Tensor tokens = at::randint(gpt_config(0).vocab(), {kBatch, kSeq + 1}, gen, at::kLong);
  return {tokens.narrow(1, 0, kSeq), tokens.narrow(1, 1, kSeq).contiguous()};
}

train::ModelBuilder builder(double dropout, bool row_keyed) {
  return [dropout, row_keyed](const context::ParallelContextPtr& ctx) {
    torch::manual_seed(7);  // the same initial weights in every layout
    auto gpt = std::make_shared<models::GPTImpl>(gpt_config(dropout), nn::make_layer_factory(ctx, false, row_keyed));
    gpt->to(test::device());  // built on the CPU: the same weights on every device
    return train::gpt_train_model(gpt);
  };
}

std::shared_ptr<torch::optim::Optimizer> adamw(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> params;
  for (const auto& p : named) params.push_back(p.second);
  // Note [AdamW eps in equality tests]
  return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3).eps(1e-4));
}

train::TrainerOptions trainer_options(const std::string& spec) {
  return train::TrainerOptions().spec(parallel::ShardingSpec::parse(spec)).bucket_bytes(4096).clip_grad_norm(1.0);
}

// Losses of a run in one fixed layout over the first ranks.
std::vector<double> fixed_run(const ParallelConfig& layout, const std::string& spec, double dropout, bool row_keyed,
                              int64_t steps) {
  auto world = test::world();
  const int size = layout.data() * layout.pipeline() * layout.tensor();
  auto group = world->split(world->rank() < size ? 0 : -1, world->rank(), "fixed");
  std::vector<double> losses;
  if (group) {
    auto ctx = context::ParallelContext::create(group, layout);
    train::Trainer t(ctx, builder(dropout, row_keyed)(ctx), adamw, trainer_options(spec));
    const int64_t per = kBatch / layout.data();
    const int64_t first = ctx->rank(context::ParallelMode::kData) * per;
    for (int64_t step = 0; step < steps; ++step) {
      const auto [x, y] = batch(step);
      losses.push_back(t.train_step(x.narrow(0, first, per), y.narrow(0, first, per)).loss);
    }
  }
  at::Tensor all = at::zeros({steps}, at::kDouble);
  if (world->rank() == 0) all.copy_(at::tensor(losses, at::kDouble));
  world->control()->broadcast(all);
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + steps);
}

// Runs `steps` steps, moving to layouts[k] before step at[k].
std::vector<double> elastic_run(const std::vector<ParallelConfig>& layouts, const std::vector<int64_t>& at,
                                const std::string& spec, double dropout, bool row_keyed, int64_t steps,
                                std::vector<train::MigrationStats>* moves = nullptr) {
  auto world = test::world();
  train::ElasticTrainer et(world, builder(dropout, row_keyed), adamw, layouts[0],
                           train::ElasticOptions().trainer(trainer_options(spec)));
  std::vector<double> losses;
  size_t next = 1;
  for (int64_t step = 0; step < steps; ++step) {
    if (next < layouts.size() && at[next] == step) et.reshape(layouts[next++]);
    if (!et.active()) continue;
    const auto [x, y] = batch(step);
    const auto [first, count] = et.rows_of(kBatch);
    EXPECT_EQ(et.trainer().step(), step);
    losses.push_back(et.trainer().train_step(x.narrow(0, first, count), y.narrow(0, first, count)).loss);
  }
  et.finish();
  if (moves != nullptr) *moves = et.history();
  at::Tensor all = at::zeros({steps}, at::kDouble);
  if (world->rank() == 0) all.copy_(at::tensor(losses, at::kDouble));
  world->control()->broadcast(all);
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + steps);
}

ParallelConfig dp(int d, int pp = 1, int tp = 1) { return ParallelConfig().data(d).pipeline(pp).tensor(tp); }

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double rel = std::abs(got[i] - want[i]) / std::abs(want[i]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, tolerance) << "step " << i << ": " << got[i] << " vs " << want[i];
  }
  if (test::world()->rank() == 0) std::printf("  largest relative loss difference %.3g\n", worst);
}

TEST(Elastic, DataSizeFollowsItsScheduleWithAFixedLayoutsLosses) {
  auto world = test::world();
  if (world->size() < 4) GTEST_SKIP() << "needs 4 ranks";
  for (const std::string spec : {"zero1", "zero2", "zero3", "R,P(2),S"}) {
    SCOPED_TRACE(spec);
    std::vector<train::MigrationStats> moves;
    const auto fixed = fixed_run(dp(4), spec, 0.1, true, 40);
    const auto elastic = elastic_run({dp(1), dp(2), dp(4), dp(2)}, {0, 10, 20, 30}, spec, 0.1, true, 40, &moves);
    expect_close(elastic, fixed, 1e-6);
    ASSERT_EQ(moves.size(), 3u);
    EXPECT_EQ(moves[0].step, 10);
    EXPECT_GT(moves[0].bytes_moved, 0);
    if (world->rank() == 0)
      for (const auto& m : moves) std::printf("  %s\n", m.to_json().c_str());
  }
}

TEST(Elastic, DropoutThatIsNotRowKeyedDependsOnTheLayout) {
  // The mutation check of the test above: plain dropout draws per data rank.
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto one = fixed_run(dp(1), "zero1", 0.1, false, 2);
  const auto two = fixed_run(dp(2), "zero1", 0.1, false, 2);
  EXPECT_NE(one[0], two[0]);
  const auto keyed_one = fixed_run(dp(1), "zero1", 0.1, true, 2);
  const auto keyed_two = fixed_run(dp(2), "zero1", 0.1, true, 2);
  EXPECT_LE(std::abs(keyed_one[0] - keyed_two[0]), 1e-6 * std::abs(keyed_one[0]));
}

TEST(Elastic, TensorAndPipelineSizesMoveToo) {
  auto world = test::world();
  if (world->size() < 4) GTEST_SKIP() << "needs 4 ranks";
  const auto fixed = fixed_run(dp(4), "zero2", 0.0, false, 12);
  const auto elastic =
      elastic_run({dp(2, 1, 2), dp(1, 2, 2), dp(4), dp(1)}, {0, 3, 6, 9}, "zero2", 0.0, false, 12);
  expect_close(elastic, fixed, 1e-5);
}

// The step count and the loss scaler's state in a trainer's metadata, the
// part of it that a move must carry over unchanged.
std::string carried_metadata(const std::string& json) {
  std::smatch step, scaler;
  EXPECT_TRUE(std::regex_search(json, step, std::regex(R"("step":\d+)"))) << json;
  EXPECT_TRUE(std::regex_search(json, scaler, std::regex(R"("loss_scaler":\{[^}]*\})"))) << json;
  return step.str() + " " + scaler.str();
}

// Each move carries the whole state over bit for bit: every bf16 parameter,
// fp32 master, AdamW moment and step count (the state pieces, assembled apart
// from the exchange: saved_state.h), the trainer's step and the loss
// scaler's state, which grows after every clean step so that it is not its
// initial value at any move. Through data, tensor and pipeline sizes.
TEST(Elastic, EachMoveCarriesTheWholeStateBitForBit) {
  auto world = test::world();
  if (world->size() < 4) GTEST_SKIP() << "needs 4 ranks";
  auto bf16 = [](const context::ParallelContextPtr& ctx) {
    torch::manual_seed(7);
    auto gpt = std::make_shared<models::GPTImpl>(gpt_config(0.0), nn::make_layer_factory(ctx));
    gpt->to(test::device(), at::kBFloat16);
    return train::gpt_train_model(gpt);
  };
  const auto options =
      trainer_options("zero2").loss_scaling(true).scaler(optim::LossScalerOptions().growth_interval(1));
  train::ElasticTrainer et(world, bf16, adamw, dp(1), train::ElasticOptions().trainer(options));
  const std::vector<std::pair<int64_t, ParallelConfig>> moves = {
      {2, dp(2)}, {4, dp(4)}, {6, dp(1, 2, 2)}, {8, dp(2, 1, 2)}, {10, dp(1)}};
  const std::string dir = ::testing::TempDir() + "tessera_elastic_state_np" + std::to_string(world->size());
  size_t next = 0;
  for (int64_t step = 0; step < 12; ++step) {
    if (next < moves.size() && moves[next].first == step) {
      const ParallelConfig& to = moves[next++].second;
      SCOPED_TRACE(et.layout_name() + " -> " + context::to_string(to) + " at step " + std::to_string(step));
      const auto before = test::gather_state(et.active() ? et.trainer().state_pieces() : std::vector<train::TensorPiece>{},
                                             dir);
      // Rank 0 is active in every layout (the first ranks are).
      const std::string meta = world->rank() == 0 ? carried_metadata(et.trainer().state_metadata()) : "";
      if (world->rank() == 0) {
        EXPECT_NE(meta.find("\"scale\":"), std::string::npos) << meta;
        EXPECT_EQ(meta.find("\"scale\":65536.0"), std::string::npos) << "the scale must have grown: " << meta;
      }
      et.reshape(to);
      test::expect_state_equal(et.active() ? et.trainer().state_pieces() : std::vector<train::TensorPiece>{}, before);
      if (world->rank() == 0) EXPECT_EQ(carried_metadata(et.trainer().state_metadata()), meta);
    }
    if (!et.active()) continue;
    const auto [x, y] = batch(step);
    const auto [first, count] = et.rows_of(kBatch);
    const train::StepStats st = et.trainer().train_step(x.narrow(0, first, count), y.narrow(0, first, count));
    EXPECT_FALSE(st.skipped) << "step " << step;
  }
  et.finish();
}

TEST(Elastic, IdleRanksSleep) {
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  train::ElasticTrainer et(world, builder(0.0, false), adamw, dp(1),
                           train::ElasticOptions().trainer(trainer_options("ddp")));
  if (et.active()) {
    for (int64_t step = 0; step < 150; ++step) {
      const auto [x, y] = batch(step);
      et.trainer().train_step(x, y);
    }
  }
  et.finish();
  if (world->rank() > 0) {
    EXPECT_GT(et.idle_seconds(), 0.0);
    EXPECT_LT(et.idle_cpu_seconds(), 0.2 * et.idle_seconds())
        << "idle for " << et.idle_seconds() << " s, on the CPU for " << et.idle_cpu_seconds() << " s";
  }
}

TEST(Elastic, DataSizeFromTheBatch) {
  EXPECT_EQ(train::data_size_for(512, 8, 128), 4);
  EXPECT_EQ(train::data_size_for(8192, 8, 128), 8);
  EXPECT_EQ(train::data_size_for(100, 8, 1), 5);
  EXPECT_EQ(train::data_size_for(12, 8, 4, 2), 3);  // 4 rows per replica, even
  EXPECT_EQ(train::data_size_for(64, 8, 128), 1);
  EXPECT_TRUE(test::throws_with([] { train::data_size_for(0, 8, 1); }, "must all be >= 1"));
  // With expert parallelism the data size is a multiple of the expert size.
  EXPECT_EQ(train::data_size_for(24, 7, 1, 1, 2), 6);
  EXPECT_EQ(train::data_size_for(512, 7, 128, 1, 2), 4);
  EXPECT_EQ(train::data_size_for(64, 8, 128, 1, 2), 2);
  EXPECT_TRUE(test::throws_with([] { train::data_size_for(7, 8, 1, 1, 2); }, "does not split into 2 replicas"));
  EXPECT_TRUE(test::throws_with([] { train::data_size_for(8, 2, 1, 1, 4); }, "at most 2 fits"));
  EXPECT_TRUE(test::throws_with([] { train::data_size_for(9, 8, 1, 2); }, "accumulation"));
}

TEST(Elastic, BatchSchedule) {
  const auto s = train::BatchSchedule::parse("0:512,10:1024,30:8192");
  EXPECT_EQ(s.at(0), 512);
  EXPECT_EQ(s.at(9), 512);
  EXPECT_EQ(s.at(10), 1024);
  EXPECT_EQ(s.at(29), 1024);
  EXPECT_EQ(s.at(1000), 8192);
  EXPECT_EQ(s.largest(), 8192);
  EXPECT_EQ(s.to_string(), "0:512,10:1024,30:8192");
  EXPECT_EQ(train::BatchSchedule::constant(16).at(5), 16);
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse("5:512"); }, "the first key must be 0"));
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse("0:8,10:16,10:32"); }, "keys must increase"));
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse("0:8,x:16"); }, "'x:16' is not KEY:BATCH"));
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse("0:8;10:16"); }, "'0:8;10:16' is not KEY:BATCH"));
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse("0:0"); }, "must be >= 1"));
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse("0"); }, "has no ':'"));
  EXPECT_TRUE(test::throws_with([] { train::BatchSchedule::parse(""); }, "is empty"));
}

TEST(Elastic, BadInputIsRefusedOnEveryRank) {
  auto world = test::world();
  const int n = world->size();
  auto make = [&](const ParallelConfig& layout) {
    train::ElasticTrainer et(world, builder(0.0, false), adamw, layout);
  };
  EXPECT_TRUE(test::throws_with([&] { make(dp(n + 1)); }, "but the world has"));
  EXPECT_TRUE(test::throws_with([&] { make(ParallelConfig()); }, "the data size must be given"));
  EXPECT_TRUE(test::throws_with(
      [&] { train::ElasticTrainer et(world, builder(0.0, false), adamw, dp(1), train::ElasticOptions().min_rows_per_replica(0)); },
      "min_rows_per_replica must be >= 1"));
  if (n >= 2) {
    train::ElasticTrainer et(world, builder(0.0, false), adamw, dp(1));
    if (!et.active()) EXPECT_TRUE(test::throws_with([&] { et.trainer(); }, "is idle in layout"));
    // Ranks that ask for different layouts all throw instead of hanging.
    EXPECT_TRUE(test::throws_with([&] { et.reshape(dp(world->rank() == 0 ? 2 : 1)); }, "did not all call"));
    // A trainer the first layout cannot build stops the idle ranks as well.
    const auto bad = train::ElasticOptions().trainer(train::TrainerOptions().lr(
        train::LrSchedule().peak(1e-3).warmup_steps(10).total_steps(5).decay(train::LrDecay::kCosine)));
    EXPECT_TRUE(test::throws_with(
        [&] { train::ElasticTrainer broken(world, builder(0.0, false), adamw, dp(1), bad); },
        world->rank() == 0 ? "must exceed warmup_steps" : "building layout"));
  }
  // Row-keyed dropout needs whole samples on a rank.
  if (n >= 4) {
    auto group = world->split(world->rank() < 4 ? 0 : -1, world->rank(), "grid");
    if (group) {
      auto ctx = context::ParallelContext::create(group, ParallelConfig().tensor(4).tensor_mode(context::TensorMode::k2D));
      EXPECT_TRUE(test::throws_with([&] { nn::make_layer_factory(ctx, false, true); }, "row-keyed dropout"));
    }
  }
}

}  // namespace
}  // namespace tessera
