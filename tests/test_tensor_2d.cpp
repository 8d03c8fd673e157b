// 2D (q x q) and 2.5D (q x q x d) tensor parallelism against plain LibTorch:
// the SUMMA products on their own, and the output, input gradient,
// parameter gradients and 5 AdamW steps of Linear2D, LayerNorm2D and
// VocabEmbedding2D. 4 ranks run 2D with q = 2 (and, with
// TESSERA_TEST_2P5D_DEPTH1 set, 2.5D with q = 2, d = 1), 8 ranks 2.5D with
// q = 2, d = 2; one rank runs the same code on 1 x 1 groups.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/comm/factory.h"
#include "tessera/comm/tracing_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/nn/layer_norm_2d.h"
#include "tessera/nn/linear_2d.h"
#include "tessera/nn/placement.h"
#include "tessera/nn/summa.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"
#include "tessera/nn/vocab_embedding_2d.h"

#include <gtest/gtest.h>
#include <cstdlib>
#include <torch/torch.h>

namespace tessera {
namespace {

constexpr double kTolerance = 1e-5;

// The grid of this world size: row, col, depth and the batch group (xz in 2.5D).
struct Grid {
  comm::CommunicatorPtr row, col, depth, batch;
  int q = 1, d = 1;
  int i() const { return col->rank(); }  // grid row
  int j() const { return row->rank(); }  // grid column
  std::string what() const { return "q " + std::to_string(q) + ", depth " + std::to_string(d); }
};

bool make_grid(Grid* g, comm::CommunicatorPtr world = test::world()) {
  const int n = world->size();
  if (n == 4 && std::getenv("TESSERA_TEST_2P5D_DEPTH1") != nullptr) {  // 2.5D at depth 1: 2D through 2.5D's groups
    auto ctx = context::ParallelContext::create(
        world, context::ParallelConfig().tensor(4).tensor_mode(context::TensorMode::k2p5D).tensor_depth(1));
    *g = {ctx->comm(context::ParallelMode::k2p5DRow), ctx->comm(context::ParallelMode::k2p5DCol),
          ctx->comm(context::ParallelMode::k2p5DDep), ctx->comm(context::ParallelMode::k2p5DXZ), 2, 1};
    return true;
  }
  if (n == 4) {
    auto ctx = context::ParallelContext::create(world, context::ParallelConfig().tensor(4).tensor_mode(
                                                           context::TensorMode::k2D));
    *g = {ctx->comm(context::ParallelMode::k2DRow), ctx->comm(context::ParallelMode::k2DCol), nullptr,
          ctx->comm(context::ParallelMode::k2DCol), 2, 1};
    return true;
  }
  if (n == 8) {
    auto ctx = context::ParallelContext::create(
        world,
        context::ParallelConfig().tensor(8).tensor_mode(context::TensorMode::k2p5D).tensor_depth(2));
    *g = {ctx->comm(context::ParallelMode::k2p5DRow), ctx->comm(context::ParallelMode::k2p5DCol),
          ctx->comm(context::ParallelMode::k2p5DDep), ctx->comm(context::ParallelMode::k2p5DXZ), 2, 2};
    return true;
  }
  if (n == 1) {
    auto self = world->split(0, 0, "self");
    *g = {self, self, nullptr, self, 1, 1};
    return true;
  }
  return false;
}

// Block (r, c) of a 2-D tensor cut into rr x cc blocks.
at::Tensor block(const at::Tensor& t, int64_t r, int64_t c, int64_t rr, int64_t cc) {
  const int64_t h = t.size(0) / rr, w = t.size(1) / cc;
  return t.narrow(0, r * h, h).narrow(1, c * w, w).contiguous();
}

TEST(Summa, ThreeProductsEqualSerial) {
  Grid g;
  if (!make_grid(&g)) GTEST_SKIP() << "runs at 1, 4 and 8 ranks";
  const int64_t m = 6 * g.q, k = 4 * g.q, n = 10 * g.q;
  const at::Tensor a = test::device_randn({m, k}, 1), b = test::device_randn({k, n}, 2);
  const at::Tensor c = test::device_randn({m, n}, 3);  // plays dC in the backward products
  const int i = g.i(), j = g.j(), q = g.q;
  const at::Tensor ab = nn::raw::summa_ab(block(a, i, j, q, q), block(b, i, j, q, q), *g.row, *g.col);
  EXPECT_LE(test::rel_error(ab, block(at::mm(a, b), i, j, q, q)), kTolerance) << g.what();
  // dA = dC·Bᵀ in A's layout; dB = Aᵀ·dC in B's layout.
  const at::Tensor abt = nn::raw::summa_abt(block(c, i, j, q, q), block(b, i, j, q, q), *g.row, *g.col);
  EXPECT_LE(test::rel_error(abt, block(at::mm(c, b.t()), i, j, q, q)), kTolerance) << g.what();
  const at::Tensor atb = nn::raw::summa_atb(block(a, i, j, q, q), block(c, i, j, q, q), *g.row, *g.col);
  EXPECT_LE(test::rel_error(atb, block(at::mm(a.t(), c), i, j, q, q)), kTolerance) << g.what();
}

constexpr int64_t kBatch = 8, kSeq = 3, kIn = 12, kOut = 20;
constexpr int kSteps = 5;

// Rows of the batch on this rank: block i (2D) or block i + q·k (2.5D, the xz group's rank).
at::Tensor local_activation(const at::Tensor& full, const Grid& g) {
  const int64_t parts = g.batch->size(), rows = full.size(0) / parts;
  const int64_t cols = full.size(-1) / g.q;
  return full.narrow(0, g.batch->rank() * rows, rows).narrow(-1, g.j() * cols, cols).contiguous();
}

at::Tensor input(int step) { return test::device_randn({kBatch, kSeq, kIn}, 10 + step); }
at::Tensor probe(int step) { return test::device_randn({kBatch, kSeq, kOut}, 20 + step); }

TEST(Linear2D, OutputGradientsAndAdamWStepsEqualSerial) {
  Grid g;
  if (!make_grid(&g)) GTEST_SKIP() << "runs at 1, 4 and 8 ranks";
  torch::manual_seed(7);
  torch::nn::Linear serial(kIn, kOut);
  serial->to(test::device());
  nn::Linear2D layer(nn::Linear2DOptions(kIn, kOut), g.row, g.col, g.depth);
  layer->to(test::device());
  layer->load_full(serial->weight.detach(), serial->bias.detach());
  EXPECT_TRUE(at::equal(layer->full_weight(), serial->weight.detach())) << g.what();

  torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  const auto placements = layer->local_placements();
  for (int step = 0; step < kSteps; ++step) {
    const std::string at_step = g.what() + ", step " + std::to_string(step);
    serial_opt.zero_grad();
    opt.zero_grad();
    // Loss = Σ y·probe over the whole batch: every output element's gradient is known.
    at::Tensor x_full = input(step).requires_grad_();
    at::Tensor y_full = serial->forward(x_full);
    (y_full * probe(step)).sum().backward();

    at::Tensor x = local_activation(input(step), g).requires_grad_();
    at::Tensor y = layer->forward(x);
    EXPECT_LE(test::rel_error(y.detach(), local_activation(y_full.detach(), g)), kTolerance) << "output, " << at_step;
    (y * local_activation(probe(step), g)).sum().backward();
    EXPECT_LE(test::rel_error(x.grad(), local_activation(x_full.grad(), g)), kTolerance) << "input grad, " << at_step;

    nn::reduce_partial_gradients(placements);
    EXPECT_LE(test::rel_error(nn::full_value(placements[0].second, true), serial->weight.grad()), kTolerance)
        << "weight grad, " << at_step;
    EXPECT_LE(test::rel_error(nn::full_value(placements[1].second, true), serial->bias.grad()), kTolerance)
        << "bias grad, " << at_step;
    serial_opt.step();
    opt.step();
  }
  EXPECT_LE(test::rel_error(layer->full_weight(), serial->weight.detach()), kTolerance) << g.what();
  EXPECT_LE(test::rel_error(layer->full_bias(), serial->bias.detach()), kTolerance) << g.what();
}

TEST(LayerNorm2D, OutputGradientsAndAdamWStepsEqualSerial) {
  Grid g;
  if (!make_grid(&g)) GTEST_SKIP() << "runs at 1, 4 and 8 ranks";
  constexpr int64_t kHidden = 12;
  torch::nn::LayerNorm serial(torch::nn::LayerNormOptions({kHidden}));
  serial->to(test::device());
  nn::LayerNorm2D layer(nn::LayerNorm2DOptions(kHidden), g.row, g.col, g.depth);
  layer->to(test::device());
  const auto placements = layer->local_placements();
  {  // Weights other than ones and zeros, so that their gradients matter.
    at::NoGradGuard no_grad;
    serial->weight.copy_(1.0 + 0.3 * test::device_randn({kHidden}, 31));
    serial->bias.copy_(0.2 * test::device_randn({kHidden}, 32));
    nn::load_full(placements[0].second, serial->weight);
    nn::load_full(placements[1].second, serial->bias);
  }
  torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  for (int step = 0; step < kSteps; ++step) {
    const std::string at_step = g.what() + ", step " + std::to_string(step);
    serial_opt.zero_grad();
    opt.zero_grad();
    // An offset and scale per token so that the statistics are not trivial.
    const at::Tensor x_in = 3.0 * test::device_randn({kBatch, kSeq, kHidden}, 40 + step) + 1.5;
    const at::Tensor p = test::device_randn({kBatch, kSeq, kHidden}, 50 + step);
    at::Tensor x_full = x_in.clone().requires_grad_();
    at::Tensor y_full = serial->forward(x_full);
    (y_full * p).sum().backward();

    at::Tensor x = local_activation(x_in, g).requires_grad_();
    at::Tensor y = layer->forward(x);
    EXPECT_LE(test::rel_error(y.detach(), local_activation(y_full.detach(), g)), kTolerance) << "output, " << at_step;
    (y * local_activation(p, g)).sum().backward();
    EXPECT_LE(test::rel_error(x.grad(), local_activation(x_full.grad(), g)), kTolerance) << "input grad, " << at_step;
    nn::reduce_partial_gradients(placements);
    EXPECT_LE(test::rel_error(nn::full_value(placements[0].second, true), serial->weight.grad()), kTolerance)
        << "weight grad, " << at_step;
    EXPECT_LE(test::rel_error(nn::full_value(placements[1].second, true), serial->bias.grad()), kTolerance)
        << "bias grad, " << at_step;
    serial_opt.step();
    opt.step();
  }
  EXPECT_LE(test::rel_error(nn::full_value(placements[0].second), serial->weight.detach()), kTolerance) << g.what();
  EXPECT_LE(test::rel_error(nn::full_value(placements[1].second), serial->bias.detach()), kTolerance) << g.what();
  if (g.q > 1) {
    EXPECT_ERROR_CONTAINS(nn::LayerNorm2D(nn::LayerNorm2DOptions(13), g.row, g.col, g.depth),
                          "LayerNorm2D hidden (13) is not divisible");
  }
}

// V = 11 pads to 12 rows at q = 2: the padded row is never looked up.
TEST(VocabEmbedding2D, OutputGradientsAndAdamWStepsEqualSerial) {
  Grid g;
  if (!make_grid(&g)) GTEST_SKIP() << "runs at 1, 4 and 8 ranks";
  constexpr int64_t kVocab = 11, kHidden = 12;
  torch::manual_seed(3);
  torch::nn::Embedding serial(kVocab, kHidden);
  serial->to(test::device());
  nn::VocabEmbedding2D layer(nn::VocabEmbedding2DOptions(kVocab, kHidden), g.row, g.col, g.depth);
  layer->to(test::device());
  layer->load_full(serial->weight.detach());
  EXPECT_TRUE(at::equal(layer->full_weight(), serial->weight.detach())) << g.what();
  const auto placements = layer->local_placements();
  torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  for (int step = 0; step < kSteps; ++step) {
    const std::string at_step = g.what() + ", step " + std::to_string(step);
    serial_opt.zero_grad();
    opt.zero_grad();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(60 + step);
    const at::Tensor ids = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong).to(test::device());
    const at::Tensor p = test::device_randn({kBatch, kSeq, kHidden}, 70 + step);
    at::Tensor y_full = serial->forward(ids);
    (y_full * p).sum().backward();

    const int64_t rows = kBatch / g.batch->size();
    at::Tensor y = layer->forward(ids.narrow(0, g.batch->rank() * rows, rows).contiguous());
    EXPECT_LE(test::rel_error(y.detach(), local_activation(y_full.detach(), g)), kTolerance) << "output, " << at_step;
    (y * local_activation(p, g)).sum().backward();
    nn::reduce_partial_gradients(placements);
    EXPECT_LE(test::rel_error(nn::full_value(placements[0].second, true), serial->weight.grad()), kTolerance)
        << "weight grad, " << at_step;
    serial_opt.step();
    opt.step();
  }
  EXPECT_LE(test::rel_error(layer->full_weight(), serial->weight.detach()), kTolerance) << g.what();
}

// A bad id in one grid row's (or one depth layer's) batch block only: every rank throws.
TEST(VocabEmbedding2D, BadIdOnOneBlockIsRefusedEverywhere) {
  Grid g;
  if (!make_grid(&g) || g.q == 1) GTEST_SKIP() << "runs at 4 and 8 ranks";
  nn::VocabEmbedding2D layer(nn::VocabEmbedding2DOptions(11, 12), g.row, g.col, g.depth);
  layer->to(test::device());
  at::Tensor ids = at::zeros({2, 3}, test::device_options(at::kLong));
  if (g.batch->rank() == g.batch->size() - 1) ids[1][2] = 11;
  EXPECT_ERROR_CONTAINS(layer->forward(ids), "token id 11 is out of range", "[0, num_embeddings = 11)");
}

// The 2D layers in a chain, as a GPT's ends use them: embedding, layer norm,
// linear, and the tied head logits = h·Eᵀ (summa_matmul_nt) whose vocabulary
// blocks lie on the row group, so the 1D vocabulary-parallel cross entropy
// runs over it. Loss, every gradient and 3 AdamW steps against plain LibTorch.
TEST(Tensor2D, TiedHeadChainEqualsSerial) {
  Grid g;
  if (!make_grid(&g)) GTEST_SKIP() << "runs at 1, 4 and 8 ranks";
  constexpr int64_t kVocab = 11, kHidden = 12;
  torch::manual_seed(5);
  torch::nn::Embedding s_emb(kVocab, kHidden);
  s_emb->to(test::device());
  torch::nn::LayerNorm s_ln(torch::nn::LayerNormOptions({kHidden}));
  s_ln->to(test::device());
  torch::nn::Linear s_fc(kHidden, kHidden);
  s_fc->to(test::device());
  nn::VocabEmbedding2D emb(nn::VocabEmbedding2DOptions(kVocab, kHidden), g.row, g.col, g.depth);
  emb->to(test::device());
  nn::LayerNorm2D ln(nn::LayerNorm2DOptions(kHidden), g.row, g.col, g.depth);
  ln->to(test::device());
  nn::Linear2D fc(nn::Linear2DOptions(kHidden, kHidden), g.row, g.col, g.depth);
  fc->to(test::device());
  emb->load_full(s_emb->weight.detach());
  fc->load_full(s_fc->weight.detach(), s_fc->bias.detach());
  nn::NamedPlacements placements;
  for (const auto& [prefix, m] : std::vector<std::pair<std::string, nn::PlacedModule*>>{
           {"emb.", emb.get()}, {"ln.", ln.get()}, {"fc.", fc.get()}})
    for (auto& [name, p] : m->local_placements()) placements.emplace_back(prefix + name, p);
  std::vector<at::Tensor> serial_params, params;
  for (auto* m : std::vector<torch::nn::Module*>{s_emb.get(), s_ln.get(), s_fc.get()})
    for (const auto& p : m->parameters()) serial_params.push_back(p);
  for (const auto& [name, p] : placements) params.push_back(p.param);
  torch::optim::AdamW serial_opt(serial_params, torch::optim::AdamWOptions(0.02));
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(0.02));
  const int64_t parts = g.batch->size(), rows = kBatch / parts;
  for (int step = 0; step < 3; ++step) {
    const std::string at_step = g.what() + ", step " + std::to_string(step);
    serial_opt.zero_grad();
    opt.zero_grad();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(80 + step);
    const at::Tensor ids = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong).to(test::device());
    const at::Tensor targets = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong).to(test::device());
    at::Tensor h = s_fc->forward(s_ln->forward(s_emb->forward(ids)));
    at::Tensor serial_loss = torch::nn::functional::cross_entropy(
        at::matmul(h, s_emb->weight.t()).reshape({-1, kVocab}), targets.reshape({-1}));
    serial_loss.backward();

    const at::Tensor my_ids = ids.narrow(0, g.batch->rank() * rows, rows).contiguous();
    const at::Tensor my_targets = targets.narrow(0, g.batch->rank() * rows, rows).contiguous();
    at::Tensor x = fc->forward(ln->forward(emb->forward(my_ids)));
    at::Tensor logits = nn::summa_matmul_nt(x, emb->weight, g.row, g.col);
    at::Tensor loss = nn::vocab_parallel_cross_entropy(logits, my_targets, g.row,
                                                       nn::VocabParallelCrossEntropyOptions().vocab_size(kVocab));
    (loss / static_cast<double>(parts)).backward();
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble);
    g.batch->all_reduce(mean);
    EXPECT_NEAR(mean.item<double>() / parts, serial_loss.item<double>(), kTolerance * serial_loss.item<double>())
        << "loss, " << at_step;
    nn::reduce_partial_gradients(placements);
    for (size_t k = 0; k < placements.size(); ++k)
      EXPECT_LE(test::rel_error(nn::full_value(placements[k].second, true), serial_params[k].grad()), kTolerance)
          << placements[k].first << " grad, " << at_step;
    serial_opt.step();
    opt.step();
  }
  for (size_t k = 0; k < placements.size(); ++k)
    EXPECT_LE(test::rel_error(nn::full_value(placements[k].second), serial_params[k].detach()), kTolerance)
        << placements[k].first << ", " << g.what();
}

