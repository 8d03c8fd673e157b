// The trainer and its checkpoints on tessera's GPT. Trainer: 5 steps of
// SGD-momentum with warm-up, cosine, linear or polynomial decay (the rates
// from a formula written here) and clipping equal to the serial reference
// GPT (tests/reference_gpt.h: plain LibTorch, nothing from tessera; losses,
// gradient norms and every parameter after the steps within 1e-5) in
// every configuration the world allows, 1D, 2D, 2.5D and 3D with data,
// sequence and pipeline parallelism, under several sharding specs. Checkpoints: resuming reproduces the losses bit for
// bit (dropout on); a checkpoint of dp2 x pp2 x tp2 loads at dp4 x tp2,
// tp4 x dp2, 2D x dp2 and in one process, and one of 2.5D (q 2, depth 2) as
// 1D tp4 x dp2 and in one process, and one of 3D as 2D x dp2 and in one
// process, with the same loss, and one more step
// from the loaded optimizer state gives the same loss too; the consolidated
// file equals the full weights; bad input is refused. Host scalars, strings
// and headers take the groups' control channels, tensors the device ones.
#include "test_util.h"

#include "counting_allocator.h"
#include "reference_gpt.h"
#include "saved_state.h"

#include "tessera/comm/tracing_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/parallel/flat_bucket.h"
#include "tessera/train/checkpoint.h"
#include "tessera/core/safetensors.h"
#include "tessera/train/trainer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

namespace tessera {
namespace {

constexpr int64_t kSeq = 8;
constexpr double kTolerance = 1e-5;
using context::ParallelConfig;
using context::ParallelMode;
using context::TensorMode;

models::GPTConfig config(double dropout = 0.0) {
  auto c = models::GPTConfig::preset("tiny");
  c.layers(4);
  c.dropout(dropout);
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
  bool loss_scaling = false;  // dynamic loss scaling from 2^16
  int chunks = 1;             // > 1: interleaved 1F1B
  bool disk = false;          // optimizer states on disk, in small tiles
  train::LrDecay decay = train::LrDecay::kCosine;
};

// The configurations a world of n ranks can run.
std::vector<Layout> layouts(int n) {
  switch (n) {
    case 1:
      return {{"serial", ParallelConfig(), "ddp"}};
    case 2:
      return {{"dp2_zero3", ParallelConfig().data(2), "zero3"},
              {"pp2", ParallelConfig().pipeline(2), "ddp", 2},
              {"tp2", ParallelConfig().tensor(2), "ddp"},
              {"pp2_loss_scaled", ParallelConfig().pipeline(2), "ddp", 2, true}};
    case 3:  // uneven pieces: 3 does not divide the buckets
      return {{"dp3_zero3", ParallelConfig().data(3), "zero3"},
              {"pp3", ParallelConfig().pipeline(3), "ddp", 3},
              {"dp3_zero2_loss_scaled", ParallelConfig().data(3), "zero2", 1, true}};
    case 4:
      return {{"dp2_tp2_zero2", ParallelConfig().data(2).tensor(2), "zero2"},
              {"pp2_tp2", ParallelConfig().pipeline(2).tensor(2), "ddp", 3},
              {"2d4", ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D), "ddp"},
              {"dp2_pp2_zero3", ParallelConfig().data(2).pipeline(2), "zero3", 2},
              {"dp2_pp2_zero3_interleaved_scaled", ParallelConfig().data(2).pipeline(2), "zero3", 2, true, 2}};
    case 8:
      return {{"dp2_pp2_tp2", ParallelConfig().data(2).pipeline(2).tensor(2), "{R,P(2),S}", 2},
              {"dp2_2d4_zero2", ParallelConfig().data(2).tensor(4).tensor_mode(TensorMode::k2D), "zero2"},
              {"pp2_2d4", ParallelConfig().pipeline(2).tensor(4).tensor_mode(TensorMode::k2D), "ddp", 2},
              {"2.5d_q2_d2_zero3", ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2), "zero3"},
              {"3d_q2", ParallelConfig().tensor(8).tensor_mode(TensorMode::k3D), "ddp"},
              {"dp2_pp2_tp2_zero3_scaled", ParallelConfig().data(2).pipeline(2).tensor(2), "zero3", 2, true}};
    default:
      return {};
  }
}

struct Model {
  std::shared_ptr<models::GPTImpl> gpt;
  std::unique_ptr<train::Trainer> trainer;
};

// Two warm-up steps, then decay to a tenth of the peak at step 5: the
// serial side's rates come from lr_formula, written here from the schedule's
// definition (docs/trainer.md), not from tessera's LrSchedule.
constexpr int64_t kWarmup = 2, kDecayEnd = 5;
constexpr double kMinRatio = 0.1, kPower = 2;

train::LrSchedule schedule(double peak, train::LrDecay decay = train::LrDecay::kCosine) {
  return train::LrSchedule()
      .peak(peak)
      .warmup_steps(kWarmup)
      .total_steps(kDecayEnd)
      .decay(decay)
      .min_ratio(kMinRatio)
      .power(kPower);
}

double lr_formula(double peak, train::LrDecay decay, int64_t step) {
  if (step < kWarmup) return peak * (step + 1) / kWarmup;
  const double p = std::min(1.0, double(step - kWarmup) / double(kDecayEnd - kWarmup));
  const double floor = kMinRatio * peak;
  switch (decay) {
    case train::LrDecay::kCosine:
      return floor + (peak - floor) * (1 + std::cos(M_PI * p)) / 2;
    case train::LrDecay::kLinear:
      return peak - (peak - floor) * p;
    case train::LrDecay::kPolynomial:
      return floor + (peak - floor) * std::pow(1 - p, kPower);
    case train::LrDecay::kConstant:
      return peak;
  }
  return 0;
}

