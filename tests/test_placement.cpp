// The placement model (nn/placement.h) read by every consumer, on a toy layer
// whose weight is sharded along two dimensions over two groups and replicated
// over a third (the data group), at 2 x 2 x 2 = 8 ranks:
//   W [8, 6]  rows over A ("2d-row"), columns over B ("2d-col")
//   s [8]     rows over A, replicated over B (every B rank computes its whole gradient)
//   c [8]     rows over A, partial over B (each B rank sees half of the rows)
// z = tanh((x Wᵀ) · s + c), loss = Σ (z - t)² / rows. The serial side is the
// same arithmetic written directly in LibTorch.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "counting_allocator.h"
#include "test_util.h"

#include "tessera/comm/functional.h"
#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/init.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/placement.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/whole_norms.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/state_pieces.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace tessera {
namespace {

constexpr int64_t kOut = 8, kIn = 6, kRows = 8;  // rows per data rank
constexpr int kSteps = 5;
constexpr double kTolerance = 1e-5;

// The toy layer over groups a (rows of W) and b (columns of W); size-1
// groups give the 1D layout or one process.
struct ToyImpl : torch::nn::Module, nn::PlacedModule {
  ToyImpl(comm::CommunicatorPtr a_, comm::CommunicatorPtr b_) : a(std::move(a_)), b(std::move(b_)) {
    w = register_parameter("w", at::zeros({kOut / a->size(), kIn / b->size()}));
    s = register_parameter("s", at::zeros({kOut / a->size()}));
    c = register_parameter("c", at::zeros({kOut / a->size()}));
  }
  nn::NamedPlacements local_placements() override {
    return {{"w", nn::replicated_placement(w).shard("2d-row", a, 0).shard("2d-col", b, 1)},
            {"s", nn::replicated_placement(s).shard("2d-row", a, 0).replicate("2d-col", b)},
            {"c", nn::replicated_placement(c).shard("2d-row", a, 0).partial("2d-col", b)}};
  }
  nn::NamedPlacements placements() {
    return nn::placements_of(*this, [](const at::Tensor& p) { return nn::replicated_placement(p); });
  }
  // x [n, kIn] full, t [n, kOut] full -> Σ over this rank's rows of (z - t)² / n.
  at::Tensor loss(const at::Tensor& x, const at::Tensor& t) {
    const at::Tensor y = comm::reduce_from_group(at::matmul(comm::split_along_dim(x, 1, b), w.t()), b) * s;
    const at::Tensor z = at::tanh(comm::split_along_dim(y, 0, b) + c);
    const at::Tensor full = comm::gather_along_dim(z, 1, a);
    const int64_t n = x.size(0), mine = n / b->size();
    return (full - t.narrow(0, b->rank() * mine, mine)).pow(2).sum() / static_cast<double>(n);
  }
  comm::CommunicatorPtr a, b;
  at::Tensor w, s, c;
};
TORCH_MODULE(Toy);

std::map<std::string, at::Tensor> initial_weights() {
  return {{"w", test::device_randn({kOut, kIn}, 1) * 0.4},
          {"s", 1.0 + test::device_randn({kOut}, 2) * 0.2},
          {"c", test::device_randn({kOut}, 3) * 0.1}};
}
at::Tensor batch_x(int step, int64_t rows) { return test::device_randn({rows, kIn}, 100 + step); }
at::Tensor batch_t(int step, int64_t rows) { return test::device_randn({rows, kOut}, 200 + step) * 0.5; }

// Plain LibTorch: losses, gradient norms (before each step) and the weights after kSteps AdamW steps.
struct Serial {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> weights;
};
Serial serial_run(int64_t rows) {
  auto init = initial_weights();
  at::Tensor w = init["w"].clone().requires_grad_(), s = init["s"].clone().requires_grad_(),
             c = init["c"].clone().requires_grad_();
  torch::optim::AdamW opt({w, s, c}, torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  Serial out;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    const at::Tensor z = at::tanh(at::matmul(batch_x(step, rows), w.t()) * s + c);
    at::Tensor loss = (z - batch_t(step, rows)).pow(2).sum() / static_cast<double>(rows);
    loss.backward();
    double sq = 0;
    for (const auto& p : {w, s, c}) sq += p.grad().pow(2).sum().item<double>();
    out.norms.push_back(std::sqrt(sq));
    out.losses.push_back(loss.item<double>());
    opt.step();
  }
  out.weights = {{"w", w.detach()}, {"s", s.detach()}, {"c", c.detach()}};
  return out;
}

comm::CommunicatorPtr self_of(const comm::CommunicatorPtr& world) { return world->split(world->rank(), 0, "self"); }

// A trained toy in some layout: the model, its wrapper and optimizer.
struct ToyRun {
  Toy toy{nullptr};
  parallel::ShardedModulePtr sharded;
  std::unique_ptr<parallel::ShardedOptimizer> opt;
  comm::CommunicatorPtr data;
};

ToyRun make_run(const context::ParallelContextPtr& ctx, comm::CommunicatorPtr a, comm::CommunicatorPtr b,
             const std::string& spec) {
  ToyRun r;
  r.toy = Toy(std::move(a), std::move(b));
  r.toy->to(test::device());
  for (const auto& [name, p] : r.toy->placements()) nn::load_full(p, initial_weights().at(name));
  const auto placements = r.toy->placements();
  r.sharded = std::make_shared<parallel::ShardedModule>(
      r.toy.ptr(), ctx,
      parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::parse(spec)).placements(placements));
  r.opt = std::make_unique<parallel::ShardedOptimizer>(
      r.sharded,
      std::make_shared<torch::optim::AdamW>(r.toy->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01)),
      parallel::ShardedOptimizerOptions().whole_norms(std::make_shared<parallel::PlacementNorms>(placements)));
  r.data = ctx->comm(context::ParallelMode::kData);
  return r;
}

