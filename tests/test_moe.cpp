// The mixture-of-experts layer against a serial MoE written here in plain
// LibTorch (one loop per expert over its assignments, capacity applied per
// rank's tokens): outputs, auxiliary losses, router and expert gradients and
// 5 AdamW steps at every expert size that divides the world, dropless and
// with capacity (by position and by probability), top-1 and top-2, the
// experts grouped and padded, fine-grained experts, shared experts with and
// without their gate; every token routed to one rank's experts; the rows
// the experts ran; traced all-to-all bytes for a known routing; and the
// refusals.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/comm/tracing_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/nn/moe.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace tessera {
namespace {

constexpr double kRelTolerance = 1e-5;
constexpr int64_t kHidden = 8, kFfn = 12, kTokens = 12;  // tokens per data rank
constexpr int kSteps = 5;

struct Case {
  std::string name;
  int64_t top_k;
  bool renormalize;
  c10::optional<double> capacity;
  nn::MoEDropPolicy policy;
  nn::MoEExpertCompute compute = nn::MoEExpertCompute::kGrouped;
  bool fine_grained = false;  // twice the experts, each a third as wide
  int64_t shared_ffn = 0;
  bool shared_gate = false;
};

constexpr auto kPosition = nn::MoEDropPolicy::kPosition;
constexpr auto kPadded = nn::MoEExpertCompute::kPadded;
const std::vector<Case> kCases = {
    {"top1_dropless", 1, false, c10::nullopt, kPosition},
    {"top2_dropless_renorm", 2, true, c10::nullopt, kPosition},
    {"top1_capacity_position", 1, false, 1.0, kPosition},
    {"top2_capacity_probability", 2, false, 0.75, nn::MoEDropPolicy::kProbability},
    {"top2_dropless_padded", 2, true, c10::nullopt, kPosition, kPadded},
    {"top1_capacity_padded", 1, false, 1.0, kPosition, kPadded},
    {"top1_shared", 1, false, c10::nullopt, kPosition, nn::MoEExpertCompute::kGrouped, false, 10},
    {"fine_grained_top4_shared_gated", 4, false, c10::nullopt, kPosition, nn::MoEExpertCompute::kGrouped, true, 8,
     true}};

int64_t experts_for(int n, const Case& c = kCases[0]) { return (n % 3 == 0 ? 6 : 8) * (c.fine_grained ? 2 : 1); }
int64_t ffn_for(const Case& c) { return c.fine_grained ? kFfn / 3 : kFfn; }

// Skewed: positive tokens and a router whose first two rows point along
// them, the rest against them: every token's first choice is expert 0 (on
// expert rank 0) and its second expert 1; the other experts receive nothing.
bool g_skewed = false;

using Weights = std::map<std::string, at::Tensor>;

Weights full_weights(int64_t experts, uint64_t seed, const Case& c = kCases[0]) {
  at::Tensor router = test::device_randn({experts, kHidden}, seed) * 0.5;
  if (g_skewed) {
    router = -at::ones({experts, kHidden}, test::device_options());
    router[0].fill_(2.0);
    router[1].fill_(1.0);
  }
  const int64_t f = ffn_for(c), sf = c.shared_ffn;
  Weights w = {{"router.weight", router},
               {"c_fc.weight", test::device_randn({experts, f, kHidden}, seed + 1) * 0.3},
               {"c_fc.bias", test::device_randn({experts, f}, seed + 2) * 0.1},
               {"c_proj.weight", test::device_randn({experts, kHidden, f}, seed + 3) * 0.3},
               {"c_proj.bias", test::device_randn({experts, kHidden}, seed + 4) * 0.1}};
  if (sf > 0) {
    w["shared_expert.c_fc.weight"] = test::device_randn({sf, kHidden}, seed + 5) * 0.3;
    w["shared_expert.c_fc.bias"] = test::device_randn({sf}, seed + 6) * 0.1;
    w["shared_expert.c_proj.weight"] = test::device_randn({kHidden, sf}, seed + 7) * 0.3;
    w["shared_expert.c_proj.bias"] = test::device_randn({kHidden}, seed + 8) * 0.1;
  }
  if (c.shared_gate) w["shared_expert_gate.weight"] = test::device_randn({1, kHidden}, seed + 9) * 0.5;
  return w;
}

at::Tensor tokens_of(int64_t d, int step) {
  const at::Tensor x = test::device_randn({2, kTokens / 2, kHidden}, 100 + 16 * d + step);
  return g_skewed ? x.abs() : x;
}
at::Tensor dout_of(int64_t d) { return test::device_randn({2, kTokens / 2, kHidden}, 900 + d); }

struct SerialResult {
  std::vector<at::Tensor> outputs;  // per data rank
  std::vector<at::Tensor> input_grads;  // per data rank: d loss / d tokens
  double aux = 0, z = 0;
  Weights grads;
};

// One step of the serial MoE over every data rank's tokens: each rank's
// tokens form a group (capacity counts a group); the auxiliary losses are
// over all tokens. Loss = mean over ranks of <out_d, dout_d> + coefficients ·
// (aux, z). Gradients land in `w` (requires_grad).
SerialResult serial_step(Weights& w, const Case& c, int64_t dp, int step, const nn::MoEOptions& o) {
  const int64_t experts = w["router.weight"].size(0);
  SerialResult res;
  std::vector<at::Tensor> inputs;
  at::Tensor loss = at::zeros({}, test::device_options(at::kFloat));
  at::Tensor routed = at::zeros({experts}, test::device_options(at::kDouble));
  at::Tensor prob_sum = at::zeros({experts}, test::device_options(at::kFloat));
  at::Tensor z_sum = at::zeros({}, test::device_options(at::kFloat));
  for (int64_t d = 0; d < dp; ++d) {
    const at::Tensor leaf = tokens_of(d, step).requires_grad_();
    inputs.push_back(leaf);
    const at::Tensor x = leaf.reshape({-1, kHidden});
    const at::Tensor logits = at::matmul(x, w["router.weight"].t());
    const at::Tensor probs = at::softmax(logits, -1);
    const auto top = probs.topk(c.top_k, -1);
    at::Tensor gates = std::get<0>(top);
    if (c.renormalize) gates = gates / gates.sum(-1, true);
    const at::Tensor idx = std::get<1>(top).cpu();  // read element by element
    at::Tensor out = at::zeros_like(x);
    for (int64_t e = 0; e < experts; ++e) {
      // Assignments to e in routing order: slot-major, then token.
      std::vector<std::pair<int64_t, int64_t>> list;  // (token, slot)
      for (int64_t j = 0; j < c.top_k; ++j)
        for (int64_t t = 0; t < x.size(0); ++t)
          if (idx[t][j].item<int64_t>() == e) list.emplace_back(t, j);
      routed[e] += static_cast<double>(list.size());
      if (c.capacity) {
        const auto cap = static_cast<size_t>(std::ceil(*c.capacity * c.top_k * x.size(0) / experts));
        if (c.policy == nn::MoEDropPolicy::kProbability)
          std::stable_sort(list.begin(), list.end(),
                           [&](const std::pair<int64_t, int64_t>& a, const std::pair<int64_t, int64_t>& b) {
                             return gates[a.first][a.second].item<float>() > gates[b.first][b.second].item<float>();
                           });
        if (list.size() > cap) list.resize(cap);
      }
      for (const auto& [t, j] : list) {
        const at::Tensor h = at::gelu(at::linear(x[t], w["c_fc.weight"][e], w["c_fc.bias"][e]));
        out = out.index_add(0, at::tensor({t}).to(test::device()),
                            (at::linear(h, w["c_proj.weight"][e], w["c_proj.bias"][e]) * gates[t][j]).unsqueeze(0));
      }
    }
    // Shared experts: every token, gated by sigmoid(g · x) when asked.
    if (c.shared_ffn > 0) {
      for (int64_t t = 0; t < x.size(0); ++t) {
        const at::Tensor h = at::gelu(at::linear(x[t], w["shared_expert.c_fc.weight"], w["shared_expert.c_fc.bias"]));
        at::Tensor s = at::linear(h, w["shared_expert.c_proj.weight"], w["shared_expert.c_proj.bias"]);
        if (c.shared_gate) s = s * at::sigmoid(at::dot(w["shared_expert_gate.weight"][0], x[t]));
        out = out.index_add(0, at::tensor({t}).to(test::device()), s.unsqueeze(0));
      }
    }
    res.outputs.push_back(out.detach().view({2, kTokens / 2, kHidden}));
    loss = loss + (out.view({2, kTokens / 2, kHidden}) * dout_of(d)).sum() / static_cast<double>(dp);
    prob_sum = prob_sum + probs.sum(0);
    const at::Tensor lse = at::logsumexp(logits, -1);
    z_sum = z_sum + (lse * lse).sum();
  }
  const double total = static_cast<double>(dp * kTokens);
  const at::Tensor f = (routed / (c.top_k * total)).to(at::kFloat);
  const at::Tensor aux = experts * (f * prob_sum / total).sum();
  const at::Tensor z = z_sum / total;
  res.aux = aux.item<double>();
  res.z = z.item<double>();
  (loss + o.aux_loss_coef() * aux + o.z_loss_coef() * z).backward();
  for (auto& [name, t] : w) res.grads[name] = t.grad().clone();
  for (const at::Tensor& leaf : inputs) res.input_grads.push_back(leaf.grad().clone());
  return res;
}

nn::MoEOptions options_for(const Case& c, int64_t experts) {
  return nn::MoEOptions(kHidden, ffn_for(c), experts)
      .top_k(c.top_k)
      .renormalize(c.renormalize)
      .capacity_factor(c.capacity)
      .drop_policy(c.policy)
      .expert_compute(c.compute)
      .shared_ffn(c.shared_ffn)
      .shared_gate(c.shared_gate)
      .aux_loss_coef(0.1)
      .z_loss_coef(0.01)
      .init_seed(7);
}

// Note [AdamW eps in equality tests] in tests/support/test_util.h.
torch::optim::AdamWOptions adamw_options() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.01).eps(1e-4); }

