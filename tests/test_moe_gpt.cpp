// tessera's GPT with mixture-of-experts blocks under the trainer against the
// serial reference GPT (tests/reference_gpt.h: plain LibTorch, experts run
// on every token and mixed by a dense gate matrix): 3 steps of SGD-momentum
// with clipping, losses and gradient norms within 1e-5, and the full
// weights after them, at expert sizes 1, 2 and 4 with data, tensor,
// sequence and pipeline parallelism under several sharding specs, with and
// without activation checkpointing, with whole experts on every tensor rank
// and split over the tensor group (expert tensor parallelism); every MoE
// block has a gated shared expert beside its routed ones; a
// checkpoint saved at ep4 loads at ep2 and in one process with the same
// loss; refusals.
#include "test_util.h"

#include "reference_gpt.h"
#include "saved_state.h"

#include "tessera/context/layout.h"
#include "tessera/context/parallel_context.h"
#include "tessera/core/safetensors.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace tessera {
namespace {

constexpr int64_t kSeq = 8, kRows = 16;
constexpr double kTolerance = 1e-5;
using context::ParallelConfig;
using context::ParallelMode;

models::GPTConfig config() {
  auto c = models::GPTConfig::preset("tiny");
  c.layers(4);
  c.experts(4);
  c.moe_every(2);  // blocks 1 and 3
  c.top_k(2);
  c.renormalize(true);
  c.aux_loss_coef(0.1);  // large, so that a wrong auxiliary gradient shows
  c.z_loss_coef(0.01);
  c.shared_expert_ffn(24);  // a gated shared expert beside the routed ones
  c.shared_expert_gate(true);
  return c;
}

at::Tensor ids(int64_t rows, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(config().vocab(), {rows, kSeq}, gen, at::kLong);
}

struct Layout {
  std::string name;
  ParallelConfig parallel;
  std::string spec;
  int microbatches = 1;
  bool checkpoint = false;  // activation checkpointing of every block
  bool expert_tensor = false;  // experts split over the tensor group
};

std::vector<Layout> layouts(int n) {
  using context::SequenceMode;
  switch (n) {
    case 1:
      return {{"ep1", ParallelConfig(), "ddp"}};
    case 2:
      return {{"ep2", ParallelConfig().expert(2), "ddp"},
              {"ep2_checkpointed", ParallelConfig().expert(2), "zero2", 1, true},
              {"ep2_zero3", ParallelConfig().expert(2), "zero3"},
              {"pp2", ParallelConfig().pipeline(2), "ddp", 2}};
    case 4:
      return {{"ep2_dp2_zero2", ParallelConfig().expert(2), "zero2"},
              {"ep4_zero3", ParallelConfig().expert(4), "zero3"},
              {"ep2_tp2", ParallelConfig().tensor(2).expert(2), "ddp"},
              {"ep2_tp2_etp_zero2", ParallelConfig().tensor(2).expert(2), "zero2", 1, false, true},
              {"ep2_sp2_ring", ParallelConfig().sequence(2).sequence_mode(SequenceMode::kRing).expert(2), "zero2"}};
    case 8:
      return {{"ep2_pp2_dp2_zero2", ParallelConfig().pipeline(2).expert(2), "zero2", 2},
              {"ep2_dp2_tp2_rps", ParallelConfig().tensor(2).expert(2), "{R,P(2),S}"},
              {"ep2_pp2_tp2", ParallelConfig().pipeline(2).tensor(2).expert(2), "ddp", 2},
              {"ep4_tp2_etp", ParallelConfig().tensor(2).expert(4), "ddp", 1, false, true},
              {"ep4_pp2_checkpointed", ParallelConfig().pipeline(2).expert(4), "ddp", 2, true}};
    default:
      return {};
  }
}

train::LrSchedule schedule() {
  return train::LrSchedule().peak(0.1).warmup_steps(2).total_steps(30).decay(train::LrDecay::kCosine);
}

struct Model {
  std::shared_ptr<models::GPTImpl> gpt;
  std::unique_ptr<train::Trainer> trainer;
};

Model make_run(const context::ParallelContextPtr& ctx, const Layout& s, uint64_t seed) {
  torch::manual_seed(seed);
  Model r;
  auto c = config();
  c.checkpoint_activations(s.checkpoint);
  r.gpt = std::make_shared<models::GPTImpl>(c, nn::make_layer_factory(ctx, false, false, s.expert_tensor));
  r.gpt->to(test::device());  // built on the CPU: the same weights on every device
  auto make = [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    std::vector<at::Tensor> params;
    for (const auto& p : named) params.push_back(p.second);
    return std::shared_ptr<torch::optim::Optimizer>(
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9)));
  };
  r.trainer = std::make_unique<train::Trainer>(ctx, train::gpt_train_model(r.gpt), make,
                                               train::TrainerOptions()
                                                   .spec(parallel::ShardingSpec::parse(s.spec))
                                                   .pipeline(parallel::PipelineOptions().microbatches(s.microbatches))
                                                   .clip_grad_norm(0.5)
                                                   .lr(schedule())
                                                   .bucket_bytes(4096));
  return r;
}