parallel::PipelineOptions pipeline_options(const Layout& s) {
  return parallel::PipelineOptions()
      .microbatches(s.microbatches)
      .chunks(s.chunks)
      .schedule(s.chunks > 1 ? parallel::ScheduleKind::kInterleaved1F1B : parallel::ScheduleKind::k1F1B);
}

// The model is built on the CPU and moved to `device` (the test device
// unless a test needs the CPU's allocator), the same weights on every device.
Model make_run(const context::ParallelContextPtr& ctx, const Layout& s, uint64_t seed, double dropout, bool adamw,
               at::ScalarType dtype = at::kFloat, int64_t bucket_bytes = 4096,
               const c10::Device& device = test::device()) {
  torch::manual_seed(seed);
  Model r;
  r.gpt = std::make_shared<models::GPTImpl>(config(dropout), nn::make_layer_factory(ctx));
  r.gpt->to(device, dtype);
  auto make = [adamw](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    std::vector<at::Tensor> params;
    for (const auto& p : named) params.push_back(p.second);
    if (adamw) return std::shared_ptr<torch::optim::Optimizer>(std::make_shared<torch::optim::AdamW>(params));
    return std::shared_ptr<torch::optim::Optimizer>(
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9)));
  };
  r.trainer = std::make_unique<train::Trainer>(ctx, train::gpt_train_model(r.gpt), make,
                                               train::TrainerOptions()
                                                   .spec(parallel::ShardingSpec::parse(s.spec))
                                                   .pipeline(pipeline_options(s))
                                                   .loss_scaling(s.loss_scaling)
                                                   .clip_grad_norm(0.5)
                                                   .lr(schedule(adamw ? 1e-3 : 0.1, s.decay))
                                                   .bucket_bytes(bucket_bytes)
                                                   .offload(s.disk ? parallel::Offload::kDisk : parallel::Offload::kNone)
                                                   .disk(parallel::DiskOffloadOptions()
                                                             .dir(s.disk ? ::testing::TempDir() : "")
                                                             .tile_bytes(4096)));
  return r;
}

// This data rank's rows of the global batch of `step`.
std::pair<at::Tensor, at::Tensor> batch(const context::ParallelContextPtr& ctx, int64_t rows, int step) {
  auto data = ctx->comm(ParallelMode::kData);
  const int64_t local = rows / data->size();
  return {ids(rows, 100 + step).narrow(0, data->rank() * local, local),
          ids(rows, 200 + step).narrow(0, data->rank() * local, local)};
}

// A directory name that every rank of this test agrees on.
std::string shared_dir(const std::string& what) {
  const std::string dir = "train_test_" + what + "_np" + std::to_string(test::world()->size());
  if (test::world()->rank() == 0) std::filesystem::create_directories(dir);
  test::world()->barrier();
  return dir;
}

// The serial reference: the reference GPT from the weights every run starts
// from (tessera's initialisation with seed 7, the same whatever the layout;
// tessera's GPT is the source of weights only), SGD-momentum,
// clip_grad_norm_ 0.5, lr_formula's rates; the loss, the gradient norm
// before clipping and the rate of each step, and the weights after them.
struct SerialSteps {
  std::vector<double> losses, norms, lrs;
  std::map<std::string, at::Tensor> weights;
};