struct ParallelRun {
  context::ParallelContextPtr ctx;
  nn::MoE moe{nullptr};
  nn::NamedPlacements placements;
  std::shared_ptr<parallel::ShardedModule> sharded;
  std::unique_ptr<parallel::ShardedOptimizer> opt;
};

// `etp` > 1: the experts split over a tensor group of that size (expert
// tensor parallelism), whose ranks hold the same tokens.
ParallelRun make_parallel(int ep, const nn::MoEOptions& o, const Weights& init, const std::string& spec, int etp = 1) {
  ParallelRun r;
  r.ctx = context::ParallelContext::create(test::world(), context::ParallelConfig().expert(ep).tensor(etp));
  nn::MoEGroups groups;
  groups.expert = r.ctx->comm(context::ParallelMode::kExpert);
  groups.expert_data = r.ctx->comm(context::ParallelMode::kExpertData);
  groups.tokens = r.ctx->comm(context::ParallelMode::kData);
  if (etp > 1) groups.expert_tensor = r.ctx->comm(context::ParallelMode::kTensor);
  r.moe = nn::MoE(o, groups);
  r.moe->to(test::device());
  r.placements = nn::placements_of(*r.moe, [](const at::Tensor& p) { return nn::replicated_placement(p); });
  for (const auto& [name, p] : r.placements) nn::load_full(p, init.at(name));
  r.sharded = std::make_shared<parallel::ShardedModule>(
      r.moe.ptr(), r.ctx,
      parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::parse(spec)).placements(r.placements));
  auto inner = std::make_shared<torch::optim::AdamW>(r.moe->parameters(), adamw_options());
  r.opt = std::make_unique<parallel::ShardedOptimizer>(r.sharded, inner);
  return r;
}

