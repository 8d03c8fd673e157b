// Sequence parallelism against serial computation written here in plain
// LibTorch (attention) or in tests/reference_gpt.h (the GPT): each mode
// (ulysses, ring, rsa) and split (contiguous, zigzag) at 2, 3 and 4 ranks,
// hybrid (Ulysses 2 x ring 2) at 4 and with tensor parallelism at 8,
// with 1D tensor parallelism and data parallelism; the traced bytes of each
// attention against its formula; the largest allocation of ring attention;
// and the refusals.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "counting_allocator.h"
#include "gpt_weights.h"
#include "reference_gpt.h"

#include "tessera/comm/tracing_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/sequence_attention.h"
#include "tessera/nn/shard.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/whole_norms.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <map>
#include <tuple>

namespace tessera {
namespace {

constexpr double kRelTolerance = 1e-5;  // fp32, relative to the norm of the serial tensor
using context::ParallelConfig;
using context::SequenceMode;
using context::SequenceSplit;
using test::rel_error;

struct ModeCase {
  SequenceMode mode;
  SequenceSplit split;
};

std::string case_name(const ::testing::TestParamInfo<ModeCase>& info) {
  return context::sequence_mode_name(info.param.mode) + "_" + context::sequence_split_name(info.param.split);
}

const std::vector<ModeCase> kCases = {
    {SequenceMode::kUlysses, SequenceSplit::kContiguous}, {SequenceMode::kUlysses, SequenceSplit::kZigzag},
    {SequenceMode::kRing, SequenceSplit::kContiguous},    {SequenceMode::kRing, SequenceSplit::kZigzag},
    {SequenceMode::kRsa, SequenceSplit::kContiguous},     {SequenceMode::kRsa, SequenceSplit::kZigzag},
    {SequenceMode::kHybrid, SequenceSplit::kContiguous},  {SequenceMode::kHybrid, SequenceSplit::kZigzag}};

// Hybrid runs Ulysses over 2 adjacent ranks and the ring across the pairs:
// the attention tests run it at 4 ranks (2 x 2).
constexpr int kHybridUlysses = 2;
bool attention_runs_at(const ModeCase& c, int p) { return c.mode != SequenceMode::kHybrid || p == 4; }

nn::SequenceLayout layout_of(const ModeCase& c, const comm::CommunicatorPtr& group) {
  return nn::SequenceLayout(group->size(), group->rank(), c.split,
                            c.mode == SequenceMode::kHybrid ? kHybridUlysses : 1);
}

// Causal softmax(q·kᵀ/√d)·v over whole sequences [b, h, S, d].
at::Tensor serial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t s = q.size(2);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor future = at::ones({s, s}, test::device_options(at::kBool)).triu(1);
  return at::matmul(at::softmax(scores.masked_fill(future, -std::numeric_limits<double>::infinity()), -1), v);
}

nn::ParallelDropout no_dropout() { return nn::ParallelDropout(nn::ParallelDropoutOptions(0.0, 1)); }

// The attention of mode c over `group`; hybrid's Ulysses and ring groups
// come from a context over the group (kept in `ctx`).
struct MadeAttention {
  torch::nn::AnyModule module;
  context::ParallelContextPtr ctx;
};
MadeAttention make_attention(const ModeCase& c, int64_t head_dim, const comm::CommunicatorPtr& group) {
  const nn::SequenceLayout layout = layout_of(c, group);
  torch::nn::AnyModule none(torch::nn::Identity{});
  switch (c.mode) {
    case SequenceMode::kUlysses:
      return {torch::nn::AnyModule(nn::UlyssesAttention(head_dim, none, group, layout)), nullptr};
    case SequenceMode::kRing:
      return {torch::nn::AnyModule(nn::RingAttention(head_dim, no_dropout(), group, layout)), nullptr};
    case SequenceMode::kRsa:
      return {torch::nn::AnyModule(nn::RingSelfAttention(head_dim, none, group, layout)), nullptr};
    case SequenceMode::kHybrid: {
      auto ctx = context::ParallelContext::create(group, ParallelConfig()
                                                             .sequence(group->size())
                                                             .sequence_mode(SequenceMode::kHybrid)
                                                             .sequence_ulysses(kHybridUlysses)
                                                             .sequence_split(c.split));
      return {torch::nn::AnyModule(nn::HybridAttention(head_dim, no_dropout(),
                                                       ctx->comm(context::ParallelMode::kSequenceUlysses),
                                                       ctx->comm(context::ParallelMode::kSequenceRing), layout)),
              ctx};
    }
  }
  return {};
}

struct AttentionShape {
  int64_t b, h, s, d;
};

// The serial attention of seeded q, k, v and its gradients for dout.
struct SerialAttention {
  at::Tensor q, k, v, dout, out;
};

using SerialAttentionCache = std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, at::ScalarType>, SerialAttention>;

// Emptied after the suite (SequenceAttention::TearDownTestSuite), not at
// exit: device tensors must go before the device does.
SerialAttentionCache& serial_attention_cache() {
  static SerialAttentionCache cache;
  return cache;
}

// Computed once per shape and dtype: every mode of a run compares against
// the same serial attention, the test's costliest part at 528 tokens.
const SerialAttention& serial_attention_of(const AttentionShape& shape, at::ScalarType dtype) {
  const auto [b, h, s, d] = shape;
  auto [it, inserted] = serial_attention_cache().try_emplace({b, h, s, d, dtype});
  if (inserted) {
    SerialAttention& r = it->second;
    r.q = test::device_randn({b, h, s, d}, 1, dtype).requires_grad_();
    r.k = test::device_randn({b, h, s, d}, 2, dtype).requires_grad_();
    r.v = test::device_randn({b, h, s, d}, 3, dtype).requires_grad_();
    r.dout = test::device_randn({b, h, s, d}, 4, dtype);
    r.out = serial_attention(r.q, r.k, r.v);
    r.out.backward(r.dout);
    r.out = r.out.detach();
  }
  return it->second;
}

// Output and the gradients of q, k and v of this rank's tokens equal the
// serial attention's rows at its positions, in each of `dtypes`.
void expect_attention_equals_serial(const ModeCase& mode, const AttentionShape& shape,
                                    std::initializer_list<at::ScalarType> dtypes) {
  auto group = test::world();
  const int64_t s = shape.s, d = shape.d;
  for (auto dtype : dtypes) {
    SCOPED_TRACE(c10::toString(dtype));
    const double tol = dtype == at::kFloat ? kRelTolerance : 1e-12;
    const SerialAttention& serial = serial_attention_of(shape, dtype);
    const at::Tensor &q = serial.q, &k = serial.k, &v = serial.v, &dout = serial.dout, &out = serial.out;

    const at::Tensor pos = layout_of(mode, group).positions(s).to(test::device());
    auto local = [&](const at::Tensor& t) { return t.detach().index_select(2, pos).requires_grad_(); };
    at::Tensor lq = local(q), lk = local(k), lv = local(v);
    auto attention = make_attention(mode, d, group).module;
    attention.ptr()->to(test::device());
    const at::Tensor lout = attention.forward(lq, lk, lv, pos);
    lout.backward(dout.index_select(2, pos));
    EXPECT_LE(rel_error(lout.detach(), out.index_select(2, pos)), tol);
    EXPECT_LE(rel_error(lq.grad(), q.grad().index_select(2, pos)), tol);
    EXPECT_LE(rel_error(lk.grad(), k.grad().index_select(2, pos)), tol);
    EXPECT_LE(rel_error(lv.grad(), v.grad().index_select(2, pos)), tol);
  }
}

class SequenceAttention : public ::testing::TestWithParam<ModeCase> {
 protected:
  static void TearDownTestSuite() { serial_attention_cache().clear(); }
};

TEST_P(SequenceAttention, EqualsSerialAttention) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "runs at 1 to 4 ranks";
  if (!attention_runs_at(GetParam(), p)) GTEST_SKIP() << "hybrid (Ulysses 2 x ring 2) runs at 4 ranks";
  // 12 heads and 24 tokens divide for P = 1..4 in both splits.
  expect_attention_equals_serial(GetParam(), {2, 12, 24, 4}, {at::kFloat, at::kDouble});
}