SerialSteps serial_steps(int64_t rows, train::LrDecay decay = train::LrDecay::kCosine, int steps = 3) {
  auto world = test::world();
  std::map<std::string, at::Tensor> initial;
  {
    torch::manual_seed(7);
    auto self = world->split(world->rank(), 0, "self");
    models::GPT source(config(), nn::make_1d_factory(self, false, 1, 2));
    for (const auto& entry : source->full_state()) initial[entry.first] = entry.second.clone();
  }
  test::ReferenceGPT gpt(test::reference_config(config()));
  gpt->load_full_state(initial);
  torch::optim::SGD opt(gpt->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  SerialSteps out;
  for (int step = 0; step < steps; ++step) {
    out.lrs.push_back(lr_formula(0.1, decay, step));
    for (auto& g : opt.param_groups()) g.options().set_lr(out.lrs.back());
    opt.zero_grad();
    at::Tensor loss = gpt->loss(gpt->forward(ids(rows, 100 + step)), ids(rows, 200 + step));
    loss.backward();
    out.norms.push_back(torch::nn::utils::clip_grad_norm_(gpt->parameters(), 0.5));
    opt.step();
    out.losses.push_back(loss.item<double>());
  }
  out.weights = gpt->full_state();
  return out;
}

// Every parameter of a trained model against `expected`: read from its
// consolidated checkpoint, as a pipeline rank holds only its own stage's.
void expect_weights(train::Trainer& trainer, const std::map<std::string, at::Tensor>& expected,
                    const std::string& name, double tolerance) {
  const std::string dir = shared_dir("weights_" + name);
  trainer.save(dir + "/ckpt");
  if (test::world()->rank() == 0) {
    train::consolidate_checkpoint(dir + "/ckpt", dir + "/model.safetensors");
    SafetensorsFile f(dir + "/model.safetensors");
    EXPECT_EQ(f.names().size(), expected.size());
    for (const auto& [param, value] : expected)
      EXPECT_LE(test::rel_error(f.read(param).to(at::kFloat), value), tolerance) << param;
  }
  test::world()->barrier();
}

// The trainer steps of `s` (as many as `expected` has) against the serial
// losses, gradient norms and rates (relative `tolerance`), the model's
// parameters in `dtype`; with `weights`, every parameter after the steps.
void expect_serial_steps(const Layout& s, const SerialSteps& expected, int64_t rows, double tolerance = kTolerance,
                         at::ScalarType dtype = at::kFloat, bool weights = false) {
  SCOPED_TRACE(s.name);
  auto ctx = context::ParallelContext::create(test::world(), s.parallel);
  Model r = make_run(ctx, s, 7, 0.0, false, dtype);
  for (int step = 0; step < static_cast<int>(expected.losses.size()); ++step) {
    auto [x, y] = batch(ctx, rows, step);
    const train::StepStats st = r.trainer->train_step(x, y);
    EXPECT_NEAR(st.loss, expected.losses[step], tolerance * expected.losses[step]) << "step " << step;
    EXPECT_NEAR(st.grad_norm, expected.norms[step], tolerance * expected.norms[step]) << "norm, step " << step;
    EXPECT_GT(st.grad_norm, 0.5) << "the test must clip";
    EXPECT_NEAR(st.lr, expected.lrs[step], 1e-12 * expected.lrs[step]) << "rate, step " << step;
    EXPECT_FALSE(st.skipped) << "step " << step;
    if (s.loss_scaling) EXPECT_DOUBLE_EQ(r.trainer->scaler()->current_scale(), 65536.0) << "step " << step;
  }
  if (weights) expect_weights(*r.trainer, expected.weights, s.name, tolerance);
}

// Five steps: two of warm-up and three of decay, the layouts taking cosine,
// linear and polynomial decay in turn; then every parameter.
TEST(Trainer, FiveStepsEqualSerial) {
  const int64_t rows = 12;
  const std::vector<train::LrDecay> decays = {train::LrDecay::kCosine, train::LrDecay::kLinear,
                                              train::LrDecay::kPolynomial};
  std::map<train::LrDecay, SerialSteps> expected;
  for (train::LrDecay d : decays) expected[d] = serial_steps(rows, d, 5);
  const auto all = layouts(test::world()->size());
  if (all.empty()) GTEST_SKIP() << "no trainer layout at " << test::world()->size() << " ranks";
  for (size_t i = 0; i < all.size(); ++i) {
    Layout s = all[i];
    s.decay = decays[i % decays.size()];
    s.name += "_" + train::lr_decay_name(s.decay);
    expect_serial_steps(s, expected.at(s.decay), rows, kTolerance, at::kFloat, /*weights=*/true);
  }
}

// bf16 parameters under a pipeline with dynamic loss scaling (the scale
// applied at the last stage, carried by the gradients between stages,
// removed before clipping) track the fp32 serial reference within bf16's
// precision: losses and gradient norms within 3 %. An unapplied or
// unremoved scale moves the norm by 2^16.
TEST(Trainer, PipelineBf16WithLossScalingTracksSerial) {
  const int n = test::world()->size();
  std::vector<Layout> cases;
  if (n == 2) cases = {{"pp2_bf16_scaled", ParallelConfig().pipeline(2), "ddp", 2, true}};
  if (n == 4) cases = {{"dp2_pp2_zero3_bf16_scaled", ParallelConfig().data(2).pipeline(2), "zero3", 2, true}};
  if (cases.empty()) GTEST_SKIP() << "runs at 2 and 4 ranks";
  const int64_t rows = 12;
  const SerialSteps expected = serial_steps(rows);
  for (const Layout& s : cases) expect_serial_steps(s, expected, rows, 0.03, at::kBFloat16);
}

// ZeRO-3 under a pipeline gathers one stage's parameters at a time (Note
// [ZeRO-3 under a pipeline]): with two stages per rank (interleaved), the
// most parameter and gradient bytes the module held during a step are its
// shards, the full gradients it accumulates and one stage's full
// parameters, not both stages'. A peak above that bound fails; the lower
// bound shows a stage was gathered at all. Both as the module counts them
// and as the allocator does.
TEST(Trainer, Zero3UnderAPipelineGathersOneStageAtATime) {
  if (test::world()->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const Layout s{"dp2_pp2_zero3_interleaved", ParallelConfig().data(2).pipeline(2), "zero3", 2, false, 2};
  auto ctx = context::ParallelContext::create(test::world(), s.parallel);
  // Buckets of up to 1 MiB hold a stage each, so that every parameter and
  // gradient buffer is a block of at least 32 KiB, which the allocator
  // watches apart from the step's activations (at most 25 KiB each here).
  auto& counter = test::CountingAllocator::instance();
  test::CountingScope counting;
  counter.watch(32 << 10);
  // On the CPU whatever the test device: the counting allocator is the CPU's.
  Model r = make_run(ctx, s, 7, 0.0, false, at::kFloat, 1 << 20, c10::Device(c10::kCPU));
  const auto* pipe = r.trainer->pipeline();
  ASSERT_NE(pipe, nullptr);
  auto& module = r.trainer->module();
  const int dp = ctx->size(ParallelMode::kData);
  int64_t shards = 0, full_grads = 0;
  for (size_t b = 0; b < module.num_buckets(); ++b) {
    const auto& bucket = module.bucket(b);
    ASSERT_TRUE(bucket.materialized());
    shards += 2 * bucket.numel() / dp * bucket.element_size();  // parameter and gradient shards
    full_grads += bucket.numel() * bucket.element_size();
  }
  // Each local stage's full parameters (4 bytes each), and the padding a
  // bucket may add (< dp elements per bucket).
  const auto layers = r.gpt->as_sequential();
  const auto& bounds = pipe->stage_bounds();
  std::vector<int64_t> stage_bytes, stage_watched;  // all, and in layers of at least 32 KiB (the blocks)
  for (int st = 0; st + 1 < static_cast<int>(bounds.size()); ++st) {
    if (pipe->schedule().rank_of(st) != ctx->comm(ParallelMode::kPipeline)->rank()) continue;
    std::set<const c10::TensorImpl*> seen;
    int64_t bytes = 0, watched = 0;
    for (int64_t i = bounds[st]; i < bounds[st + 1]; ++i) {
      int64_t layer = 0;
      for (const auto& p : layers->ptr(i)->parameters())
        if (seen.insert(p.unsafeGetTensorImpl()).second) layer += p.numel() * 4;
      bytes += layer;
      if (layer >= (32 << 10)) watched += layer;
    }
    stage_bytes.push_back(bytes);
    stage_watched.push_back(watched);
  }
  ASSERT_EQ(stage_bytes.size(), 2u);
  const int64_t padding = static_cast<int64_t>(module.num_buckets()) * dp * 4 * 3;
  const int64_t one_stage = *std::max_element(stage_bytes.begin(), stage_bytes.end());
  const int64_t smaller = *std::min_element(stage_bytes.begin(), stage_bytes.end());
  ASSERT_GT(smaller, 2 * padding) << "the stages must differ from one by more than the slack";
  for (int step = 0; step < 2; ++step) {
    module.reset_peak_bytes();
    counter.reset_peak();
    const int64_t held = counter.watched_live();
    auto [x, y] = batch(ctx, 12, step);
    r.trainer->train_step(x, y);
    // The allocator's view of the same claim: at the step's peak, the
    // blocks' full gradients (every local stage's, accumulated) and the
    // gathered parameters of one stage, not of both.
    const int64_t grads = stage_watched[0] + stage_watched[1];
    const int64_t rise = counter.watched_peak() - held;
    EXPECT_LE(rise, grads + std::max(stage_watched[0], stage_watched[1])) << "allocator, step " << step;
    EXPECT_GE(rise, grads + std::min(stage_watched[0], stage_watched[1])) << "allocator, step " << step;
    EXPECT_LE(module.peak_bytes(), shards + full_grads + one_stage + padding) << "step " << step;
    EXPECT_GE(module.peak_bytes(), shards + full_grads + smaller - padding) << "step " << step;
    EXPECT_EQ(module.memory().params, shards / 2) << "full parameters left gathered after step " << step;
  }
}

// Evaluation under a pipeline runs the forward-only schedule: the serial
// loss, no backward action, no gradient message (only the activations'
// headers and payloads cross the pipeline group: half a training step's
// messages), no gradient reduction over the data group (only the loss's
// mean), and the gradients left as they were.
TEST(Trainer, PipelineEvaluationRunsNoBackward) {
  const int n = test::world()->size();
  std::vector<Layout> cases;
  if (n == 2) cases = {{"pp2", ParallelConfig().pipeline(2), "ddp", 2}};
  if (n == 4) cases = {{"dp2_pp2_zero3_interleaved", ParallelConfig().data(2).pipeline(2), "zero3", 2, false, 2}};
  if (cases.empty()) GTEST_SKIP() << "runs at 2 and 4 ranks";
  const int64_t rows = 12;
  const SerialSteps expected = serial_steps(rows);
  for (const Layout& s : cases) {
    SCOPED_TRACE(s.name);
    auto trace = std::make_shared<comm::CommTrace>();
    auto world = std::make_shared<comm::TracingCommunicator>(test::world(), trace);
    auto ctx = context::ParallelContext::create(world, s.parallel);
    Model r = make_run(ctx, s, 7, 0.0, false);
    const std::string pipe_group = ctx->comm(ParallelMode::kPipeline)->name();
    const std::string data_group = ctx->comm(ParallelMode::kData)->name();
    auto [x, y] = batch(ctx, rows, 0);
    auto messages = [&] {
      at::Tensor c = at::tensor({trace->get(pipe_group, comm::OpType::kSend).calls}, at::kLong);
      test::world()->all_reduce(c);
      return c.item<int64_t>();
    };
    trace->reset();
    const double loss = r.trainer->evaluate(x, y);
    EXPECT_NEAR(loss, expected.losses[0], kTolerance * expected.losses[0]);
    const auto* stats = &r.trainer->pipeline()->last_stats();
    EXPECT_EQ(stats->count[static_cast<int>(parallel::ActionKind::kForward)], s.microbatches * s.chunks);
    for (auto kind : {parallel::ActionKind::kBackward, parallel::ActionKind::kBackwardInput,
                      parallel::ActionKind::kBackwardWeight})
      EXPECT_EQ(stats->count[static_cast<int>(kind)], 0);
    // Over all pipelines: a header and a payload per activation.
    const int pipelines = ctx->size(ParallelMode::kData), stages = 2 * s.chunks;
    EXPECT_EQ(messages(), pipelines * 2 * s.microbatches * (stages - 1));
    EXPECT_EQ(trace->get(data_group, comm::OpType::kReduceScatter).calls, 0);
    if (ctx->size(ParallelMode::kData) > 1) {
      EXPECT_EQ(trace->get(data_group, comm::OpType::kAllReduce).calls, 1) << "the loss's mean only";
      EXPECT_EQ(trace->get(data_group, comm::OpType::kAllReduce).bytes, 8);
    }
    // The gradients of a training step stay as they were.
    trace->reset();
    r.trainer->train_step(x, y);
    EXPECT_EQ(messages(), pipelines * 4 * s.microbatches * (stages - 1)) << "a training step also sends the gradients";
    std::vector<at::Tensor> before;
    for (const auto& p : r.gpt->parameters()) before.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    r.trainer->evaluate(x, y);
    size_t i = 0;
    for (const auto& p : r.gpt->parameters()) {
      const at::Tensor& g = before[i++];
      EXPECT_EQ(p.grad().defined(), g.defined());
      if (g.defined()) EXPECT_TRUE(p.grad().equal(g));
    }
  }
}

// Control traffic (Note [Control traffic]) takes each group's host channel
// and nothing else does: over a training step, an evaluation and a
// checkpoint save, the device channels carry only tensors of the model
// (payloads of exactly the activation's size, no header, no loss), and the
// control channels carry only the headers, the loss's broadcast and mean,
// and the save's flags, descriptions and barrier. Under NCCL the device
// channel refuses host tensors, so a scalar moved back onto it fails there.
TEST(Trainer, ControlTrafficTakesTheHostChannel) {
  const int n = test::world()->size();
  std::vector<Layout> cases;
  if (n == 2)
    cases = {{"pp2", ParallelConfig().pipeline(2), "ddp", 2}, {"dp2_zero3", ParallelConfig().data(2), "zero3"}};
  if (n == 4) cases = {{"dp2_pp2_zero3", ParallelConfig().data(2).pipeline(2), "zero3", 2}};
  if (cases.empty()) GTEST_SKIP() << "runs at 2 and 4 ranks";
  const int64_t rows = 12, header_bytes = 13 * 8;  // the executor's header: 13 int64 fields
  for (const Layout& s : cases) {
    SCOPED_TRACE(s.name);
    auto device = std::make_shared<comm::CommTrace>(), control = std::make_shared<comm::CommTrace>();
    auto world = std::make_shared<comm::TracingCommunicator>(test::world(), device, control);
    auto ctx = context::ParallelContext::create(world, s.parallel);
    Model r = make_run(ctx, s, 7, 0.0, false);
    const int dp = ctx->size(ParallelMode::kData), pp = ctx->size(ParallelMode::kPipeline);
    const std::string pipe = ctx->comm(ParallelMode::kPipeline)->name();
    const std::string data = ctx->comm(ParallelMode::kData)->name();
    // Summed over the world.
    auto sum = [](int64_t v) {
      at::Tensor t = at::tensor({v}, at::kLong);
      test::world()->all_reduce(t);
      return t.item<int64_t>();
    };
    // Pipeline messages of one pass (activations, or gradients) over all pipelines.
    const int64_t messages = dp * s.microbatches * (pp - 1);
    const int64_t payload_bytes = rows / dp / s.microbatches * kSeq * config().hidden() * 4;
    auto expect_pass = [&](int64_t passes, int64_t data_means) {
      using comm::OpType;
      for (OpType op : {OpType::kSend, OpType::kRecv}) {
        EXPECT_EQ(sum(device->get(pipe, op).calls), passes * messages) << "payloads";
        EXPECT_EQ(sum(device->get(pipe, op).bytes), passes * messages * payload_bytes) << "payloads only";
        EXPECT_EQ(sum(control->get(pipe, op).calls), passes * messages) << "headers";
        EXPECT_EQ(sum(control->get(pipe, op).bytes), passes * messages * header_bytes) << "headers";
      }
      EXPECT_EQ(device->get(pipe, OpType::kBroadcast).calls, 0) << "the loss is a host scalar";
      const int64_t broadcasts = pp > 1 ? 1 : 0;
      EXPECT_EQ(control->get(pipe, OpType::kBroadcast).calls, broadcasts) << "the loss from the last stage";
      EXPECT_EQ(control->get(pipe, OpType::kBroadcast).bytes, 8 * broadcasts);
      EXPECT_EQ(control->get(data, OpType::kAllReduce).calls, data_means) << "the loss's mean over data";
      EXPECT_EQ(control->get(data, OpType::kAllReduce).bytes, 8 * data_means);
      const int64_t mine = control->get(pipe, OpType::kSend).calls + control->get(pipe, OpType::kRecv).calls;
      EXPECT_EQ(control->total().calls, mine + broadcasts + data_means) << "nothing else on the host channels:\n"
                                                                        << control->to_string();
    };
    const int64_t means = dp > 1 ? 1 : 0;
    auto [x, y] = batch(ctx, rows, 0);
    device->reset();
    control->reset();
    r.trainer->train_step(x, y);
    {
      SCOPED_TRACE("train_step");
      expect_pass(2, means);
      if (dp > 1) {
        const int64_t reductions = device->get(data, comm::OpType::kReduceScatter).calls +
                                   device->get(data, comm::OpType::kAllReduce).calls;
        EXPECT_GT(reductions, 0) << "gradients reduce over data on the device channel";
      }
    }
    device->reset();
    control->reset();
    r.trainer->evaluate(x, y);
    {
      SCOPED_TRACE("evaluate");
      expect_pass(1, means);
    }
    device->reset();
    control->reset();
    r.trainer->save(shared_dir("control_" + s.name));
    EXPECT_EQ(device->total().calls, 0) << "a save moves host data only:\n" << device->to_string();
    EXPECT_GE(control->get(ctx->world()->name(), comm::OpType::kAllReduce).calls, 1) << "the directory's flag";
    EXPECT_GE(control->get(ctx->world()->name(), comm::OpType::kBarrier).calls, 1);
  }
}

// Data parallelism x 2D under the sharding specs not in layouts(8), and
// with another order of the grid's dimensions.
TEST(Trainer, DataTimes2DEqualsSerialUnderEverySpec) {
  if (test::world()->size() != 8) GTEST_SKIP() << "needs 8 ranks";
  const int64_t rows = 12;
  const SerialSteps expected = serial_steps(rows);
  for (const char* spec : {"ddp", "zero1", "zero3", "{R,P(2),S}", "hpz:2"})
    expect_serial_steps({std::string("dp2_2d4_") + spec,
                         ParallelConfig().data(2).tensor(4).tensor_mode(TensorMode::k2D), spec},
                        expected, rows, kTolerance, at::kFloat, /*weights=*/true);
  // Groups come from the grid whatever the order: data ranks adjacent here.
  expect_serial_steps({"dp2_2d4_zero2_data_inner",
                       ParallelConfig().data(2).tensor(4).tensor_mode(TensorMode::k2D).order("dp-tp-sp-pp"), "zero2"},
                      expected, rows, kTolerance, at::kFloat, /*weights=*/true);
}

// Sequence parallelism (every mode, both splits) with data, tensor and
// pipeline parallelism and ZeRO sharded over data x sequence.
TEST(Trainer, SequenceParallelEqualsSerial) {
  using context::SequenceMode;
  using context::SequenceSplit;
  const int n = test::world()->size();
  auto sp = [](SequenceMode mode, SequenceSplit split) {
    return ParallelConfig().sequence(2).sequence_mode(mode).sequence_split(split);
  };
  std::vector<Layout> cases;
  if (n == 4) {
    cases = {{"sp2_dp2_ring_zigzag_zero2", sp(SequenceMode::kRing, SequenceSplit::kZigzag).data(2), "zero2"},
             {"sp2_tp2_ulysses", sp(SequenceMode::kUlysses, SequenceSplit::kContiguous).tensor(2), "ddp"},
             {"sp4_rsa_zero3", sp(SequenceMode::kRsa, SequenceSplit::kContiguous).sequence(4), "zero3"}};
  } else if (n == 8) {
    cases = {{"sp2_pp2_dp2_ring_zero2", sp(SequenceMode::kRing, SequenceSplit::kContiguous).pipeline(2).data(2),
              "zero2", 2},
             {"sp2_dp2_tp2_rsa_zigzag", sp(SequenceMode::kRsa, SequenceSplit::kZigzag).data(2).tensor(2),
              "{R,P(2),S}"},
             {"sp2_pp2_tp2_ulysses_zigzag", sp(SequenceMode::kUlysses, SequenceSplit::kZigzag).pipeline(2).tensor(2),
              "ddp", 2},
             {"sp4_dp2_ring_zigzag_zero3", sp(SequenceMode::kRing, SequenceSplit::kZigzag).sequence(4).data(2), "zero3"},
             {"sp2_tp4_ring", sp(SequenceMode::kRing, SequenceSplit::kContiguous).tensor(4), "zero2"}};
  } else {
    GTEST_SKIP() << "runs at 4 and 8 ranks";
  }
  const int64_t rows = 12;
  const SerialSteps expected = serial_steps(rows);
  for (const Layout& s : cases) expect_serial_steps(s, expected, rows, kTolerance, at::kFloat, /*weights=*/true);
}

TEST(Checkpoint, ResumeReproducesLossesBitForBit) {
  auto world = test::world();
  const int64_t rows = 12;
  const int saved_at = 3, steps = 6;  // saved mid-decay; the resumed steps cross its end (kDecayEnd)
  auto cases = layouts(world->size());
  // Optimizer states on disk: a save brings them in, a load sends them back.
  cases.push_back({"dp_zero2_disk", ParallelConfig().data(world->size()), "zero2", 1, false, 1, true});
  for (const Layout& s : cases) {
    SCOPED_TRACE(s.name);
    const std::string dir = shared_dir("resume_" + s.name) + "/step-" + std::to_string(saved_at);
    auto ctx = context::ParallelContext::create(world, s.parallel);
    std::vector<double> after;
    {
      Model a = make_run(ctx, s, 7, 0.1, true);
      for (int step = 0; step < saved_at; ++step) {
        auto [x, y] = batch(ctx, rows, step);
        a.trainer->train_step(x, y);
      }
      a.trainer->save(dir, fmt::format(R"({{"next_step": {}}})", saved_at));
      for (int step = saved_at; step < steps; ++step) {
        auto [x, y] = batch(ctx, rows, step);
        after.push_back(a.trainer->train_step(x, y).loss);
      }
    }
    torch::manual_seed(99);  // the loaded RNG state must take over
    Model b = make_run(ctx, s, 1234, 0.1, true);
    const std::string extra = b.trainer->load(dir);
    EXPECT_EQ(extra, fmt::format(R"({{"next_step":{}}})", saved_at));
    EXPECT_EQ(b.trainer->step(), saved_at);
    for (int step = saved_at; step < steps; ++step) {
      auto [x, y] = batch(ctx, rows, step);
      EXPECT_EQ(b.trainer->train_step(x, y).loss, after[step - saved_at]) << "step " << step;
    }
  }
}

// Saves `source` after 3 steps, then loads it in every layout of `targets`
// and in one process: the whole state (every parameter, AdamW moment and
// step count) bit for bit against the saver's own pieces, assembled apart
// from the checkpoint (saved_state.h); the same evaluation loss, and the
// same loss after one more step from the loaded optimizer state. With
// `consolidate`, the consolidated file must equal the full weights and the
// saver's own tensors too.
void check_reshard(const Layout& source, const std::vector<Layout>& targets, const std::string& what,
                   bool consolidate) {
  auto world = test::world();
  const int64_t rows = 8;
  const std::string dir = shared_dir(what) + "/ckpt";
  auto [x0, y0] = std::make_pair(ids(rows, 500), ids(rows, 600));  // the global evaluation batch
  auto [x1, y1] = std::make_pair(ids(rows, 501), ids(rows, 601));  // one more training batch
  auto local = [](const context::ParallelContextPtr& ctx, const at::Tensor& t) {
    auto data = ctx->comm(ParallelMode::kData);
    const int64_t n = t.size(0) / data->size();
    return t.narrow(0, data->rank() * n, n);
  };
  double loss_saved = 0, loss_stepped = 0;
  std::map<std::string, at::Tensor> saved;  // the saver's whole state, assembled apart from the checkpoint
  {
    auto ctx = context::ParallelContext::create(world, source.parallel);
    Model a = make_run(ctx, source, 7, 0.0, true);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(ctx, rows, step);
      a.trainer->train_step(x, y);
    }
    a.trainer->save(dir);
    saved = test::gather_state(a.trainer->state_pieces(), shared_dir(what) + "/saved_state");
    loss_saved = a.trainer->evaluate(local(ctx, x0), local(ctx, y0));
    a.trainer->train_step(local(ctx, x1), local(ctx, y1));
    loss_stepped = a.trainer->evaluate(local(ctx, x0), local(ctx, y0));
  }
  for (const Layout& s : targets) {
    SCOPED_TRACE(source.name + " -> " + s.name);
    auto ctx = context::ParallelContext::create(world, s.parallel);
    Model b = make_run(ctx, s, 1234, 0.0, true);
    b.trainer->load(dir);
    test::expect_state_equal(b.trainer->state_pieces(), saved);
    EXPECT_NEAR(b.trainer->evaluate(local(ctx, x0), local(ctx, y0)), loss_saved, kTolerance * loss_saved);
    b.trainer->train_step(local(ctx, x1), local(ctx, y1));
    EXPECT_NEAR(b.trainer->evaluate(local(ctx, x0), local(ctx, y0)), loss_stepped, kTolerance * loss_stepped);
  }
  // One process (each rank alone), and the consolidated file against its full weights.
  SCOPED_TRACE(source.name + " -> one process");
  auto self = world->split(world->rank(), 0, "self");
  auto ctx = context::ParallelContext::create(self, ParallelConfig());
  Model c = make_run(ctx, {"single", ParallelConfig(), "ddp"}, 1234, 0.0, true);
  c.trainer->load(dir);
  test::expect_state_equal(c.trainer->state_pieces(), saved);
  EXPECT_NEAR(c.trainer->evaluate(x0, y0), loss_saved, kTolerance * loss_saved);
  if (consolidate) {
    const std::string file = shared_dir("consolidated") + "/model.safetensors";
    if (world->rank() == 0) {
      train::consolidate_checkpoint(dir, file);
      SafetensorsFile f(file);
      const auto full = c.gpt->full_state();
      EXPECT_EQ(f.names().size(), full.size());
      std::ofstream sums(file + ".sums.json");
      sums << "{";
      bool first = true;
      for (const auto& [name, value] : full) {
        ASSERT_TRUE(f.contains(name)) << name;
        EXPECT_TRUE(f.read(name).equal(value.cpu())) << name;
        EXPECT_TRUE(f.read(name).equal(saved.at("model/" + name))) << name << " against the saver's own";
        sums << (first ? "" : ", ") << "\"" << name << "\": " << std::setprecision(17) << value.sum().item<double>();
        first = false;
      }
      sums << "}\n";
    }
    world->barrier();
  }
  c.trainer->train_step(x1, y1);
  EXPECT_NEAR(c.trainer->evaluate(x0, y0), loss_stepped, kTolerance * loss_stepped);
}

// Random streams round trip through a checkpoint (Note [Random states in
// checkpoints]); a stream of a device this process lacks (a GPU run resumed
// on a CPU machine) is reported by name, not restored and not an error;
// a dropout stream of a layer the module lacks, or misnamed, is refused.
TEST(Checkpoint, RandomStatesRoundTripAndAbsentDevicesAreReported) {
  if (at::hasCUDA()) GTEST_SKIP() << "checks a process without CUDA";
  auto world = test::world();
  const int rank = world->rank();
  const std::string prefix = "rng/" + std::to_string(rank) + "/";
  torch::nn::Sequential m(nn::ParallelDropout(nn::ParallelDropoutOptions(0.5, 11 + rank)));
  m->train();
  const at::Tensor ones = at::ones({256});
  m->forward(ones);  // the layer's CPU stream exists and has advanced
  std::vector<train::TensorPiece> pieces = train::random_state_pieces(*m, rank);
  std::vector<std::string> names;
  for (const auto& p : pieces) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{prefix + "cpu", prefix + "dropout/0/cpu"}));
  const at::Tensor mask = m->forward(ones), draw = at::rand({8});  // what follows the saved states
  for (const std::string device_stream : {"cuda:0", "dropout/0/cuda:0"}) {
    train::TensorPiece cuda;  // as a GPU run saves them: Philox seed and offset
    cuda.name = prefix + device_stream;
    cuda.data = at::zeros({16}, at::kByte);
    cuda.full_shape = {16};
    pieces.push_back(cuda);
  }
  const std::string dir = shared_dir("rng") + "/ckpt";
  train::save_checkpoint(dir, pieces, "{}", world);
  m->forward(ones);
  at::rand({8});
  infer::CheckpointReader reader(dir);
  EXPECT_EQ(train::load_random_state_pieces(reader, *m, rank),
            (std::vector<std::string>{prefix + "cuda:0", prefix + "dropout/0/cuda:0"}));
  EXPECT_TRUE(m->forward(ones).equal(mask)) << "the dropout stream is restored";
  EXPECT_TRUE(at::rand({8}).equal(draw)) << "the default CPU generator is restored";

  torch::nn::Sequential none(torch::nn::Identity{});
  EXPECT_TRUE(test::throws_with([&] { train::load_random_state_pieces(reader, *none, rank); },
                                "holds the random stream of dropout layer 0 but the module has 0 dropout layers"));

  train::TensorPiece odd = pieces.front();
  odd.name = prefix + "dropout/first/cpu";
  const std::string bad = shared_dir("rng_bad") + "/ckpt";
  train::save_checkpoint(bad, {odd}, "{}", world);
  infer::CheckpointReader bad_reader(bad);
  EXPECT_TRUE(test::throws_with([&] { train::load_random_state_pieces(bad_reader, *m, rank); },
                                "is not named dropout/<layer>/<device>"));

  // A generator takes its state as bytes in host memory (an elastic move
  // delivers pieces on the model's device: they are copied back first).
  train::TensorPiece floats = pieces.front();
  floats.data = floats.data.to(at::kFloat);
  const std::string wrong = shared_dir("rng_dtype") + "/ckpt";
  train::save_checkpoint(wrong, {floats}, "{}", world);
  infer::CheckpointReader wrong_reader(wrong);
  EXPECT_TRUE(test::throws_with([&] { train::load_random_state_pieces(wrong_reader, *m, rank); },
                                "holds Float values, but a generator's state is bytes"));
}

