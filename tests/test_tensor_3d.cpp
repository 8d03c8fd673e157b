// 3D tensor parallelism (q x q x q cube) against plain LibTorch: the 3D
// product on its own (both roles: layout A -> B and B -> A), and the output,
// input gradient, parameter gradients and 5 AdamW steps of Linear3D and
// VocabEmbedding3D (with its tied head); the traced bytes of one linear
// against the paper's formula; bad shapes. 8 ranks run q = 2; one rank runs
// the same code on 1 x 1 x 1 groups.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/comm/factory.h"
#include "tessera/comm/tracing_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/nn/linear_3d.h"
#include "tessera/nn/matmul_3d.h"
#include "tessera/nn/placement.h"
#include "tessera/nn/vocab_embedding_3d.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

constexpr double kTolerance = 1e-5;
constexpr int64_t kBatch = 8, kSeq = 3, kIn = 12, kOut = 10;
constexpr int kSteps = 5;

// The cube's groups (Note [3D layouts] in nn/linear_3d.h).
struct Cube {
  comm::CommunicatorPtr input, weight, output, batch_a, batch_b;
  int q = 1;
  int i() const { return output->rank(); }
  int j() const { return input->rank(); }
  int k() const { return weight->rank(); }
};

bool make_cube(Cube* c, comm::CommunicatorPtr world = test::world()) {
  if (world->size() == 8) {
    auto ctx = context::ParallelContext::create(
        world, context::ParallelConfig().tensor(8).tensor_mode(context::TensorMode::k3D));
    using context::ParallelMode;
    *c = {ctx->comm(ParallelMode::k3DInput), ctx->comm(ParallelMode::k3DWeight), ctx->comm(ParallelMode::k3DOutput),
          ctx->comm(ParallelMode::k3DInputWeight), ctx->comm(ParallelMode::k3DOutputWeight), 2};
    return true;
  }
  if (world->size() == 1) {
    auto self = world->split(0, 0, "self");
    *c = {self, self, self, self, self, 1};
    return true;
  }
  return false;
}

// Layout A (column-role input): batch sub-block k·q + j, hidden block i;
// layout B (its output): batch sub-block k·q + i, feature block j.
at::Tensor layout(const at::Tensor& full, const Cube& c, bool a) {
  const int64_t q = c.q, rows = full.size(0) / (q * q), cols = full.size(-1) / q;
  const int64_t sub = a ? c.j() : c.i(), block = a ? c.i() : c.j();
  return full.narrow(0, (c.k() * q + sub) * rows, rows).narrow(-1, block * cols, cols).contiguous();
}

at::Tensor input(int64_t features, int step) { return test::device_randn({kBatch, kSeq, features}, 10 + step); }
at::Tensor probe(int64_t features, int step) { return test::device_randn({kBatch, kSeq, features}, 20 + step); }

// Both roles: a column-role layer reads layout A and writes B; a row-role
// layer (input and output groups swapped) reads B and writes A.
TEST(Linear3D, OutputGradientsAndAdamWStepsEqualSerialInBothRoles) {
  Cube c;
  if (!make_cube(&c)) GTEST_SKIP() << "runs at 1 and 8 ranks";
  for (bool column : {true, false}) {
    SCOPED_TRACE(column ? "column role" : "row role");
    torch::manual_seed(7);
    torch::nn::Linear serial(kIn, kOut);
    serial->to(test::device());
    nn::Linear3D layer(nn::Linear3DOptions(kIn, kOut), column ? c.input : c.output, c.weight,
                       column ? c.output : c.input);
    layer->to(test::device());
    layer->load_full(serial->weight.detach(), serial->bias.detach());
    EXPECT_TRUE(at::equal(layer->full_weight(), serial->weight.detach()));
    torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
    torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
    const auto placements = layer->local_placements();
    for (int step = 0; step < kSteps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      serial_opt.zero_grad();
      opt.zero_grad();
      at::Tensor x_full = input(kIn, step).requires_grad_();
      at::Tensor y_full = serial->forward(x_full);
      (y_full * probe(kOut, step)).sum().backward();

      at::Tensor x = layout(input(kIn, step), c, column).requires_grad_();
      at::Tensor y = layer->forward(x);
      EXPECT_LE(test::rel_error(y.detach(), layout(y_full.detach(), c, !column)), kTolerance) << "output";
      (y * layout(probe(kOut, step), c, !column)).sum().backward();
      EXPECT_LE(test::rel_error(x.grad(), layout(x_full.grad(), c, column)), kTolerance) << "input grad";
      nn::reduce_partial_gradients(placements);
      EXPECT_LE(test::rel_error(nn::full_value(placements[0].second, true), serial->weight.grad()), kTolerance)
          << "weight grad";
      EXPECT_LE(test::rel_error(nn::full_value(placements[1].second, true), serial->bias.grad()), kTolerance)
          << "bias grad";
      serial_opt.step();
      opt.step();
    }
    EXPECT_LE(test::rel_error(layer->full_weight(), serial->weight.detach()), kTolerance);
    EXPECT_LE(test::rel_error(nn::full_value(placements[1].second), serial->bias.detach()), kTolerance);
  }
}