// Note [Ring attention tiles]: with 72 heads (36 per ring under hybrid) a
// tile is 64 (128) tokens, so 528 tokens cut every rank's chunks into tiles
// of unequal length, on and off the diagonal: one rank's whole sequence,
// and 4 ranks' chunks of 66 (hybrid's 132). Ulysses' local attention runs
// the same tiles on LibTorch 1.13 (Note [Fused attention]), over the
// gathered sequence's runs of positions. Tiles are cut the same way in
// every dtype, so fp64 alone (at 1e-12) checks them; fp32 is checked above.
TEST_P(SequenceAttention, TilesEqualSerialAttention) {
  const int p = test::world()->size();
  if (GetParam().mode == SequenceMode::kRsa) GTEST_SKIP() << "rsa holds score rows, not tiles";
  if (p != 1 && p != 4) GTEST_SKIP() << "runs at 1 and 4 ranks (about 3 s each)";
  if (!attention_runs_at(GetParam(), p)) GTEST_SKIP() << "hybrid (Ulysses 2 x ring 2) runs at 4 ranks";
  expect_attention_equals_serial(GetParam(), {1, 72, 528, 4}, {at::kDouble});
}

INSTANTIATE_TEST_SUITE_P(Modes, SequenceAttention, ::testing::ValuesIn(kCases), case_name);

