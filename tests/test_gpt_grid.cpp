// models::GPT in 2D (q = 2 at 4 ranks) and 2.5D (q = 2, depth 1 at 4 ranks;
// depth 2 at 8) against the serial reference GPT (tests/reference_gpt.h:
// plain LibTorch) loaded with the same full weights: logits, loss, every
// gradient, and the losses and weights over 5 AdamW steps; tied and untied
// heads, with and without activation checkpointing. Also the factory's
// activation layout and its refusals.
#include "test_util.h"

#include "gpt_weights.h"
#include "reference_gpt.h"

#include "tessera/comm/tracing_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/shard.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/whole_norms.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

constexpr double kRelTolerance = 1e-5;  // fp32, relative to the norm of the serial tensor
constexpr int64_t kBatch = 4, kSeq = 16;
using context::ParallelConfig;
using context::TensorMode;
using test::rel_error;

struct GridCase {
  std::string name;
  ParallelConfig config;
};

std::vector<GridCase> grid_cases(int world_size) {
  if (world_size == 4)
    return {{"2d q2", ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D)},
            {"2.5d q2 d1", ParallelConfig().tensor(4).tensor_mode(TensorMode::k2p5D).tensor_depth(1)}};
  if (world_size == 8)
    return {{"2.5d q2 d2", ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2)}};
  return {};
}

// Full logits [b, s, vocab] from every rank's [b/(q·d), s, V_p/q] block.
at::Tensor full_logits(const at::Tensor& local, const context::ParallelContextPtr& ctx, int64_t vocab) {
  const bool deep = ctx->config().tensor_mode() == TensorMode::k2p5D;
  auto row = ctx->comm(deep ? context::ParallelMode::k2p5DRow : context::ParallelMode::k2DRow);
  auto batch = ctx->comm(deep ? context::ParallelMode::k2p5DXZ : context::ParallelMode::k2DCol);
  return nn::unshard(nn::unshard(local, -1, *row), 0, *batch).narrow(-1, 0, vocab);
}

// c_attn's bias without its key rows (rows grouped per head: q, k, v). The
// key bias adds the same q·b_k to every score of a query, which softmax
// ignores: its gradient is zero in exact arithmetic and rounding noise in
// practice, and AdamW turns noise of any size into steps of ±lr. Its
// gradient is still compared (it is ~0 on both sides).
at::Tensor without_key_bias(const at::Tensor& bias, const models::GPTConfig& c) {
  const int64_t d = c.hidden / c.heads;
  return bias.view({c.heads, 3, d}).index_select(1, at::tensor({0, 2}, at::kLong)).reshape({-1});
}

void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

class GPTGrid : public ::testing::TestWithParam<std::string> {};