// This data rank's rows of the global batch of `step`.
std::pair<at::Tensor, at::Tensor> batch(const context::ParallelContextPtr& ctx, int step) {
  auto data = ctx->comm(ParallelMode::kData);
  const int64_t local = kRows / data->size();
  return {ids(kRows, 100 + step).narrow(0, data->rank() * local, local),
          ids(kRows, 200 + step).narrow(0, data->rank() * local, local)};
}

std::map<std::string, at::Tensor> initial_weights() {
  auto world = test::world();
  torch::manual_seed(7);
  auto self = world->split(world->rank(), 0, "self");
  models::GPT source(config(), nn::make_1d_factory(self, false, 1, 2));
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : source->full_state()) out[entry.first] = entry.second.clone();
  return out;
}

struct SerialSteps {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> weights;  // after the steps
};

// The reference over the global batch. The auxiliary losses are statistics
// of the tokens that pass through a layer together: with `microbatches`
// pipeline micro-batches, micro-batch m is the m-th slice of every data
// rank's rows, and the loss is the mean over micro-batches of its cross
// entropy and auxiliary losses.
SerialSteps serial_steps(int64_t dp, int microbatches) {
  test::ReferenceGPT gpt(test::reference_config(config()));
  gpt->load_full_state(initial_weights());
  torch::optim::SGD opt(gpt->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  SerialSteps out;
  const int64_t local = kRows / dp, slice = local / microbatches;
  for (int step = 0; step < 3; ++step) {
    for (auto& g : opt.param_groups()) g.options().set_lr(schedule().at(step));
    opt.zero_grad();
    const at::Tensor x = ids(kRows, 100 + step), y = ids(kRows, 200 + step);
    at::Tensor total = at::zeros({}), ce_total = at::zeros({});
    for (int m = 0; m < microbatches; ++m) {
      std::vector<at::Tensor> xs, ys;
      for (int64_t d = 0; d < dp; ++d) {
        xs.push_back(x.narrow(0, d * local + m * slice, slice));
        ys.push_back(y.narrow(0, d * local + m * slice, slice));
      }
      const at::Tensor ce = gpt->loss(gpt->forward(at::cat(xs)), at::cat(ys));
      total = total + (ce + gpt->aux_loss()) / static_cast<double>(microbatches);
      ce_total = ce_total + ce.detach() / static_cast<double>(microbatches);
    }
    total.backward();
    out.norms.push_back(torch::nn::utils::clip_grad_norm_(gpt->parameters(), 0.5));
    opt.step();
    out.losses.push_back(ce_total.item<double>());
  }
  out.weights = gpt->full_state();
  return out;
}

// A directory name that every rank agrees on.
std::string shared_dir(const std::string& what) {
  const std::string dir = "moe_gpt_test_" + what + "_np" + std::to_string(test::world()->size());
  if (test::world()->rank() == 0) std::filesystem::create_directories(dir);
  test::world()->barrier();
  return dir;
}

void expect_serial_steps(const Layout& s) {
  SCOPED_TRACE(s.name);
  auto ctx = context::ParallelContext::create(test::world(), s.parallel);
  const SerialSteps expected = serial_steps(ctx->size(ParallelMode::kData), s.microbatches);
  Model r = make_run(ctx, s, 7);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(ctx, step);
    const train::StepStats st = r.trainer->train_step(x, y);
    EXPECT_NEAR(st.loss, expected.losses[step], kTolerance * expected.losses[step]) << "step " << step;
    EXPECT_NEAR(st.grad_norm, expected.norms[step], kTolerance * expected.norms[step]) << "norm, step " << step;
    EXPECT_GT(st.grad_norm, 0.5) << "the test must clip";
  }
  // Every parameter after 3 steps. A pipeline rank holds only its own
  // stage's up to date, so every layout is read from the consolidated
  // checkpoint, which each stage's ranks write their parameters into.
  const std::string dir = shared_dir("steps_" + s.name);
  r.trainer->save(dir + "/ckpt");
  if (test::world()->rank() == 0) {
    train::consolidate_checkpoint(dir + "/ckpt", dir + "/model.safetensors");
    SafetensorsFile f(dir + "/model.safetensors");
    EXPECT_EQ(f.names().size(), expected.weights.size());
    for (const auto& [name, value] : expected.weights)
      EXPECT_LE(test::rel_error(f.read(name), value), kTolerance) << name << " after 3 steps";
  }
  test::world()->barrier();
}