// The global-batch loss of step `step` (rows per data rank `rows`), the same on every rank.
double global_loss(ToyRun& r, int step, int64_t rows, bool backward) {
  const int64_t d = r.data->rank();
  const at::Tensor x = batch_x(step, rows * r.data->size()).narrow(0, d * rows, rows);
  const at::Tensor t = batch_t(step, rows * r.data->size()).narrow(0, d * rows, rows);
  at::Tensor loss = r.sharded->run([&] { return r.toy->loss(x, t); });
  if (backward) loss.backward();
  at::Tensor total = at::tensor({loss.item<double>()}, at::kDouble);
  r.toy->b->all_reduce(total);  // each b rank holds its rows' part
  r.data->all_reduce(total);
  return total.item<double>() / static_cast<double>(r.data->size());
}

std::map<std::string, at::Tensor> full_weights(ToyRun& r) {
  auto gathered = r.sharded->full_params();
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, p] : r.toy->placements()) out[name] = nn::full_value(p);
  return out;
}

TEST(Placement, RegionsAndGroupsOfATwoDimensionalShard) {
  auto world = test::world();
  if (world->size() != 8) GTEST_SKIP() << "the 2 x 2 x 2 layout needs 8 ranks";
  auto ctx = context::ParallelContext::create(
      world, context::ParallelConfig().tensor(4).tensor_mode(context::TensorMode::k2D));
  auto a = ctx->comm(context::ParallelMode::k2DRow), b = ctx->comm(context::ParallelMode::k2DCol);
  Toy toy(a, b);
  toy->to(test::device());
  const auto p = toy->placements();
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].second.full_shape, (std::vector<int64_t>{kOut, kIn}));
  EXPECT_EQ(p[0].second.offset, (std::vector<int64_t>{a->rank() * kOut / 2, b->rank() * kIn / 2}));
  EXPECT_EQ(p[0].second.length, (std::vector<int64_t>{kOut / 2, kIn / 2}));
  EXPECT_EQ(p[0].second.describe(), "2d-row:S(0) 2d-col:S(1)");
  EXPECT_EQ(p[0].second.shard_groups().size(), 2u);
  EXPECT_TRUE(p[1].second.gradient_groups().empty());
  ASSERT_EQ(p[2].second.gradient_groups().size(), 1u);
  EXPECT_EQ(p[2].second.gradient_groups()[0].get(), b.get());
  // Two axes sharding one dimension nest in order: a outer, b inner.
  auto nested = nn::replicated_placement(at::zeros({2, 3}, test::device_options())).shard("x", a, 0).shard("y", b, 0);
  EXPECT_EQ(nested.full_shape[0], 8);
  EXPECT_EQ(nested.offset[0], (a->rank() * 2 + b->rank()) * 2);
  const at::Tensor full = at::arange(24, test::device_options()).view({8, 3});
  nn::load_full(nested, full);
  EXPECT_TRUE(at::equal(nn::gather_full(nested, nested.param), full));
}