// Full logits [b, S, vocab] from every rank's [b, S/P, V_p/tp] block.
at::Tensor full_logits(const at::Tensor& local, const context::ParallelContextPtr& ctx,
                       const nn::LayerFactory& factory, int64_t vocab) {
  const at::Tensor vocab_full = nn::unshard(local, -1, *ctx->comm(context::ParallelMode::kTensor));
  return factory.gather_activation(vocab_full).narrow(-1, 0, vocab);
}

void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

// c_attn's bias without its key rows (see test_gpt_grid.cpp): softmax
// ignores the key bias, so its gradient is rounding noise that AdamW amplifies.
at::Tensor without_key_bias(const at::Tensor& bias, const models::GPTConfig& c) {
  const int64_t d = c.hidden() / c.heads();
  const at::Tensor query_and_value = at::tensor({0, 2}, at::kLong).to(test::device());
  return bias.view({c.heads(), 3, d}).index_select(1, query_and_value).reshape({-1});
}

void expect_weights_equal(const std::map<std::string, at::Tensor>& serial, models::GPTImpl& gpt,
                          const models::GPTConfig& c, double tolerance) {
  for (const auto& [name, value] : gpt.full_state()) {
    const bool c_attn_bias = name.find("c_attn.bias") != std::string::npos;
    EXPECT_LE(rel_error(c_attn_bias ? without_key_bias(value, c) : value,
                        c_attn_bias ? without_key_bias(serial.at(name), c) : serial.at(name)),
              tolerance)
        << name;
  }
}

// The sequence layouts a world size runs: the whole world as the sequence
// group, and sp2 x tp2 at 4 ranks.
std::vector<ParallelConfig> gpt_configs(int world, const ModeCase& m) {
  std::vector<ParallelConfig> configs;
  auto base = [&](int sp, int tp) {
    return ParallelConfig().sequence(sp).tensor(tp).sequence_mode(m.mode).sequence_split(m.split);
  };
  if (m.mode == SequenceMode::kHybrid) {
    // Ulysses 2 x ring 2, alone at 4 ranks and beside tp 2 at 8.
    if (world == 4) configs.push_back(base(4, 1).sequence_ulysses(kHybridUlysses));
    if (world == 8) configs.push_back(base(4, 2).sequence_ulysses(kHybridUlysses));
    return configs;
  }
  // The tiny GPT's 4 heads: Ulysses needs them to divide over the sequence ranks.
  if (world >= 2 && world <= 4 && (m.mode != SequenceMode::kUlysses || 4 % world == 0)) configs.push_back(base(world, 1));
  if (world == 4) configs.push_back(base(2, 2));
  return configs;
}

