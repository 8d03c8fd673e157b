// models::GPT in 1D and its sequence-parallel variant against the serial
// reference GPT (tests/reference_gpt.h: plain LibTorch, nothing from tessera)
// loaded with the same full weights: logits, loss, every gathered gradient,
// five AdamW steps, and the communication of one forward + backward against
// the analytical count.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "gpt_weights.h"
#include "reference_gpt.h"

#include "tessera/comm/tracing_communicator.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/shard.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

constexpr double kRelTolerance = 1e-5;  // fp32, relative to the norm of the serial tensor
constexpr int64_t kBatch = 2, kSeq = 24;  // the tensor sizes tested (1, 2, 3, 4, 8) divide kSeq

using test::rel_error;

// At 3 ranks: 6 heads of width 8, so that a tensor group of 3 splits them
// (the vocabulary of 101 is padded to 102).
models::GPTConfig tiny() {
  auto c = models::GPTConfig::preset("tiny");
  if (test::world()->size() == 3) {
    c.heads(6);
    c.hidden(48);
  }
  return c;
}

std::shared_ptr<nn::LayerFactory> factory(const comm::CommunicatorPtr& group, bool sp) {
  return nn::make_1d_factory(group, sp, 1234, 5678);
}

// On test::device(), so that they compare with the models' full_state().
std::map<std::string, at::Tensor> initial_weights(const models::GPTConfig& c, uint64_t seed) {
  auto full = test::gpt_initial_weights(c, seed);
  for (auto& entry : full) entry.second = entry.second.to(test::device());
  return full;
}

at::Tensor seeded_ids(uint64_t seed, int64_t vocab) {
  return test::seeded_token_ids(seed, vocab, kBatch, kSeq).to(test::device());
}

// Full logits [b, s, vocab] from every rank's vocabulary shard.
at::Tensor full_logits(const at::Tensor& shard, const comm::Communicator& tp, int64_t vocab) {
  return nn::unshard(shard, -1, tp).narrow(-1, 0, vocab);
}

void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

class GPTParallel : public ::testing::TestWithParam<bool> {};

TEST_P(GPTParallel, MatchesSerialGPTIncludingFiveAdamWSteps) {
  auto tp = test::world();
  const bool sp = GetParam();
  if (tiny().heads() % tp->size() != 0)
    GTEST_SKIP() << "the tiny GPT's " << tiny().heads() << " heads do not split over " << tp->size();
  const auto full = initial_weights(tiny(), 0);
  test::ReferenceGPT serial(test::reference_config(tiny()));
  serial->to(test::device());
  serial->load_full_state(full);
  models::GPT parallel(tiny(), factory(tp, sp));
  parallel->to(test::device());
  parallel->load_full_state(full);
  for (const auto& entry : parallel->full_state()) {
    EXPECT_TRUE(at::equal(entry.second, full.at(entry.first))) << entry.first << " does not round-trip";
  }

  at::Tensor ids = seeded_ids(1, tiny().vocab()), targets = seeded_ids(2, tiny().vocab());
  at::Tensor serial_logits = serial->forward(ids);
  at::Tensor serial_loss = serial->loss(serial_logits, targets);
  serial_loss.backward();
  at::Tensor logits = parallel->forward(ids);
  at::Tensor loss = parallel->loss(logits, targets);
  loss.backward();
  parallel->reduce_partial_gradients();
  EXPECT_LE(rel_error(full_logits(logits.detach(), *tp, tiny().vocab()), serial_logits.detach()), kRelTolerance);
  EXPECT_LE(rel_error(loss.detach(), serial_loss.detach()), kRelTolerance);
  const auto serial_grads = serial->full_state(true);
  for (const auto& entry : parallel->full_state(true)) {
    EXPECT_LE(rel_error(entry.second, serial_grads.at(entry.first)), kRelTolerance) << "gradient of " << entry.first;
  }

  torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW parallel_opt(parallel->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 5; ++step) {
    serial_opt.step();
    parallel_opt.step();
    zero_grads(*serial);
    zero_grads(*parallel);
    at::Tensor batch = seeded_ids(10 + step, tiny().vocab()), next = seeded_ids(20 + step, tiny().vocab());
    at::Tensor a = serial->loss(serial->forward(batch), next);
    at::Tensor b = parallel->loss(parallel->forward(batch), next);
    a.backward();
    b.backward();
    parallel->reduce_partial_gradients();
    EXPECT_LE(rel_error(b.detach(), a.detach()), kRelTolerance) << "loss after step " << step + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GPTParallel, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "SequenceParallel" : "OneD");
                         });