// 5 AdamW steps with ZeRO-2 over the data group equal the serial ones; the
// whole gradient norm counts every element once; a checkpoint of that layout
// loads into 1D tp4 x dp2 and into one process with the same loss.
TEST(Placement, TwoDimensionalShardUnderZero2EqualsSerialAndReshards) {
  auto world = test::world();
  if (world->size() != 8) GTEST_SKIP() << "the 2 x 2 x 2 layout needs 8 ranks";
  const Serial serial = serial_run(2 * kRows);
  auto ctx = context::ParallelContext::create(
      world, context::ParallelConfig().tensor(4).tensor_mode(context::TensorMode::k2D));
  ToyRun run = make_run(ctx, ctx->comm(context::ParallelMode::k2DRow), ctx->comm(context::ParallelMode::k2DCol), "zero2");
  for (int step = 0; step < kSteps; ++step) {
    run.opt->zero_grad();
    const double loss = global_loss(run, step, kRows, /*backward=*/true);
    EXPECT_NEAR(loss, serial.losses[step], kTolerance * serial.losses[step]) << "loss, step " << step;
    // A huge max_norm: measures the norm without clipping.
    const double norm = run.opt->clip_grad_norm(1e9);
    EXPECT_NEAR(norm, serial.norms[step], kTolerance * serial.norms[step]) << "gradient norm, step " << step;
    run.opt->step();
  }
  for (const auto& [name, value] : full_weights(run))
    EXPECT_LE(test::rel_error(value, serial.weights.at(name)), kTolerance) << name;

  // The loss the trained model gives on a fresh batch, then a checkpoint.
  const double trained = global_loss(run, kSteps, kRows, /*backward=*/false);
  const std::string dir = "placement_test_checkpoint";
  auto placements = run.toy->placements();
  train::save_checkpoint(dir, train::optimizer_pieces(*run.opt, placements), "{}", world);

  {  // 1D: tensor 4 (W rows over it), dp 2, ZeRO-2.
    auto ctx1d = context::ParallelContext::create(world, context::ParallelConfig().tensor(4));
    ToyRun r = make_run(ctx1d, ctx1d->comm(context::ParallelMode::kTensor), self_of(world), "zero2");
    train::load_optimizer_pieces(infer::CheckpointReader(dir), *r.opt, r.toy->placements());
    EXPECT_NEAR(global_loss(r, kSteps, kRows, false), trained, kTolerance * trained) << "loaded into 1D tp4 x dp2";
  }
  {  // One process: every rank alone, the whole batch.
    auto self = self_of(world);
    auto one = context::ParallelContext::create(self, context::ParallelConfig());
    ToyRun r = make_run(one, self, self_of(world), "ddp");
    train::load_optimizer_pieces(infer::CheckpointReader(dir), *r.opt, r.toy->placements());
    const double loss = global_loss(r, kSteps, 2 * kRows, false);
    EXPECT_NEAR(loss, trained, kTolerance * trained) << "loaded into one process";
    for (const auto& [name, value] : full_weights(r))
      EXPECT_LE(test::rel_error(value, serial.weights.at(name)), kTolerance) << name << " after loading";
  }
}