TEST(MoEGPT, ThreeStepsEqualSerial) {
  const auto all = layouts(test::world()->size());
  if (all.empty()) GTEST_SKIP() << "no MoE layout at " << test::world()->size() << " ranks";
  for (const Layout& s : all) expect_serial_steps(s);
}

// The experts really are split: each rank holds experts / ep of them.
TEST(MoEGPT, ExpertsAreSplitOverTheExpertGroup) {
  const int n = test::world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  auto ctx = context::ParallelContext::create(test::world(), ParallelConfig().expert(2));
  torch::manual_seed(7);
  models::GPT gpt(config(), nn::make_layer_factory(ctx));
  int64_t seen = 0;
  for (const auto& [name, p] : gpt->placements()) {
    if (name.find("mlp.c_fc.weight") == std::string::npos || name.find("h.1.") != 0) continue;
    EXPECT_EQ(p.param.size(0), config().experts() / 2) << name;
    EXPECT_EQ(p.offset[0], ctx->rank(ParallelMode::kExpert) * config().experts() / 2) << name;
    EXPECT_TRUE(p.replica_group == ctx->comm(ParallelMode::kExpertData)) << name;
    ++seen;
  }
  EXPECT_EQ(seen, 1);
}

// Saved at ep4 (dp4, ZeRO-3), loaded at ep2 (dp4, ZeRO-2) and in one
// process: the whole state bit for bit against the saver's own pieces
// (saved_state.h), and the same evaluation loss.
TEST(MoEGPT, CheckpointAtEp4LoadsAtEp2AndInOneProcess) {
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const std::string dir = shared_dir("reshard") + "/ckpt";
  const at::Tensor x0 = ids(kRows, 500), y0 = ids(kRows, 600);
  auto local = [](const context::ParallelContextPtr& ctx, const at::Tensor& t) {
    auto data = ctx->comm(ParallelMode::kData);
    const int64_t n = t.size(0) / data->size();
    return t.narrow(0, data->rank() * n, n);
  };
  double saved = 0;
  std::map<std::string, at::Tensor> state;
  {
    auto ctx = context::ParallelContext::create(world, ParallelConfig().expert(4));
    Model a = make_run(ctx, {"ep4", ParallelConfig().expert(4), "zero3"}, 7);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(ctx, step);
      a.trainer->train_step(x, y);
    }
    a.trainer->save(dir);
    state = test::gather_state(a.trainer->state_pieces(), shared_dir("reshard_state"));
    saved = a.trainer->evaluate(local(ctx, x0), local(ctx, y0));
  }
  {
    auto ctx = context::ParallelContext::create(world, ParallelConfig().expert(2));
    Model b = make_run(ctx, {"ep2", ParallelConfig().expert(2), "zero2"}, 1234);
    b.trainer->load(dir);
    test::expect_state_equal(b.trainer->state_pieces(), state);
    EXPECT_NEAR(b.trainer->evaluate(local(ctx, x0), local(ctx, y0)), saved, kTolerance * saved) << "at ep2";
  }
  auto self = world->split(world->rank(), 0, "self");
  auto ctx = context::ParallelContext::create(self, ParallelConfig());
  Model c = make_run(ctx, {"single", ParallelConfig(), "ddp"}, 1234);
  c.trainer->load(dir);
  test::expect_state_equal(c.trainer->state_pieces(), state);
  EXPECT_NEAR(c.trainer->evaluate(x0, y0), saved, kTolerance * saved) << "in one process";
}