TEST(GPTUntied, SeparateHeadMatchesSerial) {
  auto tp = test::world();
  if (tiny().heads() % tp->size() != 0)
    GTEST_SKIP() << "the tiny GPT's " << tiny().heads() << " heads do not split over " << tp->size();
  models::GPTConfig c = tiny();
  c.tied(false);
  const auto full = initial_weights(c, 1);
  ASSERT_TRUE(full.count("lm_head.weight"));
  test::ReferenceGPT serial(test::reference_config(c));
  serial->to(test::device());
  serial->load_full_state(full);
  models::GPT parallel(c, factory(tp, false));
  parallel->to(test::device());
  parallel->load_full_state(full);
  at::Tensor ids = seeded_ids(5, c.vocab()), targets = seeded_ids(6, c.vocab());
  at::Tensor a = serial->loss(serial->forward(ids), targets);
  at::Tensor b = parallel->loss(parallel->forward(ids), targets);
  a.backward();
  b.backward();
  EXPECT_LE(rel_error(b.detach(), a.detach()), kRelTolerance);
  EXPECT_LE(rel_error(parallel->full_state(true).at("lm_head.weight"), serial->full_state(true).at("lm_head.weight")),
            kRelTolerance);
}

// One forward + backward moves exactly what the 1D analysis says, per layer L:
//   1D:  all_reduce of [b, s, h]: forward 1 (embedding) + 2L (row layers),
//        backward 2L (column layers' copy_to_group) + 1 (LM head input);
//        plus the cross entropy's 2 all_reduces ([b·s] max, [2, b·s] sums).
//   SP:  all_gather and reduce_scatter of the full [b, s, h], 4L + 2 each
//        (forward: 2L + 1 of each; backward swaps them), plus the same 2.
TEST(GPTCommunication, MatchesTheAnalyticalCount) {
  auto world = test::world();
  const int64_t n = world->size();
  if (n == 1 || tiny().heads() % n != 0) GTEST_SKIP() << "needs a tensor group that splits the heads";
  const int64_t L = tiny().layers(), act = kBatch * kSeq * tiny().hidden() * 4, tokens = kBatch * kSeq;
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "1d");
    auto trace = std::make_shared<comm::CommTrace>();
    auto tp = std::make_shared<comm::TracingCommunicator>(world, trace);
    torch::manual_seed(0);
    models::GPT gpt(tiny(), factory(tp, sp));
    gpt->to(test::device());
    trace->reset();  // construction shards weights without communication; count the step only
    at::Tensor ids = seeded_ids(3, tiny().vocab());
    gpt->loss(gpt->forward(ids), seeded_ids(4, tiny().vocab())).backward();
    const auto ar = trace->get("world", comm::OpType::kAllReduce);
    const auto ag = trace->get("world", comm::OpType::kAllGather);
    const auto rs = trace->get("world", comm::OpType::kReduceScatter);
    const int64_t ce_bytes = tokens * 4 + 2 * tokens * 4;
    if (!sp) {
      EXPECT_EQ(ar.calls, 4 * L + 2 + 2);
      EXPECT_EQ(ar.bytes, (4 * L + 2) * act + ce_bytes);
      EXPECT_EQ(ag.calls + rs.calls, 0);
    } else {
      EXPECT_EQ(ag.calls, 4 * L + 2);
      EXPECT_EQ(ag.bytes, (4 * L + 2) * act);
      EXPECT_EQ(rs.calls, 4 * L + 2);
      EXPECT_EQ(rs.bytes, (4 * L + 2) * act);
      EXPECT_EQ(ar.calls, 2);
      EXPECT_EQ(ar.bytes, ce_bytes);
    }
    EXPECT_EQ(trace->total().calls, ar.calls + ag.calls + rs.calls) << trace->to_string();
  }
}

TEST(LayerFactory1D, ActivationLayoutsRoundTrip) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  at::Tensor full = at::arange(kBatch * 4 * n * 3, test::device_options()).reshape({kBatch, 4 * n, 3});
  for (bool sp : {false, true}) {
    auto f = factory(tp, sp);
    EXPECT_EQ(f->mode(), sp ? "1d-sp" : "1d");
    at::Tensor local = f->scatter_activation(full);
    EXPECT_TRUE(at::equal(local, sp ? full.chunk(n, 1)[r] : full));
    EXPECT_TRUE(at::equal(f->gather_activation(local), full));
    // positions() are CPU tensors (the model moves them to its ids' device).
    EXPECT_TRUE(
        at::equal(f->positions(4 * n), sp ? at::arange(4 * r, 4 * r + 4, at::kLong) : at::arange(4 * n, at::kLong)));
  }
}

TEST(GPTConfig, PresetsAndErrors) {
  EXPECT_EQ(models::GPTConfig::preset("small").hidden(), 768);
  EXPECT_EQ(models::GPTConfig::preset("medium").layers(), 24);
  EXPECT_ERROR_CONTAINS(models::GPTConfig::preset("huge"), "unknown model preset 'huge'");
  auto tp = test::world();
  if (tp->size() > 1) {
    models::GPTConfig c = tiny();
    c.heads(tp->size() + 1);
    c.hidden(4 * c.heads());
    EXPECT_ERROR_CONTAINS(models::GPT(c, factory(tp, false)), "number of attention heads");
  }
}

}  // namespace
}  // namespace tessera