void expect_equal_to_serial(int ep, const Case& c, const std::string& spec, int etp = 1) {
  const int n = test::world()->size(), dp = n / etp;
  const int64_t experts = experts_for(n, c);
  const std::string what = c.name + ", ep " + std::to_string(ep) + ", etp " + std::to_string(etp) + ", " + spec;
  const nn::MoEOptions o = options_for(c, experts);
  const Weights init = full_weights(experts, 31, c);

  Weights serial;
  for (const auto& [name, t] : init) serial[name] = t.clone().requires_grad_();
  std::vector<at::Tensor> params;
  for (auto& [name, t] : serial) params.push_back(t);
  torch::optim::AdamW serial_opt(params, adamw_options());

  ParallelRun run = make_parallel(ep, o, init, spec, etp);
  const int64_t d = run.ctx->rank(context::ParallelMode::kData);
  for (int step = 0; step < kSteps; ++step) {
    serial_opt.zero_grad();
    const SerialResult ref = serial_step(serial, c, dp, step, o);
    run.opt->zero_grad();
    const at::Tensor tokens = tokens_of(d, step).requires_grad_();
    const at::Tensor out = run.sharded->run([&] { return run.moe->forward(tokens); });
    (out * dout_of(d)).sum().backward();
    const std::string at_step = what + ", step " + std::to_string(step);
    EXPECT_LE(test::rel_error(out, ref.outputs[d]), kRelTolerance) << at_step << ": output";
    EXPECT_NEAR(run.moe->last_stats().aux_loss, ref.aux, kRelTolerance * ref.aux) << at_step << ": aux loss";
    EXPECT_NEAR(run.moe->last_stats().z_loss, ref.z, kRelTolerance * ref.z) << at_step << ": z loss";
    // This rank's loss is dp times its share of the serial one (the wrapper
    // averages parameter gradients over dp; Note [MoE auxiliary losses]),
    // so its tokens' gradient is dp times the serial one.
    ASSERT_TRUE(tokens.grad().defined()) << at_step;
    EXPECT_LE(test::rel_error(tokens.grad(), ref.input_grads[d] * static_cast<double>(dp)), kRelTolerance)
        << at_step << ": gradient of the tokens";
    if (g_skewed && step == 0) {
      const auto& routed = run.moe->last_stats().tokens_per_expert;
      EXPECT_EQ(routed[0], dp * kTokens) << at_step;
      EXPECT_EQ(std::accumulate(routed.begin() + 2, routed.end(), int64_t{0}), 0) << at_step;
    }
    if (spec == "ddp") {  // ddp leaves whole averaged gradients in .grad()
      run.sharded->finish_gradient_sync();
      for (const auto& [name, p] : run.placements) {
        const at::Tensor full = nn::full_value(p, /*gradients=*/true);
        EXPECT_LE(test::rel_error(full, ref.grads.at(name)), kRelTolerance) << at_step << ": gradient of " << name;
      }
    }
    serial_opt.step();
    run.opt->step();
  }
  const auto gathered = run.sharded->full_params();
  for (const auto& [name, p] : run.placements)
    EXPECT_LE(test::rel_error(nn::full_value(p), serial.at(name).detach()), kRelTolerance)
        << what << ": " << name << " after " << kSteps << " AdamW steps";
}