// An index of the first format (one sharded dimension: dim, offset, length) still loads.
// Files and the reader's CPU tensors only: on the CPU whatever the device.
TEST(Placement, VersionOneCheckpointIndexIsRead) {
  auto world = test::world();
  const std::string dir = "placement_v1_checkpoint_" + std::to_string(world->size());
  if (world->rank() == 0) {
    remove_tree(dir);
    std::filesystem::create_directories(dir);
    const at::Tensor full = at::arange(12, at::kFloat).view({4, 3});
    write_safetensors(dir + "/rank-00000.safetensors",
                             {{"w#0", full.narrow(0, 0, 2).reshape({-1})}, {"w#1", full.narrow(0, 2, 2).reshape({-1})},
                              {"b#2", at::ones({3})}});
    const auto bytes = std::filesystem::file_size(dir + "/rank-00000.safetensors");
    std::ofstream(dir + "/index.json")
        << R"({"format": "tessera-checkpoint", "version": 1, "world_size": 1, "metadata": {},
              "files": {"rank-00000.safetensors": )"
        << bytes << R"(},
              "tensors": {
                "w": {"shape": [4, 3], "pieces": [
                  {"file": "rank-00000.safetensors", "key": "w#0", "dim": 0, "offset": 0, "length": 2, "flat": [0, -1]},
                  {"file": "rank-00000.safetensors", "key": "w#1", "dim": 0, "offset": 2, "length": 2, "flat": [0, -1]}]},
                "b": {"shape": [3], "pieces": [
                  {"file": "rank-00000.safetensors", "key": "b#2", "dim": -1, "offset": 0, "length": 0, "flat": [0, -1]}]}}})";
  }
  world->barrier();
  infer::CheckpointReader reader(dir);
  EXPECT_TRUE(at::equal(reader.full("w"), at::arange(12, at::kFloat).view({4, 3})));
  EXPECT_TRUE(at::equal(reader.full("b"), at::ones({3})));
  EXPECT_TRUE(at::equal(reader.region("w", {1, 1}, {2, 2}), at::arange(12, at::kFloat).view({4, 3}).slice(0, 1, 3).slice(1, 1, 3)));
  world->barrier();
}

// Construction draws only what a rank holds (Note [Layout-independent
// initialization]): GPT-medium-sized layers (hidden 1024, 16 heads, vocabulary
// 50257, context 1024; 2 blocks to keep the test short) at tensor size 4.
// Modules are built on the CPU whatever the device: this test stays there.
TEST(Placement, ConstructionMemoryIsTheLocalShardPlusOneBlock) {
  auto world = test::world();
  if (world->size() % 4 != 0) GTEST_SKIP() << "tensor size 4 needs a world that is a multiple of 4";
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().tensor(4));
  auto factory = nn::make_layer_factory(ctx);
  models::GPTConfig config = models::GPTConfig::preset("medium");
  config.layers(2);
  auto& counter = test::CountingAllocator::instance();
  int64_t before = 0, peak = 0, local = 0;
  {
    test::CountingScope scope;
    before = counter.live();
    counter.reset_peak();
    torch::manual_seed(0);
    models::GPT gpt(config, factory);
    peak = counter.peak() - before;
    for (const auto& p : gpt->parameters()) local += p.numel() * static_cast<int64_t>(p.element_size());
  }
  const int64_t block = nn::kInitBlockElements * 4;
  if (world->rank() == 0)
    std::printf("construction at tp 4: peak %.2f MB above the start, local parameters %.2f MB, one block %.2f MB\n",
                peak / 1e6, local / 1e6, block / 1e6);
  EXPECT_LE(static_cast<double>(peak), 1.1 * static_cast<double>(local) + static_cast<double>(block));
}

// The same seed gives the same full weights whatever the layout: tensor 4 vs one process.
TEST(Placement, InitializationDoesNotDependOnTheLayout) {
  auto world = test::world();
  if (world->size() % 4 != 0) GTEST_SKIP() << "tensor size 4 needs a world that is a multiple of 4";
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().tensor(4));
  auto self = self_of(world);
  auto one = context::ParallelContext::create(self, context::ParallelConfig());
  const models::GPTConfig config = models::GPTConfig::preset("tiny");
  torch::manual_seed(9);
  models::GPT parallel(config, nn::make_layer_factory(ctx, /*sequence_parallel=*/true));
  parallel->to(test::device());
  torch::manual_seed(9);
  models::GPT serial(config, nn::make_layer_factory(one));
  serial->to(test::device());
  const auto a = parallel->full_state(), b = serial->full_state();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, value] : b) EXPECT_TRUE(at::equal(a.at(name), value)) << name;
}

}  // namespace
}  // namespace tessera