// Saved at dp2 x pp2 x tp2, loaded at dp4 x tp2, tp4 x dp2, 2D x dp2, pp4 x dp2 and in one process.
TEST(Checkpoint, ReshardsAcrossConfigurations) {
  if (test::world()->size() != 8) GTEST_SKIP() << "needs 8 ranks";
  check_reshard(layouts(8)[0],
                {{"dp4_tp2", ParallelConfig().data(4).tensor(2), "zero2"},
                 {"tp4_dp2", ParallelConfig().tensor(4).data(2), "zero3"},
                 {"pp4_dp2_zero1", ParallelConfig().pipeline(4).data(2), "zero1", 4},
                 {"2d4_dp2", ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D).data(2), "zero2"}},
                "reshard", /*consolidate=*/true);
}

// Saved in 2.5D (q 2, depth 2) under ZeRO-3, loaded as 1D tp4 x dp2 and in one process.
TEST(Checkpoint, TwoPointFiveDLoadsAs1DAndInOneProcess) {
  if (test::world()->size() != 8) GTEST_SKIP() << "needs 8 ranks";
  check_reshard(layouts(8)[3], {{"tp4_dp2", ParallelConfig().tensor(4).data(2), "zero2"}}, "reshard_2p5d",
                /*consolidate=*/false);
}