class MoELayer : public ::testing::TestWithParam<Case> {};

// ep 1 (every expert on every rank, tokens data-parallel) runs at 1 to 3
// ranks only: at 4 and 8 it would repeat what 2 and 3 ranks show. Likewise
// ep 2 at 8 ranks (4 experts a rank, dp 4) repeats ep 2 at 4 ranks (4
// experts a rank, dp 2).
TEST_P(MoELayer, EqualsSerialIncludingFiveAdamWSteps) {
  const int n = test::world()->size();
  for (int ep : {1, 2, 3, 4, 8})
    if (n % ep == 0 && experts_for(n, GetParam()) % ep == 0 && (ep > 1 || n < 4) && !(ep == 2 && n == 8))
      expect_equal_to_serial(ep, GetParam(), "ddp");
}

INSTANTIATE_TEST_SUITE_P(Routing, MoELayer, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Expert parameters are reduced over the expert-data group under ZeRO-2 as
// under DDP.
TEST(MoELayerSharded, Zero2EqualsSerial) {
  const int n = test::world()->size();
  if (n < 4) GTEST_SKIP() << "needs ep 2 x dp 2";
  expect_equal_to_serial(2, kCases[1], "zero2");
}

// Every token of every rank goes to expert 0 (top-1) or experts 0 and 1
// (top-2): the ranks without them receive no rows, still take part in every all-to-all, and the
// gradients are right.
TEST(MoELayerSkewed, AllTokensToOneRankCompleteWithCorrectGradients) {
  const int n = test::world()->size();
  g_skewed = true;
  for (const Case& c : {kCases[0], kCases[1], kCases[4]}) expect_equal_to_serial(n, c, "ddp");
  g_skewed = false;
}

// Expert tensor parallelism (Note [Expert tensor parallelism]): ep 2 × etp 2
// at 4 ranks (ep 2 or 4 × etp 2 at 8): each rank holds half of every local
// expert's ffn, and the results equal the serial MoE's, for top-1 and top-2,
// dropless and with capacity, grouped and padded, fine-grained experts with
// a gated shared expert, under DDP and ZeRO-2, and with every token routed
// to one expert rank. Every routing runs at 4 ranks; 8 adds a data group
// (ep 2, dp 2) and a larger expert group (ep 4), with top-2.
TEST(MoEExpertTensor, SplitExpertsEqualSerial) {
  const int n = test::world()->size();
  if (n % 4 != 0) GTEST_SKIP() << "needs ep 2 x etp 2";
  if (n == 4)
    for (const Case& c : kCases) expect_equal_to_serial(2, c, "ddp", 2);
  if (n == 8)
    for (int ep : {2, 4}) expect_equal_to_serial(ep, kCases[1], "ddp", 2);
  expect_equal_to_serial(2, kCases[7], "zero2", 2);
  g_skewed = true;
  for (const Case& c : {kCases[0], kCases[4]}) expect_equal_to_serial(n / 2, c, "ddp", 2);
  g_skewed = false;
  // Really split: half of ffn per rank.
  ParallelRun run =
      make_parallel(2, options_for(kCases[0], experts_for(n)), full_weights(experts_for(n), 31), "ddp", 2);
  EXPECT_EQ(run.moe->c_fc->weight.size(1), kFfn / 2);
  EXPECT_EQ(run.moe->c_proj->weight.size(2), kFfn / 2);
}

// Skewed top-1 at expert size n: rank 0's expert 0 receives every rank's
// tokens. Grouped, the experts run exactly the rows routed to them; padded,
// each of rank 0's E_l experts runs as many rows as expert 0.
TEST(MoEExpertCompute, GroupedRunsTheRoutedRowsAndPaddedTheBusiestForEach) {
  auto world = test::world();
  const int n = world->size();
  const int64_t experts = experts_for(n), el = experts / n;
  g_skewed = true;
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().expert(n));
  nn::MoEGroups groups;
  groups.expert = ctx->comm(context::ParallelMode::kExpert);
  groups.tokens = ctx->comm(context::ParallelMode::kData);
  for (const Case& c : {kCases[0], Case{"padded", 1, false, c10::nullopt, kPosition, kPadded}}) {
    nn::MoE moe(options_for(c, experts), groups);
    moe->to(test::device());
    for (const auto& [name, p] :
         nn::placements_of(*moe, [](const at::Tensor& t) { return nn::replicated_placement(t); }))
      nn::load_full(p, full_weights(experts, 31).at(name));
    moe->forward(tokens_of(world->rank(), 0)).sum().backward();
    const nn::MoEStats& st = moe->last_stats();
    const int64_t routed = world->rank() == 0 ? n * kTokens : 0;
    EXPECT_EQ(st.rows_routed, routed) << c.name;
    EXPECT_EQ(st.rows_computed, c.compute == kPadded ? el * routed : routed) << c.name;
    // Every local expert's weight has a gradient, zero where no row went.
    ASSERT_TRUE(moe->c_fc->weight.grad().defined()) << c.name;
    for (int64_t e = 0; e < el; ++e) {
      const bool used = world->rank() == 0 && e == 0;
      EXPECT_EQ(moe->c_fc->weight.grad()[e].abs().sum().item<double>() > 0, used) << c.name << ", expert " << e;
    }
  }
  g_skewed = false;
}