// The embedding and its tied head: h = E[ids] (layout A) and logits = x·Eᵀ
// (layout B), the table's gradient from both uses, 5 AdamW steps.
TEST(VocabEmbedding3D, LookupTiedHeadAndAdamWStepsEqualSerial) {
  Cube c;
  if (!make_cube(&c)) GTEST_SKIP() << "runs at 1 and 8 ranks";
  constexpr int64_t kVocab = 11, kHidden = 8;  // vocabulary padded to 12 at q = 2
  torch::manual_seed(3);
  torch::nn::Embedding serial(kVocab, kHidden);
  serial->to(test::device());
  nn::VocabEmbedding3D layer(nn::VocabEmbedding3DOptions(kVocab, kHidden), c.input, c.weight, c.output);
  layer->to(test::device());
  layer->load_full(serial->weight.detach());
  EXPECT_TRUE(at::equal(layer->full_weight(), serial->weight.detach()));
  torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(0.05));
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(0.05));
  const auto placement = layer->local_placements().front().second;
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    serial_opt.zero_grad();
    opt.zero_grad();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + step);
    const at::Tensor ids = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong).to(test::device());
    const at::Tensor x_full = input(kHidden, step);
    const at::Tensor h_full = serial->forward(ids);
    const at::Tensor logits_full = at::matmul(x_full, serial->weight.t());
    ((h_full * probe(kHidden, step)).sum() + (logits_full * probe(kVocab, step)).sum()).backward();

    const at::Tensor h = layer->forward(ids);
    EXPECT_LE(test::rel_error(h.detach(), layout(h_full.detach(), c, true)), kTolerance) << "lookup";
    const at::Tensor logits = layer->logits(layout(x_full, c, true));
    // The padded vocabulary's columns: zero logits, and a zero probe so that
    // the padding rows never change.
    const int64_t pad = (c.q - kVocab % c.q) % c.q;
    EXPECT_LE(test::rel_error(logits.detach(), layout(at::constant_pad_nd(logits_full.detach(), {0, pad}), c, false)),
              kTolerance)
        << "tied head";
    const at::Tensor head_probe = layout(at::constant_pad_nd(probe(kVocab, step), {0, pad}), c, false);
    ((h * layout(probe(kHidden, step), c, true)).sum() + (logits * head_probe).sum()).backward();
    EXPECT_LE(test::rel_error(nn::full_value(placement, true), serial->weight.grad()), kTolerance) << "table grad";
    serial_opt.step();
    opt.step();
  }
  EXPECT_LE(test::rel_error(layer->full_weight(), serial->weight.detach()), kTolerance);
}

// One forward and backward of a linear layer, per rank: all-gather and
// reduce-scatter of q·|x| over the input group, of q·|y| over the output
// group, of in·out/q² over the weight group (traced sizes, Note [Trace byte
// counts]). On the wire (q-1)/q of each: 2(q-1)/q³·(B·in + B·out + in·out)
// elements for a global batch of B rows.
TEST(Linear3D, TracedBytesEqualThePaperFormula) {
  comm::WorldOptions options;
  options.trace = std::make_shared<comm::CommTrace>();
  Cube c;
  if (!make_cube(&c, comm::make_world_communicator(options)) || c.q == 1) GTEST_SKIP() << "runs at 8 ranks";
  nn::Linear3D layer(nn::Linear3DOptions(kIn, kOut), c.input, c.weight, c.output);
  layer->to(test::device());
  const at::Tensor x = layout(input(kIn, 0), c, true).requires_grad_();
  options.trace->reset();
  layer->forward(x).sum().backward();
  const int64_t q = c.q, rows = kBatch * kSeq, local_rows = rows / (q * q);
  auto expect = [&](const comm::CommunicatorPtr& g, comm::OpType op, int64_t elements) {
    const auto got = options.trace->get(g->name(), op);
    EXPECT_EQ(got.calls, 1) << g->name() << " " << comm::op_type_name(op);
    EXPECT_EQ(got.bytes, 4 * elements) << g->name() << " " << comm::op_type_name(op);
  };
  expect(c.input, comm::OpType::kAllGather, q * local_rows * kIn / q);
  expect(c.input, comm::OpType::kReduceScatter, q * local_rows * kIn / q);
  expect(c.output, comm::OpType::kReduceScatter, q * local_rows * kOut / q);
  expect(c.output, comm::OpType::kAllGather, q * local_rows * kOut / q);
  expect(c.weight, comm::OpType::kAllGather, kIn * kOut / (q * q));
  expect(c.weight, comm::OpType::kReduceScatter, kIn * kOut / (q * q));
  const int64_t wire = 2 * (q - 1) * (rows * kIn + rows * kOut + kIn * kOut) / (q * q * q);
  EXPECT_EQ(options.trace->total().bus_bytes, 4 * wire) << options.trace->to_string();
}

TEST(Linear3D, BadShapesAreRefused) {
  Cube c;
  if (!make_cube(&c) || c.q == 1) GTEST_SKIP() << "runs at 8 ranks";
  EXPECT_ERROR_CONTAINS(nn::Linear3D(nn::Linear3DOptions(6, 8), c.input, c.weight, c.output),
                        "Linear3D in_features (6) is not divisible", "divide by q²");
  EXPECT_ERROR_CONTAINS(nn::Linear3D(nn::Linear3DOptions(8, 5), c.input, c.weight, c.output),
                        "Linear3D out_features (5) is not divisible");
  nn::VocabEmbedding3D emb(nn::VocabEmbedding3DOptions(11, 8), c.input, c.weight, c.output);
  emb->to(test::device());
  EXPECT_ERROR_CONTAINS(emb->forward(at::zeros({6, kSeq}, test::device_options(at::kLong))),
                        "batch size 6 is not divisible by q*q = 4");
  at::Tensor ids = at::zeros({kBatch, kSeq}, test::device_options(at::kLong));
  ids[kBatch - 1][0] = 11;
  EXPECT_ERROR_CONTAINS(emb->forward(ids), "token id 11 is out of range");
}

}  // namespace
}  // namespace tessera