class SequenceGPT : public ::testing::TestWithParam<ModeCase> {};

// Logits, loss (with ignored targets), every gradient, and 5 AdamW steps,
// with and without activation checkpointing.
TEST_P(SequenceGPT, MatchesSerialIncludingFiveAdamWSteps) {
  auto world = test::world();
  const auto configs = gpt_configs(world->size(), GetParam());
  if (configs.empty()) GTEST_SKIP() << "no sequence layout of this mode at " << world->size() << " ranks";
  constexpr int64_t kBatch = 2, kSeq = 24;
  for (const ParallelConfig& config : configs) {
    for (const std::string variant : {"fp32", "checkpointed", "fp64"}) {
      SCOPED_TRACE(context::to_string(config) + " " + variant);
      models::GPTConfig c = models::GPTConfig::preset("tiny");
      c.checkpoint_activations(variant == "checkpointed");
      const bool fp64 = variant == "fp64";
      const double tol = fp64 ? 1e-12 : kRelTolerance;
      const auto full = test::gpt_initial_weights(c, 7);
      auto ctx = context::ParallelContext::create(world, config);
      test::ReferenceGPT serial(test::reference_config(c));
      serial->to(test::device());
      serial->load_full_state(full);
      models::GPT gpt(c, nn::make_layer_factory(ctx));
      gpt->to(test::device());
      EXPECT_EQ(gpt->factory()->mode(), "1d+" + context::sequence_mode_name(config.sequence_mode()));
      gpt->load_full_state(full);
      if (fp64) {
        serial->to(at::kDouble);
        gpt->to(at::kDouble);
      }
      // eps 1e-4 (Note [AdamW eps in equality tests] in tests/support/test_util.h).
      torch::optim::AdamW serial_opt(serial->parameters(), torch::optim::AdamWOptions(1e-2).eps(1e-4));
      torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-2).eps(1e-4));
      for (int step = 0; step <= 5; ++step) {
        zero_grads(*serial);
        zero_grads(*gpt);
        const at::Tensor ids = test::seeded_token_ids(10 + step, c.vocab(), kBatch, kSeq).to(test::device());
        at::Tensor targets = test::seeded_token_ids(20 + step, c.vocab(), kBatch, kSeq).to(test::device());
        targets[0][kSeq - 1] = -100;  // ignored targets: the mean counts the others only
        targets[1][2] = -100;
        const at::Tensor serial_logits = serial->forward(ids);
        const at::Tensor serial_loss = serial->loss(serial_logits, targets);
        serial_loss.backward();
        const at::Tensor logits = gpt->forward(ids);
        const at::Tensor loss = gpt->loss(logits, targets);
        loss.backward();
        gpt->reduce_partial_gradients();
        EXPECT_LE(rel_error(loss.detach(), serial_loss.detach()), tol) << "loss at step " << step;
        if (step == 0) {
          EXPECT_LE(rel_error(full_logits(logits.detach(), ctx, *gpt->factory(), c.vocab()), serial_logits.detach()),
                    tol);
          const auto serial_grads = serial->full_state(true);
          for (const auto& [name, grad] : gpt->full_state(true))
            EXPECT_LE(rel_error(grad, serial_grads.at(name)), tol) << "gradient of " << name;
        }
        if (step < 5) {
          serial_opt.step();
          opt.step();
        }
      }
      expect_weights_equal(serial->full_state(), *gpt, c, tol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, SequenceGPT, ::testing::ValuesIn(kCases), case_name);

// One forward and backward of each attention moves, per rank, with E =
// b·h·n·d elements of one q, k or v block (4 bytes each) over P ranks
// (docs/sequence-parallel.md):
//   ring     send 2E per shift: P-1 shifts forward, P-1 (keys and values)
//            and P (their gradients) backward: (3P-2)·2E
//   rsa      send E per shift: keys and values forward (2(P-1)), keys and
//            values again and their gradients backward (2(P-1) + 2P): (6P-4)·E
//   ulysses  all_to_all of 3E (q, k, v) and E (output), and the same
//            backward: 8E, of which (P-1)/P leaves the rank
//   hybrid   ulysses' 8E over the U-rank group and ring's (3R-2)·2E over
//            the R = P/U ring: its block of U·n tokens on h/U heads is E
TEST(SequenceAttentionTrace, BytesEqualTheFormula) {
  comm::WorldOptions options;
  options.trace = std::make_shared<comm::CommTrace>();
  auto group = comm::make_world_communicator(options);
  const int p = group->size();
  if (p == 1 || p > 4) GTEST_SKIP() << "runs at 2 to 4 ranks";
  const int64_t b = 2, h = 12, s = 24, d = 4, e = b * h * (s / p) * d;
  for (const ModeCase& m : kCases) {
    if (!attention_runs_at(m, p)) continue;  // hybrid at 4 ranks; counted below
    SCOPED_TRACE(context::sequence_mode_name(m.mode) + " " + context::sequence_split_name(m.split));
    const at::Tensor pos = layout_of(m, group).positions(s).to(test::device());
    auto local = [&](uint64_t seed) {
      return test::device_randn({b, h, s, d}, seed).index_select(2, pos).requires_grad_();
    };
    at::Tensor q = local(1), k = local(2), v = local(3);
    MadeAttention made = make_attention(m, d, group);
    made.module.ptr()->to(test::device());
    options.trace->reset();
    made.module.forward(q, k, v, pos).backward(test::device_randn({b, h, s, d}, 4).index_select(2, pos));
    if (m.mode == SequenceMode::kHybrid) {
      const int u = kHybridUlysses, r = p / u;
      const std::string ulysses = made.ctx->comm(context::ParallelMode::kSequenceUlysses)->name();
      const std::string ring = made.ctx->comm(context::ParallelMode::kSequenceRing)->name();
      const auto a2a = options.trace->get(ulysses, comm::OpType::kAllToAll);
      const auto send = options.trace->get(ring, comm::OpType::kSend);
      EXPECT_EQ(a2a.calls, 4);
      EXPECT_EQ(a2a.bytes, 8 * e * 4);
      EXPECT_DOUBLE_EQ(a2a.bus_bytes, 8.0 * e * 4 * (u - 1) / u);
      EXPECT_EQ(send.calls, 3 * r - 2);
      EXPECT_EQ(send.bytes, (3 * r - 2) * 2 * e * 4);
      EXPECT_EQ(options.trace->get(ring, comm::OpType::kRecv).calls, send.calls);
      EXPECT_EQ(options.trace->total(ulysses).calls + options.trace->total(ring).calls, a2a.calls + 2 * send.calls)
          << options.trace->to_string();
      EXPECT_EQ(options.trace->total(group->name()).calls, 0) << "hybrid talks on its sub-groups only";
      continue;
    }
    const std::string name = group->name();
    const auto send = options.trace->get(name, comm::OpType::kSend);
    const auto recv = options.trace->get(name, comm::OpType::kRecv);
    const auto a2a = options.trace->get(name, comm::OpType::kAllToAll);
    switch (m.mode) {
      case SequenceMode::kRing:
        EXPECT_EQ(send.calls, 3 * p - 2);
        EXPECT_EQ(send.bytes, (3 * p - 2) * 2 * e * 4);
        EXPECT_EQ(a2a.calls, 0);
        break;
      case SequenceMode::kRsa:
        EXPECT_EQ(send.calls, 6 * p - 4);
        EXPECT_EQ(send.bytes, (6 * p - 4) * e * 4);
        EXPECT_EQ(a2a.calls, 0);
        break;
      case SequenceMode::kUlysses:
        EXPECT_EQ(send.calls, 0);
        EXPECT_EQ(a2a.calls, 4);
        EXPECT_EQ(a2a.bytes, 8 * e * 4);
        EXPECT_DOUBLE_EQ(a2a.bus_bytes, 8.0 * e * 4 * (p - 1) / p);
        break;
      case SequenceMode::kHybrid:
        break;
    }
    EXPECT_EQ(recv.calls, send.calls);
    EXPECT_EQ(options.trace->total(name).calls, send.calls + recv.calls + a2a.calls) << options.trace->to_string();
  }
}

// Ring attention never forms an S x S (or n x S) score matrix: its largest
// allocation is a key/value block pair or one n x n score block, and its
// peak memory for one forward and backward is at most 1/P of the serial
// attention's plus one block. Measured with the counting allocator.
TEST(SequenceAttentionMemory, RingHoldsBlocksOnly) {
  if (test::device().is_cuda()) GTEST_SKIP() << "counts CPU allocations";
  auto group = test::world();
  const int p = group->size();
  if (p == 1 || p > 4) GTEST_SKIP() << "runs at 2 to 4 ranks";
  const int64_t b = 1, h = 2, s = 960, d = 16, n = s / p;  // 960 divides by 2P for P = 2, 3, 4
  auto& counter = test::CountingAllocator::instance();
  auto measure = [&](const std::function<void()>& fn) {
    test::CountingScope scope;
    counter.reset_peak();
    const int64_t before = counter.live();
    fn();
    return std::make_pair(counter.peak() - before, counter.largest());
  };
  const at::Tensor q = test::device_randn({b, h, s, d}, 1), k = test::device_randn({b, h, s, d}, 2);
  const at::Tensor v = test::device_randn({b, h, s, d}, 3), dout = test::device_randn({b, h, s, d}, 4);
  const auto serial = measure([&] {
    at::Tensor sq = q.clone().requires_grad_(), sk = k.clone().requires_grad_(), sv = v.clone().requires_grad_();
    serial_attention(sq, sk, sv).backward(dout);
  });
  for (SequenceSplit split : {SequenceSplit::kContiguous, SequenceSplit::kZigzag}) {
    SCOPED_TRACE(context::sequence_split_name(split));
    nn::SequenceLayout layout(p, group->rank(), split);
    const at::Tensor pos = layout.positions(s).to(test::device());
    const auto ring = measure([&] {
      at::Tensor lq = q.index_select(2, pos).requires_grad_(), lk = k.index_select(2, pos).requires_grad_();
      at::Tensor lv = v.index_select(2, pos).requires_grad_();
      nn::RingAttention attention(d, no_dropout(), group, layout);
      attention->to(test::device());
      attention->forward(lq, lk, lv, pos).backward(dout.index_select(2, pos));
    });
    const int64_t kv_block = 2 * b * h * n * d * 4;
    EXPECT_LE(ring.second, std::max(kv_block, b * h * n * n * 4)) << "largest allocation";
    EXPECT_LT(ring.second, b * h * n * s * 4) << "a row block of the S x S scores was allocated";
    EXPECT_LE(ring.first, serial.first / p + kv_block)
        << "peak " << ring.first << " bytes against the serial " << serial.first;
  }
}

// Ring attention's dropout (Note [Ring attention dropout]): it drops (the
// output differs from p = 0 and repeats under the same stream state), and
// its backward uses the forward's masks: the gradient of a global sum
// <out, w> matches central differences taken with the stream restored, for
// elements of q, k and v on every rank, in fp64.
TEST(SequenceAttention, RingDropoutBackwardUsesTheForwardMasks) {
  auto group = test::world();
  const int p = group->size();
  if (p > 4) GTEST_SKIP() << "runs at 1 to 4 ranks";
  const int64_t b = 1, h = 2, s = 24, d = 4;
  for (SequenceSplit split : {SequenceSplit::kContiguous, SequenceSplit::kZigzag}) {
    SCOPED_TRACE(context::sequence_split_name(split));
    nn::SequenceLayout layout(p, group->rank(), split);
    const at::Tensor pos = layout.positions(s).to(test::device());
    auto local = [&](uint64_t seed) {
      return test::device_randn({b, h, s, d}, seed, at::kDouble).index_select(2, pos).requires_grad_();
    };
    std::vector<at::Tensor> qkv = {local(1), local(2), local(3)};
    const at::Tensor w = test::device_randn({b, h, s, d}, 4, at::kDouble).index_select(2, pos);
    nn::ParallelDropout drop(nn::ParallelDropoutOptions(0.3, 11 + group->rank()));
    nn::RingAttention attention(d, drop, group, layout);
    attention->to(test::device());  // its dropout too
    const auto state = drop->rng_state();
    auto global_sum = [&](const at::Tensor& out) {
      at::Tensor total = (out * w).sum().detach().clone().reshape({1});
      group->all_reduce(total);
      return total.item<double>();
    };
    const at::Tensor out = attention->forward(qkv[0], qkv[1], qkv[2], pos);
    (out * w).sum().backward();
    drop->set_rng_state(state);
    EXPECT_TRUE(at::equal(attention->forward(qkv[0], qkv[1], qkv[2], pos), out.detach())) << "same stream, same masks";
    nn::RingAttention undropped(d, no_dropout(), group, layout);
    undropped->to(test::device());
    EXPECT_GT(rel_error(out.detach(), undropped->forward(qkv[0], qkv[1], qkv[2], pos).detach()), 1e-3);
    const double eps = 1e-6;
    for (int which = 0; which < 3; ++which) {
      for (int trial = 0; trial < 2 * p; ++trial) {
        const int owner = trial % p;
        const int64_t flat = (7 * trial + 3 * which) % qkv[which].numel();
        double analytic = group->rank() == owner ? qkv[which].grad().reshape({-1})[flat].item<double>() : 0.0;
        auto shifted = [&](double delta) {
          at::NoGradGuard no_grad;
          at::Tensor moved = qkv[which].detach().clone();
          if (group->rank() == owner) moved.reshape({-1})[flat] += delta;
          std::vector<at::Tensor> in = {qkv[0].detach(), qkv[1].detach(), qkv[2].detach()};
          in[which] = moved;
          drop->set_rng_state(state);
          return global_sum(attention->forward(in[0], in[1], in[2], pos));
        };
        const double numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
        if (group->rank() == owner) EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(1.0, std::abs(numeric)));
      }
    }
  }
}