TEST_P(GPTGrid, MatchesSerialIncludingFiveAdamWSteps) {
  auto world = test::world();
  const auto cases = grid_cases(world->size());
  if (cases.empty()) GTEST_SKIP() << "runs at 4 and 8 ranks";
  models::GPTConfig c = models::GPTConfig::preset("tiny");
  c.tied = GetParam() != "untied";
  c.checkpoint_activations = GetParam() == "checkpointed";
  const auto full = test::gpt_initial_weights(c, 3);
  for (const GridCase& gc : cases) {
    SCOPED_TRACE(gc.name);
    auto ctx = context::ParallelContext::create(world, gc.config);
    test::ReferenceGPT serial(test::reference_config(c));
    serial->load_full_state(full);
    models::GPT grid(c, nn::make_layer_factory(ctx));
    EXPECT_EQ(grid->factory()->mode(), gc.name.substr(0, gc.name.find(' ')));
    grid->load_full_state(full);
    for (const auto& [name, value] : grid->full_state())
      EXPECT_TRUE(at::equal(value, full.at(name))) << name << " does not round-trip";

    torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW grid_opt(grid->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step <= 5; ++step) {
      zero_grads(*serial);
      zero_grads(*grid);
      const at::Tensor ids = test::seeded_token_ids(10 + step, c.vocab, kBatch, kSeq);
      at::Tensor targets = test::seeded_token_ids(20 + step, c.vocab, kBatch, kSeq);
      targets[1][3] = -100;  // an ignored target: the mean counts the others only
      const at::Tensor serial_logits = serial->forward(ids);
      const at::Tensor serial_loss = serial->loss(serial_logits, targets);
      serial_loss.backward();
      const at::Tensor logits = grid->forward(ids);
      const at::Tensor loss = grid->loss(logits, targets);
      loss.backward();
      grid->reduce_partial_gradients();
      EXPECT_LE(rel_error(loss.detach(), serial_loss.detach()), kRelTolerance) << "loss after " << step << " steps";
      if (step == 0) {
        EXPECT_LE(rel_error(full_logits(logits.detach(), ctx, c.vocab), serial_logits.detach()), kRelTolerance);
        const auto serial_grads = serial->full_state(true);
        for (const auto& [name, grad] : grid->full_state(true))
          EXPECT_LE(rel_error(grad, serial_grads.at(name)), kRelTolerance) << "gradient of " << name;
      }
      if (step < 5) {
        serial_opt.step();
        grid_opt.step();
      }
    }
    const auto serial_weights = serial->full_state();
    for (const auto& [name, value] : grid->full_state()) {
      const bool c_attn_bias = name.find("c_attn.bias") != std::string::npos;
      EXPECT_LE(rel_error(c_attn_bias ? without_key_bias(value, c) : value,
                          c_attn_bias ? without_key_bias(serial_weights.at(name), c) : serial_weights.at(name)),
                kRelTolerance)
          << name << " after 5 steps";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GPTGrid, ::testing::Values("tied", "untied", "checkpointed"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Under the data-parallel wrapper (data size 1 here: the whole world is the
// tensor grid) the Partial gradients are summed inside its buckets, and the
// optimizer's whole gradient norm counts every element once. The wrapper
// holds the GPT as the trainer does, as a Sequential whose first and last
// layers both register the tied embedding.
TEST(GPTGrid, ShardedGradientsAndWholeNormEqualSerial) {
  auto world = test::world();
  const auto cases = grid_cases(world->size());
  if (cases.empty()) GTEST_SKIP() << "runs at 4 and 8 ranks";
  models::GPTConfig c = models::GPTConfig::preset("tiny");
  c.layers = 4;
  const auto full = test::gpt_initial_weights(c, 4);
  const at::Tensor ids = test::seeded_token_ids(30, c.vocab, 12, 8);
  const at::Tensor targets = test::seeded_token_ids(31, c.vocab, 12, 8);
  test::ReferenceGPT serial(test::reference_config(c));
  serial->load_full_state(full);
  serial->loss(serial->forward(ids), targets).backward();
  const double serial_norm = torch::nn::utils::clip_grad_norm_(serial->parameters(), 1e9);
  const auto serial_grads = serial->full_state(true);
  for (const GridCase& gc : cases) {
    for (const char* spec : {"ddp", "zero3"}) {
      SCOPED_TRACE(gc.name + " " + spec);
      auto ctx = context::ParallelContext::create(world, gc.config);
      auto gpt = std::make_shared<models::GPTImpl>(c, nn::make_layer_factory(ctx));
      gpt->load_full_state(full);
      const nn::NamedPlacements placements = gpt->placements();
      auto seq = gpt->as_sequential();
      auto sharded = std::make_shared<parallel::ShardedModule>(
          seq.ptr(), ctx,
          parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::parse(spec)).placements(placements).bucket_bytes(4096));
      parallel::ShardedOptimizer opt(
          sharded, std::make_shared<torch::optim::SGD>(gpt->parameters(), torch::optim::SGDOptions(0.1)),
          parallel::ShardedOptimizerOptions().whole_norms(std::make_shared<parallel::PlacementNorms>(placements)));
      sharded->run([&] { return gpt->loss(seq->forward(ids), targets); }).backward();
      sharded->finish_gradient_sync();
      EXPECT_NEAR(opt.clip_grad_norm(1e9), serial_norm, kRelTolerance * serial_norm);
      for (const auto& [name, grad] : gpt->full_state(true))
        EXPECT_LE(rel_error(grad, serial_grads.at(name)), kRelTolerance) << "gradient of " << name;
    }
  }
}

// One forward + backward of the GPT moves, per rank, with T = b/(q·d)·s
// local tokens, H = h/q, V_q = V_p/q and L layers (docs/tensor-parallel.md):
//   row  broadcast 2q·(7L·T·H + T·V_q)   reduce q·(7L·T·H + T·V_q)
//        all-reduce 4(2L+1)·T (layer-norm sums) + 3T (cross entropy)
//   col  broadcast 2q·(12L·h²/q² + V_q·H) reduce q·(12L·h²/q² + V_q·H)
//        reduce-scatter q·T·H (embedding), all-gather q·T·H (its backward)
//   batch group (col in 2D, xz in 2.5D) all-reduce of the loss, 1 element
// in elements of 4 bytes, traced sizes (Note [Trace byte counts]). The
// linears' share is the SUMMA formula of each Linear2D: 7T·H = |A| of
// c_attn, attn_proj, c_fc (T·H each) and c_proj (4T·H); 12h²/q² their |W|.
TEST(GPTGrid, TracedBytesEqualTheFormula) {
  comm::WorldOptions options;
  options.trace = std::make_shared<comm::CommTrace>();
  auto world = comm::make_world_communicator(options);
  const models::GPTConfig c = models::GPTConfig::preset("tiny");
  for (const GridCase& gc : grid_cases(world->size())) {
    SCOPED_TRACE(gc.name);
    auto ctx = context::ParallelContext::create(world, gc.config);
    const bool deep = gc.config.tensor_mode() == TensorMode::k2p5D;
    const std::string row = ctx->comm(deep ? context::ParallelMode::k2p5DRow : context::ParallelMode::k2DRow)->name();
    const std::string col = ctx->comm(deep ? context::ParallelMode::k2p5DCol : context::ParallelMode::k2DCol)->name();
    const std::string batch = deep ? ctx->comm(context::ParallelMode::k2p5DXZ)->name() : col;
    models::GPT gpt(c, nn::make_layer_factory(ctx));
    options.trace->reset();
    gpt->loss(gpt->forward(test::seeded_token_ids(40, c.vocab, kBatch, kSeq)),
              test::seeded_token_ids(41, c.vocab, kBatch, kSeq))
        .backward();
    const int64_t q = 2, d = deep ? gc.config.tensor_depth() : 1, L = c.layers;
    const int64_t T = kBatch / (q * d) * kSeq, H = c.hidden / q, Vq = (c.vocab + q - 1) / q;
    const int64_t acts = 7 * L * T * H + T * Vq, weights = 12 * L * c.hidden * c.hidden / (q * q) + Vq * H;
    auto expect = [&](const std::string& group, comm::OpType op, int64_t calls, int64_t elements) {
      const auto got = options.trace->get(group, op);
      EXPECT_EQ(got.calls, calls) << group << " " << comm::op_type_name(op);
      EXPECT_EQ(got.bytes, 4 * elements) << group << " " << comm::op_type_name(op);
      return 4 * elements;
    };
    int64_t total = 0;
    total += expect(row, comm::OpType::kBroadcast, 2 * q * (4 * L + 1), 2 * q * acts);
    total += expect(row, comm::OpType::kReduce, q * (4 * L + 1), q * acts);
    total += expect(row, comm::OpType::kAllReduce, 4 * (2 * L + 1) + 2, 4 * (2 * L + 1) * T + 3 * T);
    total += expect(col, comm::OpType::kBroadcast, 2 * q * (4 * L + 1), 2 * q * weights);
    total += expect(col, comm::OpType::kReduce, q * (4 * L + 1), q * weights);
    total += expect(col, comm::OpType::kReduceScatter, 1, q * T * H);
    total += expect(col, comm::OpType::kAllGather, 1, q * T * H);
    if (deep) {
      total += expect(batch, comm::OpType::kAllReduce, 1, 1);
    } else {
      total += 4;  // the loss's all-reduce over col
      EXPECT_EQ(options.trace->get(col, comm::OpType::kAllReduce).calls, 1);
    }
    EXPECT_EQ(options.trace->total().bytes, total) << options.trace->to_string();
  }
}

TEST(LayerFactoryGrid, ActivationLayoutRoundTrips) {
  auto world = test::world();
  for (const GridCase& gc : grid_cases(world->size())) {
    SCOPED_TRACE(gc.name);
    auto ctx = context::ParallelContext::create(world, gc.config);
    auto f = nn::make_layer_factory(ctx);
    const bool deep = gc.config.tensor_mode() == TensorMode::k2p5D;
    const int i = ctx->rank(deep ? context::ParallelMode::k2p5DCol : context::ParallelMode::k2DCol);
    const int j = ctx->rank(deep ? context::ParallelMode::k2p5DRow : context::ParallelMode::k2DRow);
    const int k = deep ? ctx->rank(context::ParallelMode::k2p5DDep) : 0;
    const int q = 2, d = deep ? gc.config.tensor_depth() : 1;
    const at::Tensor full = at::arange(kBatch * 3 * 8, at::kFloat).reshape({kBatch, 3, 8});
    const at::Tensor local = f->scatter_activation(full);
    // Batch block i + q·k of q·d, hidden block j of q (Note [2D and 2.5D layouts]).
    EXPECT_TRUE(at::equal(local, full.chunk(q * d, 0)[i + q * k].chunk(q, 2)[j]));
    EXPECT_TRUE(at::equal(f->gather_activation(local), full));
    EXPECT_TRUE(at::equal(f->positions(5), at::arange(5, at::kLong)));
  }
}

TEST(LayerFactoryGrid, BadShapesAreRefusedOnEveryRank) {
  auto world = test::world();
  for (const GridCase& gc : grid_cases(world->size())) {
    SCOPED_TRACE(gc.name);
    auto ctx = context::ParallelContext::create(world, gc.config);
    const int64_t parts = gc.config.tensor() / 2;  // q·d batch blocks
    models::GPTConfig c = models::GPTConfig::preset("tiny");
    c.heads = 3;
    c.hidden = 12;
    EXPECT_ERROR_CONTAINS(models::GPT(c, nn::make_layer_factory(ctx)), "number of attention heads (3)",
                          "not divisible by q = 2");
    c.heads = 1;
    c.hidden = 3;
    EXPECT_ERROR_CONTAINS(models::GPT(c, nn::make_layer_factory(ctx)), "embedding_dim (3) is not divisible");
    models::GPT gpt(models::GPTConfig::preset("tiny"), nn::make_layer_factory(ctx));
    const at::Tensor ids = test::seeded_token_ids(1, 101, parts + 1, kSeq);
    const std::string odd = "batch size " + std::to_string(parts + 1) + " is not divisible by q*depth = " +
                            std::to_string(parts);
    EXPECT_ERROR_CONTAINS(gpt->forward(ids), odd.c_str());
    at::Tensor bad = ids.narrow(0, 0, parts).clone();
    bad[parts - 1][kSeq - 1] = 101;  // in the last batch block only
    EXPECT_ERROR_CONTAINS(gpt->forward(bad), "token id 101 is out of range");
    const at::Tensor logits = gpt->forward(ids.narrow(0, 0, parts));
    const std::string short_targets =
        "batch size " + std::to_string(parts - 1) + " is not divisible by " + std::to_string(parts);
    EXPECT_ERROR_CONTAINS(gpt->loss(logits, ids.narrow(0, 0, parts - 1)), short_targets.c_str());
  }
}

}  // namespace
}  // namespace tessera