// Known routing (the skewed one, top-1, dropless): rank r sends its T rows
// to rank 0; rank 0 receives n·T. Traced all-to-all bytes per rank are the
// inputs (Note [Trace byte counts]): the [E] int64 counts, then forward
// rows T·h (to rank 0) and back rows (n·T·h on rank 0, 0 elsewhere), and
// backward the same two in reverse: 8E + 2·T·h·4 + 2·[r = 0]·n·T·h·4.
// On the wire, rows to a rank's own experts stay home.
TEST(MoETrace, AllToAllBytesEqualTheFormulaForAKnownRouting) {
  comm::WorldOptions world_options;
  world_options.trace = std::make_shared<comm::CommTrace>();
  auto world = comm::make_world_communicator(world_options);
  const int n = world->size();
  if (n == 1) GTEST_SKIP() << "needs an expert group";
  const int64_t experts = experts_for(n);
  g_skewed = true;
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().expert(n));
  nn::MoEGroups groups;
  groups.expert = ctx->comm(context::ParallelMode::kExpert);
  groups.tokens = ctx->comm(context::ParallelMode::kData);
  nn::MoE moe(options_for(kCases[0], experts), groups);
  moe->to(test::device());
  for (const auto& [name, p] : nn::placements_of(*moe, [](const at::Tensor& t) { return nn::replicated_placement(t); }))
    nn::load_full(p, full_weights(experts, 31).at(name));
  const at::Tensor x = tokens_of(world->rank(), 0).requires_grad_();
  g_skewed = false;
  world_options.trace->reset();
  moe->forward(x).sum().backward();
  const auto a2a = world_options.trace->get(groups.expert->name(), comm::OpType::kAllToAll);
  const int64_t row = kHidden * 4, first = world->rank() == 0 ? 1 : 0;
  EXPECT_EQ(a2a.calls, 5);  // counts, rows, back; and the two adjoints
  EXPECT_EQ(a2a.bytes, experts * 8 + 2 * kTokens * row + 2 * first * n * kTokens * row)
      << world_options.trace->to_string();
  // On the wire: T rows each way between rank 0 and each other rank.
  const double counts_wire = experts * 8.0 * (n - 1) / n;
  EXPECT_DOUBLE_EQ(a2a.bus_bytes, counts_wire + 2.0 * kTokens * row * (first ? n - 1 : 1));
}

