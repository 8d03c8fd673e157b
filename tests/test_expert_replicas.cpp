// Parameters replicated over a sub-group of the data group (expert
// parameters: replica group = expert-data group) under ShardedModule: their
// gradients are summed over that group only, their shards are laid out over
// it, their initial values are broadcast within it, and their whole norms
// count each element once. A toy with one dense weight g [H, H] (replicated
// over the data group) and E = ep stacked experts X [E, H, H] (expert e on
// the data ranks whose expert rank is e):
//   loss_d = Σ (tanh(x_d gᵀ) X[e(d)]ᵀ - t_d)² / rows,  loss = mean over d.
// The serial side is the same arithmetic written directly in LibTorch over
// the full tensors and every data rank's batch.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/context/parallel_context.h"
#include "tessera/nn/placement.h"
#include "tessera/optim/lamb.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/whole_norms.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/state_pieces.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

constexpr int64_t kH = 6, kRows = 4;  // rows per data rank
constexpr int kSteps = 5;
constexpr double kTolerance = 1e-5;

struct ExpertToyImpl : torch::nn::Module, nn::PlacedModule {
  ExpertToyImpl(int64_t experts, comm::CommunicatorPtr expert_, comm::CommunicatorPtr expert_data_)
      : expert(std::move(expert_)), expert_data(std::move(expert_data_)) {
    g = register_parameter("g", at::zeros({kH, kH}));
    x = register_parameter("x", at::zeros({experts / expert->size(), kH, kH}));
  }
  nn::NamedPlacements local_placements() override {
    nn::ParamPlacement p = nn::replicated_placement(x).shard("expert", expert, 0);
    p.replica_group = expert_data;
    return {{"x", p}};
  }
  nn::NamedPlacements placements() {
    return nn::placements_of(*this, [](const at::Tensor& p) { return nn::replicated_placement(p); });
  }
  // This rank's loss with local expert `local` (0 when each rank holds one).
  at::Tensor loss(const at::Tensor& in, const at::Tensor& t, int64_t local) {
    const at::Tensor y = at::matmul(at::tanh(at::matmul(in, g.t())), x[local].t());
    return (y - t).pow(2).sum() / static_cast<double>(in.size(0));
  }
  comm::CommunicatorPtr expert, expert_data;
  at::Tensor g, x;
};
TORCH_MODULE(ExpertToy);

std::map<std::string, at::Tensor> initial_weights(int64_t experts) {
  return {{"g", test::device_randn({kH, kH}, 11) * 0.5}, {"x", test::device_randn({experts, kH, kH}, 12) * 0.5}};
}
at::Tensor batch_in(int step, int64_t d) { return test::device_randn({kRows, kH}, 1000 + 64 * step + d); }
at::Tensor batch_t(int step, int64_t d) { return test::device_randn({kRows, kH}, 5000 + 64 * step + d) * 0.5; }

struct Serial {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> weights;
};

// Plain LibTorch over the full tensors; expert_of[d] is data rank d's expert.
Serial serial_run(const std::vector<int64_t>& expert_of, int64_t experts, bool lamb, double clip) {
  auto init = initial_weights(experts);
  at::Tensor g = init["g"].clone().requires_grad_(), x = init["x"].clone().requires_grad_();
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (lamb) {
    opt = std::make_unique<optim::Lamb>(std::vector<at::Tensor>{g, x}, optim::LambOptions(0.02).weight_decay(0.01));
  } else {
    opt = std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{g, x},
                                                torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  }
  Serial out;
  const auto dp = static_cast<int64_t>(expert_of.size());
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    at::Tensor loss = at::zeros({}, test::device_options(at::kFloat));
    for (int64_t d = 0; d < dp; ++d) {
      const at::Tensor y = at::matmul(at::tanh(at::matmul(batch_in(step, d), g.t())), x[expert_of[d]].t());
      loss = loss + (y - batch_t(step, d)).pow(2).sum() / static_cast<double>(kRows);
    }
    loss = loss / static_cast<double>(dp);
    loss.backward();
    out.norms.push_back(torch::nn::utils::clip_grad_norm_(std::vector<at::Tensor>{g, x}, clip));
    out.losses.push_back(loss.item<double>());
    opt->step();
  }
  out.weights = {{"g", g.detach()}, {"x", x.detach()}};
  return out;
}

struct ExpertRun {
  ExpertToy toy{nullptr};
  parallel::ShardedModulePtr sharded;
  std::unique_ptr<parallel::ShardedOptimizer> opt;
  comm::CommunicatorPtr data;
};

// Every rank starts from different values: what the wrapper broadcasts
// (over each parameter's replica group) must make them right.
ExpertRun make_run(const context::ParallelContextPtr& ctx, int64_t experts, const std::string& spec, bool lamb) {
  ExpertRun r;
  r.toy = ExpertToy(experts, ctx->comm(context::ParallelMode::kExpert), ctx->comm(context::ParallelMode::kExpertData));
  r.toy->to(test::device());
  for (const auto& [name, p] : r.toy->placements()) {
    const at::Tensor full = initial_weights(experts).at(name);
    // Replicas of the same region agree after the wrapper's broadcast; poison the others.
    const bool first = (name == "x" ? ctx->rank(context::ParallelMode::kExpertData)
                                    : ctx->rank(context::ParallelMode::kData)) == 0;
    nn::load_full(p, first ? full : full + 100.0);
  }
  const auto placements = r.toy->placements();
  r.sharded = std::make_shared<parallel::ShardedModule>(
      r.toy.ptr(), ctx,
      parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::parse(spec)).placements(placements));
  std::shared_ptr<torch::optim::Optimizer> inner;
  if (lamb) {
    inner = std::make_shared<optim::Lamb>(r.toy->parameters(), optim::LambOptions(0.02).weight_decay(0.01));
  } else {
    inner = std::make_shared<torch::optim::AdamW>(r.toy->parameters(),
                                                  torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  }
  r.opt = std::make_unique<parallel::ShardedOptimizer>(
      r.sharded, inner,
      parallel::ShardedOptimizerOptions().whole_norms(std::make_shared<parallel::PlacementNorms>(placements)));
  r.data = ctx->comm(context::ParallelMode::kData);
  return r;
}