// Saved in 3D (q 2), loaded as 2D x dp2 and in one process.
TEST(Checkpoint, ThreeDLoadsAs2DAndInOneProcess) {
  if (test::world()->size() != 8) GTEST_SKIP() << "needs 8 ranks";
  check_reshard(layouts(8)[4], {{"2d4_dp2", ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D).data(2), "zero2"}},
                "reshard_3d", /*consolidate=*/false);
}

TEST(Checkpoint, BadInputIsRefused) {
  auto world = test::world();
  const Layout s = layouts(world->size())[0];
  auto ctx = context::ParallelContext::create(world, s.parallel);
  Model a = make_run(ctx, s, 7, 0.0, false);
  EXPECT_TRUE(test::throws_with([&] { a.trainer->load("no_such_checkpoint"); }, "does not exist"));
  const std::string dir = shared_dir("bad") + "/small";
  a.trainer->save(dir);
  // Another model: a wider GPT finds every tensor with another shape.
  torch::manual_seed(7);
  auto wide_config = config();
  wide_config.hidden() *= 2;
  auto gpt = std::make_shared<models::GPTImpl>(wide_config,
                                               nn::make_1d_factory(ctx->comm(ParallelMode::kTensor), false, 1, 2));
  train::Trainer wide(
      ctx, train::gpt_train_model(gpt),
      [](const std::vector<std::pair<std::string, at::Tensor>>& n) {
        std::vector<at::Tensor> p;
        for (const auto& e : n) p.push_back(e.second);
        return std::make_shared<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
      },
      train::TrainerOptions()
          .spec(parallel::ShardingSpec::parse(s.spec))
          .pipeline(parallel::PipelineOptions().microbatches(s.microbatches)));
  EXPECT_TRUE(test::throws_with([&] { wide.load(dir); }, "has shape"));
  // Another optimizer: AdamW cannot take SGD's states.
  Model adamw = make_run(ctx, s, 7, 0.0, true);
  EXPECT_TRUE(test::throws_with([&] { adamw.trainer->load(dir); }, "holds the states of optimizer 'sgd'"));
  // A save that did not finish.
  if (world->rank() == 0) std::filesystem::create_directories(dir + "-2.partial");
  world->barrier();
  EXPECT_TRUE(test::throws_with([&] { a.trainer->load(dir + "-2"); }, "did not finish"));
  EXPECT_TRUE(test::throws_with([&] { a.trainer->load(dir + "-2.partial"); }, "did not finish"));
  // Options.
  EXPECT_TRUE(test::throws_with([] { train::LrSchedule().peak(-1).validate(); }, "peak must be >= 0"));
  EXPECT_TRUE(test::throws_with(
      [] { train::LrSchedule().decay(train::LrDecay::kCosine).warmup_steps(5).total_steps(3).validate(); },
      "must exceed warmup_steps"));
}