TEST(MoERefusals, EveryRankGetsTheMessage) {
  auto world = test::world();
  const int n = world->size();
  if (n > 1) {
    auto ctx = context::ParallelContext::create(world, context::ParallelConfig().expert(n));
    nn::MoEGroups groups;
    groups.expert = ctx->comm(context::ParallelMode::kExpert);
    const std::string count =
        std::to_string(n + 1) + " experts do not divide over an expert group of " + std::to_string(n) + " ranks";
    EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, n + 1), groups), count.c_str(),
                          "choose an expert size");
  }
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).top_k(5)),
                        "top-k 5 must be between 1 and the 4 experts");
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).capacity_factor(0.0)),
                        "capacity factor 0 must be positive", "leave it unset for dropless");
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).capacity_factor(-1.5)), "capacity factor -1.5");
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).drop_policy(nn::MoEDropPolicy::kProbability)),
                        "drop policy 'probability'", "no capacity factor is set");
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).aux_loss_coef(-0.1)),
                        "auxiliary loss coefficients (-0.1", "must be >= 0");
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).shared_ffn(-3)), "shared_ffn -3 must be >= 0");
  if (n > 1) {
    nn::MoEGroups split;
    split.expert_tensor = world;
    const std::string width = "ffn width " + std::to_string(n + 1) + " does not divide over the " + std::to_string(n) +
                              " ranks of the expert-tensor group";
    EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, n + 1, 4), split), width.c_str());
  }
  EXPECT_ERROR_CONTAINS(nn::MoE(nn::MoEOptions(kHidden, kFfn, 4).shared_gate(true)),
                        "shared_gate scales the shared experts' output, but shared_ffn is 0");
}

}  // namespace
}  // namespace tessera