double global_loss(ExpertRun& r, int step, bool backward) {
  const int64_t d = r.data->rank();
  at::Tensor loss = r.sharded->run([&] { return r.toy->loss(batch_in(step, d), batch_t(step, d), 0); });
  if (backward) loss.backward();
  at::Tensor total = at::tensor({loss.item<double>()}, at::kDouble);
  r.data->all_reduce(total);
  return total.item<double>() / static_cast<double>(r.data->size());
}

std::map<std::string, at::Tensor> full_weights(ExpertRun& r) {
  auto gathered = r.sharded->full_params();
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, p] : r.toy->placements()) out[name] = nn::full_value(p);
  return out;
}

// Data rank d's expert rank, as the grid assigns it, known on every rank.
std::vector<int64_t> experts_of_data_ranks(const context::ParallelContextPtr& ctx) {
  auto data = ctx->comm(context::ParallelMode::kData);
  at::Tensor v = at::zeros({data->size()}, at::kLong);  // on the CPU: read through data_ptr
  v[data->rank()] = ctx->rank(context::ParallelMode::kExpert);
  data->all_reduce(v);
  return std::vector<int64_t>(v.data_ptr<int64_t>(), v.data_ptr<int64_t>() + v.numel());
}

void expect_equal_to_serial(int ep, const std::string& spec, bool lamb, double clip) {
  auto world = test::world();
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().expert(ep));
  const std::string what = "ep " + std::to_string(ep) + ", spec " + spec + (lamb ? ", LAMB" : ", AdamW");
  const Serial serial = serial_run(experts_of_data_ranks(ctx), ep, lamb, clip);
  ExpertRun run = make_run(ctx, ep, spec, lamb);
  for (int step = 0; step < kSteps; ++step) {
    run.opt->zero_grad();
    const double loss = global_loss(run, step, /*backward=*/true);
    EXPECT_NEAR(loss, serial.losses[step], kTolerance * serial.losses[step]) << what << ": loss, step " << step;
    const double norm = run.opt->clip_grad_norm(clip);
    EXPECT_NEAR(norm, serial.norms[step], kTolerance * serial.norms[step]) << what << ": norm, step " << step;
    run.opt->step();
  }
  for (const auto& [name, value] : full_weights(run))
    EXPECT_LE(test::rel_error(value, serial.weights.at(name)), kTolerance) << what << ": " << name;
}

TEST(ExpertReplicas, GradientsReducedOverTheExpertDataGroupEqualSerial) {
  const int n = test::world()->size();
  for (int ep : {1, 2, 4}) {
    if (n % ep != 0) continue;
    for (const std::string spec : {"ddp", "zero2", "zero3", "{R,P(2),S}"}) {
      if (spec == "{R,P(2),S}" && (n / ep) % 2 != 0) continue;
      expect_equal_to_serial(ep, spec, /*lamb=*/false, /*clip=*/1e9);
    }
  }
}

// LAMB reads each parameter's whole norm (the stacked experts: every expert
// once); a small max_norm makes clipping act on every step.
TEST(ExpertReplicas, WholeNormsOfStackedExpertsUnderLambAndClipping) {
  const int n = test::world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world for an expert group";
  for (int ep : {2, 4})
    if (n % ep == 0) expect_equal_to_serial(ep, "zero2", /*lamb=*/true, /*clip=*/0.5);
}

// A checkpoint written with experts over ep ranks loads into one process.
TEST(ExpertReplicas, CheckpointLoadsIntoOneProcess) {
  auto world = test::world();
  const int ep = world->size() % 2 == 0 ? 2 : 1;
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().expert(ep));
  ExpertRun run = make_run(ctx, ep, "zero3", false);
  for (int step = 0; step < 2; ++step) {
    run.opt->zero_grad();
    global_loss(run, step, true);
    run.opt->step();
  }
  const auto trained = full_weights(run);
  const std::string dir = "expert_replicas_checkpoint_" + std::to_string(world->size());
  train::save_checkpoint(dir, train::optimizer_pieces(*run.opt, run.toy->placements()), "{}", world);
  auto one = context::ParallelContext::create(world->split(world->rank(), 0, "self"), context::ParallelConfig());
  ExpertRun loaded = make_run(one, ep, "ddp", false);
  train::load_optimizer_pieces(infer::CheckpointReader(dir), *loaded.opt, loaded.toy->placements());
  for (const auto& [name, value] : full_weights(loaded))
    EXPECT_LE(test::rel_error(value, trained.at(name)), 1e-7) << name << " after loading in one process";
  world->barrier();
}

// A spec that the replica group cannot carry is refused naming the parameter and the group.
TEST(ExpertReplicas, SpecThatTheReplicaGroupCannotCarryIsRefused) {
  auto world = test::world();
  if (world->size() != 8) GTEST_SKIP() << "needs 8 ranks (expert-data groups of 2)";
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().expert(4));
  EXPECT_ERROR_CONTAINS(make_run(ctx, 4, "mics:4", false), "parameter 'x'", "replica group of 2 ranks", "P(4)");
}

}  // namespace
}  // namespace tessera