TEST(Safetensors, RoundTripsEveryDtype) {
  const std::string path = shared_dir("safetensors") + "/all.safetensors";
  if (test::world()->rank() != 0) return;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto t : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong, at::kInt, at::kByte, at::kBool})
    tensors.emplace_back(std::string("t_") + c10::toString(t), test::seeded_randn({3, 5}, 1).mul(10).to(t));
  tensors.emplace_back("scalar", at::tensor(3.5));
  tensors.emplace_back("empty", at::zeros({0, 4}));
  write_safetensors(path, tensors, {{"k", "v"}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("k"), "v");
  for (const auto& [name, t] : tensors) EXPECT_TRUE(f.read(name).equal(t)) << name;
  // A flipped byte: the tensor's checksum refuses it (Note [Tensor checksums]).
  {
    const auto loc = f.location("t_Float");
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(loc.offset + 5);
    const char byte = static_cast<char>(io.get() ^ 0x40);
    io.seekp(loc.offset + 5);
    io.put(byte);
  }
  EXPECT_TRUE(test::throws_with([&] { SafetensorsFile(path).read("t_Float"); }, "is damaged: tensor 't_Float'"));
  EXPECT_TRUE(SafetensorsFile(path).read("t_Double").equal(tensors[1].second));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  EXPECT_TRUE(test::throws_with([&] { SafetensorsFile g(path); }, "outside the file"));
}

}  // namespace
}  // namespace tessera