// One forward and backward of a linear layer moves, per rank, q broadcasts
// of the activation block A and of the weight block B (forward), q of B and
// q reduces of A (dA = dC·Bᵀ), q of A and q reduces of B (dB = Aᵀ·dC):
// row group 2q·|A| broadcast + q·|A| reduced, col group 2q·|B| + q·|B|
// (the traced size of each call, Note [Trace byte counts]). Of these a rank
// receives all but its own turn: 3(q-1)(|A| + |B|) in all.
TEST(Linear2D, TracedBytesEqualTheSummaFormula) {
  comm::WorldOptions options;
  options.trace = std::make_shared<comm::CommTrace>();
  Grid g;
  if (!make_grid(&g, comm::make_world_communicator(options)) || g.q == 1) GTEST_SKIP() << "runs at 4 and 8 ranks";
  nn::Linear2D layer(nn::Linear2DOptions(kIn, kOut), g.row, g.col, g.depth);
  layer->to(test::device());
  at::Tensor x = local_activation(input(0), g).requires_grad_();
  options.trace->reset();
  layer->forward(x).sum().backward();
  const int64_t q = g.q, a_bytes = x.numel() * 4, b_bytes = layer->weight.numel() * 4;
  const auto row_bcast = options.trace->get(g.row->name(), comm::OpType::kBroadcast);
  const auto row_reduce = options.trace->get(g.row->name(), comm::OpType::kReduce);
  const auto col_bcast = options.trace->get(g.col->name(), comm::OpType::kBroadcast);
  const auto col_reduce = options.trace->get(g.col->name(), comm::OpType::kReduce);
  EXPECT_EQ(row_bcast.calls, 2 * q);
  EXPECT_EQ(row_bcast.bytes, 2 * q * a_bytes);
  EXPECT_EQ(row_reduce.calls, q);
  EXPECT_EQ(row_reduce.bytes, q * a_bytes);
  EXPECT_EQ(col_bcast.calls, 2 * q);
  EXPECT_EQ(col_bcast.bytes, 2 * q * b_bytes);
  EXPECT_EQ(col_reduce.calls, q);
  EXPECT_EQ(col_reduce.bytes, q * b_bytes);
  EXPECT_EQ(options.trace->total().bytes, 3 * q * (a_bytes + b_bytes)) << options.trace->to_string();
}

TEST(Linear2D, BadShapesAreRefused) {
  Grid g;
  if (!make_grid(&g) || g.q == 1) GTEST_SKIP() << "runs at 4 and 8 ranks";
  EXPECT_ERROR_CONTAINS(nn::Linear2D(nn::Linear2DOptions(kIn, 21), g.row, g.col, g.depth),
                        "Linear2D out_features (21) is not divisible", "choose sizes divisible by q");
  nn::Linear2D layer(nn::Linear2DOptions(kIn, kOut), g.row, g.col, g.depth);
  layer->to(test::device());
  EXPECT_ERROR_CONTAINS(layer->forward(at::zeros({2, kIn}, test::device_options())), "Linear2D: input has 12 features",
                        "= 6 expected");
}

}  // namespace
}  // namespace tessera