// Bad input is refused on every rank with the value and the rule.
TEST(SequenceRefusals, EveryRankGetsTheMessage) {
  auto world = test::world();
  const int p = world->size();
  if (p < 2) GTEST_SKIP() << "needs a sequence group";
  const models::GPTConfig c = models::GPTConfig::preset("tiny");
  auto make = [&](ParallelConfig config) {
    auto ctx = context::ParallelContext::create(world, config.sequence(p));
    models::GPT gpt(c, nn::make_layer_factory(ctx));
    gpt->to(test::device());
    return gpt;
  };
  // A sequence that does not divide into the split's chunks.
  const at::Tensor odd = test::seeded_token_ids(1, c.vocab(), 2, 2 * p + 1).to(test::device());
  EXPECT_ERROR_CONTAINS(make(ParallelConfig().sequence_mode(SequenceMode::kRing))->forward(odd),
                        "does not divide into", "equal chunks");
  const at::Tensor p_only = test::seeded_token_ids(1, c.vocab(), 2, 3 * p).to(test::device());
  EXPECT_ERROR_CONTAINS(
      make(ParallelConfig().sequence_mode(SequenceMode::kRing).sequence_split(SequenceSplit::kZigzag))->forward(p_only),
      "zigzag split", "2 chunks per rank");
  // Ulysses needs whole heads per sequence rank (the tiny GPT has 4).
  if (4 % p != 0) {
    EXPECT_ERROR_CONTAINS(make(ParallelConfig().sequence_mode(SequenceMode::kUlysses))
                              ->forward(test::seeded_token_ids(1, c.vocab(), 2, 4 * p).to(test::device())),
                          "heads (per tensor rank) do not divide over");
  }
  // Sequence parallelism runs on 1D, without the 1D sequence-parallel variant.
  auto ctx = context::ParallelContext::create(world, ParallelConfig().sequence(p));
  EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, true), "both split the sequence");
  if (p == 8) {
    auto grid = context::ParallelContext::create(
        world, ParallelConfig().sequence(2).tensor(4).tensor_mode(context::TensorMode::k2D));
    EXPECT_ERROR_CONTAINS(nn::make_layer_factory(grid), "runs on tensor mode 1d");
  }
}

}  // namespace
}  // namespace tessera