TEST(MoEGPTRefusals, EveryRankGetsTheMessage) {
  auto world = test::world();
  const int n = world->size();
  if (n >= 2) {
    auto ctx = context::ParallelContext::create(world, ParallelConfig().expert(2));
    auto dense = config();
    dense.experts(0);
    EXPECT_ERROR_CONTAINS(models::GPT(dense, nn::make_layer_factory(ctx)), "expert size 2 is configured",
                          "no mixture-of-experts blocks");
    auto odd = config();
    odd.experts(3);
    EXPECT_ERROR_CONTAINS(models::GPT(odd, nn::make_layer_factory(ctx)),
                          "3 experts do not divide over an expert group of 2");
    EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, /*sequence_parallel=*/true),
                          "expert size 2 and the 1D layers' sequence-parallel variant");
  }
  if (n == 4) {
    auto ctx = context::ParallelContext::create(
        world, ParallelConfig().tensor(4).tensor_mode(context::TensorMode::k2D).data(1));
    auto c = config();
    EXPECT_ERROR_CONTAINS(models::GPT(c, nn::make_layer_factory(ctx)),
                          "mixture-of-experts layers run on tensor mode 1d");
    EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, false, false, /*expert_tensor_parallel=*/true),
                          "expert tensor parallelism splits the experts over the 1D tensor group", "tensor mode 2d");
  }
  if (n >= 2) {
    auto ctx = context::ParallelContext::create(world, ParallelConfig().tensor(2));
    EXPECT_ERROR_CONTAINS(nn::make_layer_factory(ctx, /*sequence_parallel=*/true, false, true),
                          "expert tensor parallelism", "with the sequence-parallel variant");
    EXPECT_ERROR_CONTAINS(context::check_shape(context::Layout(ctx->config()).expert_tensor_parallel(true),
                                               context::ModelShape().experts(0)),
                          "expert tensor parallelism splits the experts, and this model has no mixture-of-experts");
  }
  auto self = world->split(world->rank(), 0, "self");
  auto factory = nn::make_1d_factory(self, false, 1, 2);
  auto big_k = config();
  big_k.top_k(5);
  EXPECT_ERROR_CONTAINS(models::GPT(big_k, factory), "top-k 5 must be between 1 and the 4 experts");
  auto no_capacity = config();
  no_capacity.capacity_factor(0.0);
  EXPECT_ERROR_CONTAINS(models::GPT(no_capacity, factory), "capacity factor 0 must be positive");
  auto every = config();
  every.moe_every(5);
  EXPECT_ERROR_CONTAINS(models::GPT(every, factory), "moe_every 5 exceeds the 4 layers");
}

}  // namespace
}  // namespace tessera
