// PipelineExecutor on tessera's GPT against the serial reference GPT
// (tests/reference_gpt.h: plain LibTorch, nothing from tessera) with the same
// initial weights: every schedule, at the world's pipeline size (1, 2, 4
// ranks), with 1, p and 2p + 1 micro-batches: the loss of 3 SGD-momentum
// steps, the gradients of the first and the parameters after the last, within
// 1e-5 relative (fp32). Every schedule also moves activations far above MPI's
// eager limits and gives the serial gradients. Bad input is refused with its value.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "reference_gpt.h"
#include "support/counting_allocator.h"

#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/parallel/pipeline_executor.h"
#include "tessera/parallel/pipeline_partition.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/whole_norms.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

namespace tessera {
namespace {

using parallel::PipelineExecutor;
using parallel::PipelineOptions;
using parallel::ScheduleKind;

constexpr int kSteps = 3;
constexpr int64_t kSeq = 8;
constexpr double kTolerance = 1e-5;

// 6 blocks: 8 layers in sequence, enough for 4 ranks x 2 chunks.
models::GPTConfig config() {
  auto c = models::GPTConfig::preset("tiny");
  c.layers(6);
  return c;
}

std::shared_ptr<nn::LayerFactory> factory(const comm::CommunicatorPtr& group) {
  return nn::make_1d_factory(group, false, 1234, 5678);
}

at::Tensor ids(int64_t rows, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(config().vocab(), {rows, kSeq}, gen, at::kLong).to(test::device());
}

// SGD with momentum, not AdamW: c_attn's key bias has an exactly zero
// gradient (softmax ignores a shift shared by all keys), and Adam turns the
// rounding noise there into full-size steps that differ with the summation
// order of micro-batches. SGD is still sensitive to a wrong loss scale.
torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01); }

// The full weights of tessera's GPT built with torch::manual_seed(7), as every
// pipelined GPT here is (its initialisation gives the same full weights
// whatever the layout): the serial reference starts from them. Tessera's GPT
// serves as the source of weights only (on the CPU: load_full_state copies them).
std::map<std::string, at::Tensor> initial_weights() {
  auto w = test::world();
  torch::manual_seed(7);
  models::GPT source(config(), factory(w->split(w->rank(), 0, "self")));
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : source->full_state()) out[entry.first] = entry.second.clone();
  return out;
}

// The serial reference GPT with those weights.
test::ReferenceGPT reference_gpt() {
  test::ReferenceGPT gpt(test::reference_config(config()));
  gpt->to(test::device());
  gpt->load_full_state(initial_weights());
  return gpt;
}

// Keyed by full-state names ("h.0.attn.c_attn.weight", Note [GPT full weights]).
struct SerialRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> first_grads, params;
};

SerialRun serial_run(int64_t rows) {
  test::ReferenceGPT gpt = reference_gpt();
  torch::optim::SGD opt(gpt->parameters(), sgd());
  SerialRun run;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor loss = gpt->loss(gpt->forward(ids(rows, 10 + step)), ids(rows, 20 + step));
    loss.backward();
    if (step == 0) run.first_grads = gpt->full_state(/*gradients=*/true);
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  run.params = gpt->full_state();
  return run;
}

// Each local parameter of the pipeline under its full-state name, as tessera's
// GPT names its parameters in placements() (the names of full_state(), Note
// [GPT full weights]); found by storage, so the module names inside the
// layers do not matter. A parameter the GPT does not name fails the lookup
// that follows.
std::map<std::string, at::Tensor> local_named(const PipelineExecutor& pipe, models::GPT& gpt) {
  std::map<const void*, std::string> names;
  for (const auto& entry : gpt->placements()) names[entry.second.param.data_ptr()] = entry.first;
  std::map<std::string, at::Tensor> out;
  for (const auto& layer : pipe.local_layers()) {
    for (const auto& p : layer.second->named_parameters()) {
      const auto it = names.find(p.value().data_ptr());
      out[it != names.end() ? it->second : "<not in GPT::placements(): " + layer.first + "." + p.key() + ">"] =
          p.value();
    }
  }
  return out;
}

context::ParallelContextPtr pipeline_context() {
  return context::ParallelContext::create(test::world(), context::ParallelConfig().pipeline(test::world()->size()));
}

struct Case {
  ScheduleKind kind;
  int chunks;
};

class PipelineSchedules : public ::testing::TestWithParam<Case> {};

// 3 steps of the pipelined GPT with m micro-batches against the serial GPT.
void expect_matches_serial(const context::ParallelContextPtr& ctx, int m, PipelineOptions options) {
  const int64_t rows = 2 * m;
  const SerialRun serial = serial_run(rows);
  torch::manual_seed(7);
  models::GPT gpt(config(), factory(ctx->comm(context::ParallelMode::kTensor)));
  gpt->to(test::device());
  if (options.partition() == parallel::PartitionMethod::kMeasuredTime) options.sample(ids(2, 99));
  PipelineExecutor pipe(
      gpt->as_sequential(), ctx, [&](const at::Tensor& out, const at::Tensor& y) { return gpt->loss(out, y); },
      options.microbatches(m));
  torch::optim::SGD opt(pipe.parameters(), sgd());
  const auto named = local_named(pipe, gpt);
  ASSERT_FALSE(named.empty());
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    const double loss = pipe.run(ids(rows, 10 + step), ids(rows, 20 + step));
    EXPECT_NEAR(loss, serial.losses[step], kTolerance * serial.losses[step]) << "step " << step;
    if (step == 0) {
      for (const auto& [name, param] : named) {
        ASSERT_TRUE(param.grad().defined()) << name;
        EXPECT_LE(test::rel_error(param.grad(), serial.first_grads.at(name)), kTolerance) << "gradient " << name;
      }
    }
    opt.step();
  }
  for (const auto& [name, param] : named)
    EXPECT_LE(test::rel_error(param.detach(), serial.params.at(name)), kTolerance) << "parameter " << name;
}

TEST_P(PipelineSchedules, ThreeStepsOfGPTEqualSerial) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "the pure pipeline runs at 1, 2 and 4 ranks; 8 is the composed test";
  auto ctx = pipeline_context();
  // ZB-V: its handcrafted order from 2p - 1 micro-batches on (2p and 4p),
  // the list scheduler's below (1). DualPipeV: 2p and 4p (it needs 2p).
  const ScheduleKind kind = GetParam().kind;
  const std::vector<int> counts = kind == ScheduleKind::kZeroBubbleV ? std::vector<int>{1, 2 * p, 4 * p}
                                  : kind == ScheduleKind::kDualPipeV ? std::vector<int>{2 * p, 4 * p}
                                                                     : std::vector<int>{1, p, 2 * p + 1};
  for (int m : counts) {
    SCOPED_TRACE("micro-batches " + std::to_string(m));
    expect_matches_serial(ctx, m, PipelineOptions().schedule(GetParam().kind).chunks(GetParam().chunks));
  }
}

// Global gradient clipping over the pipeline: each rank's parameters once
// (the tied embedding counted on the first stage only), the squares summed
// over the pipeline group, equal to clipping the serial GPT.
TEST(PipelineClipping, GlobalNormOverStagesEqualsSerial) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "runs at 1, 2 and 4 ranks";
  constexpr double kMax = 0.5;
  const int64_t rows = 2 * p;
  test::ReferenceGPT serial = reference_gpt();
  torch::optim::SGD serial_opt(serial->parameters(), sgd());
  auto ctx = pipeline_context();
  torch::manual_seed(7);
  models::GPT gpt(config(), factory(ctx->comm(context::ParallelMode::kTensor)));
  gpt->to(test::device());
  PipelineExecutor pipe(
      gpt->as_sequential(), ctx, [&](const at::Tensor& out, const at::Tensor& y) { return gpt->loss(out, y); },
      PipelineOptions().microbatches(p));
  torch::optim::SGD opt(pipe.parameters(), sgd());
  for (int step = 0; step < kSteps; ++step) {
    serial_opt.zero_grad();
    serial->loss(serial->forward(ids(rows, 10 + step)), ids(rows, 20 + step)).backward();
    const double expected = torch::nn::utils::clip_grad_norm_(serial->parameters(), kMax);
    serial_opt.step();
    opt.zero_grad();
    pipe.run(ids(rows, 10 + step), ids(rows, 20 + step));
    const double norm =
        parallel::clip_grad_norm(pipe.unique_parameters(), kMax, nullptr, {pipe.group()}, pipe.tied_copies());
    EXPECT_NEAR(norm, expected, kTolerance * expected) << "step " << step;
    EXPECT_GT(norm, kMax) << "the test must clip";
    opt.step();
  }
  const auto named = local_named(pipe, gpt);
  const std::map<std::string, at::Tensor> reference = serial->full_state();
  for (const auto& [name, param] : named)
    EXPECT_LE(test::rel_error(param.detach(), reference.at(name)), kTolerance) << name;
}

// Other cuts of the same model train the same.
TEST(PipelinePartitions, ParameterCountMeasuredTimeAndSizesEqualSerial) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "runs at 1, 2 and 4 ranks";
  auto ctx = pipeline_context();
  using parallel::PartitionMethod;
  expect_matches_serial(ctx, p, PipelineOptions().partition(PartitionMethod::kParameterCount));
  expect_matches_serial(ctx, p, PipelineOptions().partition(PartitionMethod::kMeasuredTime));
  std::vector<int64_t> sizes(p, 1);
  sizes.back() = 8 - (p - 1);  // the 8 layers: one per stage, the rest on the last
  expect_matches_serial(ctx, p, PipelineOptions().partition(PartitionMethod::kSizes).stage_sizes(sizes));
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = parallel::to_string(info.param.kind);
  for (char& c : n)
    if (c == '-') c = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(All, PipelineSchedules,
                         ::testing::Values(Case{ScheduleKind::kGPipe, 1}, Case{ScheduleKind::k1F1B, 1},
                                           Case{ScheduleKind::kInterleaved1F1B, 2},
                                           Case{ScheduleKind::kZeroBubbleH1, 1}, Case{ScheduleKind::kZeroBubbleH2, 1},
                                           Case{ScheduleKind::kZeroBubbleV, 2}, Case{ScheduleKind::kDualPipeV, 2}),
                         case_name);

// The GPT full-state names ("h.3.attn.c_attn.weight") of a pipeline layer ("h3").
bool in_layers(const std::string& key, const std::vector<std::string>& layers) {
  for (const auto& l : layers) {
    std::vector<std::string> prefixes;
    if (l == "embed")
      prefixes = {"wte.", "wpe."};
    else if (l == "head")
      prefixes = {"ln_f.", "wte.", "lm_head."};
    else
      prefixes = {"h." + l.substr(1) + "."};
    for (const auto& p : prefixes)
      if (key.rfind(p, 0) == 0) return true;
  }
  return false;
}

// dp 2 x pp 2 x tp 2: GPT in 1D tensor parallelism, cut into two stages, the
// layers of each stage data-parallel under a sharding spec (the wrapper's
// reduction runs once after all micro-batches: reduce_gradients). The loss
// of every step and the full parameters after the first step (which carry
// the gradient: w1 = w0 - lr (g + wd w0)) and after the third equal serial.
TEST(PipelineComposition, DataPipelineTensorParallelGPTEqualsSerial) {
  auto world = test::world();
  if (world->size() != 8) GTEST_SKIP() << "needs 8 ranks (dp2 x pp2 x tp2)";
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().data(2).pipeline(2).tensor(2));
  auto data = ctx->comm(context::ParallelMode::kData);
  constexpr int kMicro = 3;
  const int64_t local_rows = 2 * kMicro, rows = local_rows * data->size();
  const SerialRun serial = serial_run(rows);
  for (const char* spec : {"ddp", "zero2", "{R,P(2),S}"}) {
    SCOPED_TRACE(spec);
    torch::manual_seed(7);
    models::GPT gpt(config(), factory(ctx->comm(context::ParallelMode::kTensor)));
    gpt->to(test::device());
    PipelineExecutor pipe(
        gpt->as_sequential(), ctx, [&](const at::Tensor& out, const at::Tensor& y) { return gpt->loss(out, y); },
        PipelineOptions().schedule(ScheduleKind::k1F1B).microbatches(kMicro));
    auto local = std::make_shared<torch::nn::Module>();
    std::vector<std::string> names;
    for (const auto& [name, layer] : pipe.local_layers()) {
      local->register_module(name, layer);
      names.push_back(name);
    }
    auto sharded = std::make_shared<parallel::ShardedModule>(
        local, ctx, parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::parse(spec)).bucket_bytes(4096));
    sharded->set_gradient_sync(false);
    parallel::ShardedOptimizer opt(sharded, std::make_shared<torch::optim::SGD>(pipe.parameters(), sgd()));
    auto compare = [&](const std::map<std::string, at::Tensor>& expected, const char* when) {
      std::map<std::string, at::Tensor> full;
      {
        auto gathered = sharded->full_params();
        // This rank's stages only: the others' layers were released (Note [Other stages released]).
        for (const auto& [key, placement] : gpt->placements())
          if (in_layers(key, names)) full[key] = nn::full_value(placement);
      }
      int compared = 0;
      for (const auto& [key, value] : full) {
        EXPECT_LE(test::rel_error(value, expected.at(key)), kTolerance) << key << " " << when;
        ++compared;
      }
      EXPECT_GT(compared, 0);
    };
    // The serial reference's full state after one step, for the gradient check.
    std::map<std::string, at::Tensor> after_first;
    {
      test::ReferenceGPT one = reference_gpt();
      torch::optim::SGD o(one->parameters(), sgd());
      one->loss(one->forward(ids(rows, 10)), ids(rows, 20)).backward();
      o.step();
      after_first = one->full_state();
    }
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      const at::Tensor x = ids(rows, 10 + step).narrow(0, data->rank() * local_rows, local_rows);
      const at::Tensor y = ids(rows, 20 + step).narrow(0, data->rank() * local_rows, local_rows);
      at::Tensor loss = at::tensor({pipe.run(x, y)}, at::kDouble);
      sharded->reduce_gradients();
      opt.step();
      data->all_reduce(loss);
      EXPECT_NEAR(loss.item<double>() / data->size(), serial.losses[step], kTolerance * serial.losses[step])
          << "step " << step;
      if (step == 0) compare(after_first, "after the first step");
    }
    std::map<std::string, at::Tensor> serial_full;
    {
      test::ReferenceGPT again = reference_gpt();
      torch::optim::SGD o(again->parameters(), sgd());
      for (int step = 0; step < kSteps; ++step) {
        o.zero_grad();
        again->loss(again->forward(ids(rows, 10 + step)), ids(rows, 20 + step)).backward();
        o.step();
      }
      serial_full = again->full_state();
    }
    compare(serial_full, "after three steps");
  }
}

// Note [Split backward]: the input pass of a zero-bubble schedule computes
// only input gradients and the weight pass only weight gradients, so each
// product of the backward runs once, as in 1F1B's single backward. Layers
// whose backward counts the products it computes (honouring
// needs_input_grad as aten's formulas do) show it; re-running the backward
// restricted to the weights in W would count the input products again.
struct ProductCounts {
  int64_t input = 0, weight = 0;
};

struct CountingMatmul : torch::autograd::Function<CountingMatmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            ProductCounts* counts) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["counts"] = reinterpret_cast<int64_t>(counts);
    return at::matmul(x, w.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    auto* counts = reinterpret_cast<ProductCounts*>(ctx->saved_data["counts"].toInt());
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      gx = at::matmul(g[0], saved[1]);
      ++counts->input;
    }
    if (ctx->needs_input_grad(1)) {
      gw = at::matmul(g[0].t(), saved[0]);
      ++counts->weight;
    }
    return {gx, gw, at::Tensor()};
  }
};

struct CountingLayerImpl : torch::nn::Module {
  CountingLayerImpl(const at::Tensor& w, ProductCounts* c) : counts(c) {
    weight = register_parameter("weight", w.clone());
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(CountingMatmul::apply(x, weight, counts)); }
  at::Tensor weight;
  ProductCounts* counts;
};
TORCH_MODULE(CountingLayer);

TEST(PipelineSplitBackward, InputAndWeightPassesDoEachProductOnce) {
  const int p = test::world()->size();
  constexpr int kLayers = 8, kWidth = 6;
  const int m = 2 * p + 1;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<at::Tensor> weights;
  for (int i = 0; i < kLayers; ++i) weights.push_back((at::randn({kWidth, kWidth}, gen) * 0.5).to(test::device()));
  const at::Tensor x = at::randn({2 * m, kWidth}, gen).to(test::device());
  const at::Tensor y = at::randn({2 * m, kWidth}, gen).to(test::device());
  // Serial: plain LibTorch on the same weights.
  std::vector<at::Tensor> serial;
  for (const auto& w : weights) serial.push_back(w.clone().requires_grad_(true));
  at::Tensor h = x;
  for (const auto& w : serial) h = at::tanh(at::matmul(h, w.t()));
  at::mse_loss(h, y).backward();

  auto ctx = pipeline_context();
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleH2}) {
    SCOPED_TRACE(parallel::to_string(kind));
    ProductCounts counts;
    torch::nn::Sequential model;
    for (const auto& w : weights) model->push_back(CountingLayer(w, &counts));
    model->to(test::device());
    PipelineExecutor pipe(
        model, ctx, [](const at::Tensor& out, const at::Tensor& t) { return at::mse_loss(out, t); },
        PipelineOptions().schedule(kind).microbatches(m));
    pipe.run(x, y);
    at::Tensor totals = at::tensor({counts.input, counts.weight}, at::kLong);
    ctx->comm(context::ParallelMode::kPipeline)->all_reduce(totals);
    // Every layer's weight product once per micro-batch; the input product
    // for every layer but the first (the batch needs no gradient).
    EXPECT_EQ(totals[0].item<int64_t>(), (kLayers - 1) * m);
    EXPECT_EQ(totals[1].item<int64_t>(), kLayers * m);
    for (const auto& layer : pipe.local_layers()) {
      const int i = std::stoi(layer.first);
      const at::Tensor g = layer.second->named_parameters()["weight"].grad();
      ASSERT_TRUE(g.defined()) << "layer " << i;
      EXPECT_LE(test::rel_error(g, serial[i].grad()), kTolerance) << "layer " << i;
    }
  }
}

// Activations of 144 KiB per message, far above Open MPI's eager limits (4
// KiB in shared memory, 64 KiB over TCP), so a send completes only once its
// receive is posted, as NCCL's do; the ctest `pipeline_blocking_sends` runs
// this file again with every device send synchronous
// (TESSERA_MPI_SYNC_SENDS=1). Every schedule must pair its batches (Note
// [Pipeline message batches]) and give the serial gradients.
struct WideLayerImpl : torch::nn::Module {
  explicit WideLayerImpl(const at::Tensor& w) { weight = register_parameter("weight", w.clone()); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(at::matmul(x, weight.t())); }
  at::Tensor weight;
};
TORCH_MODULE(WideLayer);

TEST(PipelineMessages, LargeActivationsUnderEverySchedule) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "8 layers fit pipelines of up to 4 ranks with 2 chunks";
  constexpr int kLayers = 8;
  constexpr int64_t kWidth = 384, kRows = 96;  // 96 x 384 fp32: 144 KiB per message
  const int m = 2 * p + 1;                     // a steady state on every rank; dualpipev needs 2p
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<at::Tensor> weights;
  for (int i = 0; i < kLayers; ++i)
    weights.push_back((at::randn({kWidth, kWidth}, gen) / std::sqrt(double(kWidth))).to(test::device()));
  const at::Tensor x = at::randn({kRows * m, kWidth}, gen).to(test::device());
  const at::Tensor y = at::randn({kRows * m, kWidth}, gen).to(test::device());
  // Serial: plain LibTorch on the same weights.
  std::vector<at::Tensor> serial;
  for (const auto& w : weights) serial.push_back(w.clone().requires_grad_(true));
  at::Tensor h = x;
  for (const auto& w : serial) h = at::tanh(at::matmul(h, w.t()));
  const at::Tensor serial_loss = at::mse_loss(h, y);
  serial_loss.backward();

  auto ctx = pipeline_context();
  std::vector<Case> cases = {{ScheduleKind::kGPipe, 1},        {ScheduleKind::k1F1B, 1},
                             {ScheduleKind::kZeroBubbleH1, 1}, {ScheduleKind::kZeroBubbleH2, 1},
                             {ScheduleKind::kZeroBubbleV, 2},  {ScheduleKind::kDualPipeV, 2}};
  if (p > 1) cases.push_back({ScheduleKind::kInterleaved1F1B, 2});
  for (const Case& c : cases) {
    SCOPED_TRACE(parallel::to_string(c.kind));
    torch::nn::Sequential model;
    for (const auto& w : weights) model->push_back(WideLayer(w));
    model->to(test::device());
    PipelineExecutor pipe(
        model, ctx, [](const at::Tensor& out, const at::Tensor& t) { return at::mse_loss(out, t); },
        PipelineOptions().schedule(c.kind).microbatches(m).chunks(c.chunks));
    const double loss = pipe.run(x, y);
    EXPECT_NEAR(loss, serial_loss.item<double>(), kTolerance * serial_loss.item<double>());
    for (const auto& layer : pipe.local_layers()) {
      const int i = std::stoi(layer.first);
      const at::Tensor g = layer.second->named_parameters()["weight"].grad();
      ASSERT_TRUE(g.defined()) << "layer " << i;
      EXPECT_LE(test::rel_error(g, serial[i].grad()), kTolerance) << "layer " << i;
    }
  }
}

// Note [Other stages released]: a pipeline rank keeps only its stages'
// parameters. The counting allocator sees the other layers' bytes go, the
// local layers keep every element, and reading a released one is refused.
TEST(PipelineMemory, OtherStagesAreReleased) {
  const int p = test::world()->size();
  if (p == 1 || p > 4) GTEST_SKIP() << "runs at 2 to 4 ranks";
  if (!test::device().is_cpu()) GTEST_SKIP() << "counts CPU allocations";
  auto ctx = pipeline_context();
  auto& counter = test::CountingAllocator::instance();
  test::CountingScope scope;
  torch::manual_seed(7);
  models::GPT gpt(config(), factory(ctx->comm(context::ParallelMode::kTensor)));
  std::map<const c10::TensorImpl*, int64_t> bytes;  // every parameter and buffer of the whole model
  for (const auto& t : gpt->parameters()) bytes[t.unsafeGetTensorImpl()] = static_cast<int64_t>(t.nbytes());
  for (const auto& t : gpt->buffers()) bytes[t.unsafeGetTensorImpl()] = static_cast<int64_t>(t.nbytes());
  const int64_t before = counter.live();
  PipelineExecutor pipe(
      gpt->as_sequential(), ctx, [&](const at::Tensor& out, const at::Tensor& y) { return gpt->loss(out, y); },
      PipelineOptions().microbatches(2));
  const int64_t released = before - counter.live();
  std::set<const c10::TensorImpl*> local;
  for (const auto& [name, layer] : pipe.local_layers()) {
    for (const auto& t : layer->parameters()) local.insert(t.unsafeGetTensorImpl());
    for (const auto& t : layer->buffers()) local.insert(t.unsafeGetTensorImpl());
  }
  int64_t others = 0;
  for (const auto& [impl, n] : bytes)
    if (!local.count(impl)) others += n;
  ASSERT_GT(others, 0);
  EXPECT_NEAR(static_cast<double>(released), static_cast<double>(others), 1024.0)
      << "bytes freed by the executor against the other stages' parameters and buffers";
  for (const auto& t : gpt->parameters())
    EXPECT_EQ(t.numel() > 0, local.count(t.unsafeGetTensorImpl()) > 0) << "a parameter of shape " << t.sizes();
  // A train step still runs (the tied head's copy of the embedding kept on the last stage).
  EXPECT_TRUE(std::isfinite(pipe.run(ids(4, 1), ids(4, 2))));
  for (const auto& [name, placement] : gpt->placements()) {
    if (local.count(placement.param.unsafeGetTensorImpl())) continue;
    EXPECT_ERROR_CONTAINS(nn::full_value(placement), "belongs to another pipeline rank's stage and was released");
    break;
  }
}

TEST(PipelineErrors, BadInputIsRefusedOnEveryRank) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "the 4-layer GPT fits pipelines of up to 4 ranks";
  auto ctx = pipeline_context();
  auto c = models::GPTConfig::preset("tiny");  // 2 blocks: 4 layers in sequence
  models::GPT gpt(c, factory(ctx->comm(context::ParallelMode::kTensor)));
  gpt->to(test::device());
  auto loss = [&](const at::Tensor& out, const at::Tensor& y) { return gpt->loss(out, y); };
  const std::string too_few = "needs at least " + std::to_string(5 * p) + " layers, the model has 4";
  EXPECT_ERROR_CONTAINS(PipelineExecutor(gpt->as_sequential(), ctx, loss,
                                         PipelineOptions().schedule(ScheduleKind::kInterleaved1F1B).chunks(5)),
                        too_few.c_str());
  EXPECT_ERROR_CONTAINS(
      PipelineExecutor(
          gpt->as_sequential(), ctx, loss,
          PipelineOptions().partition(parallel::PartitionMethod::kSizes).stage_sizes(std::vector<int64_t>(p, 3))),
      "stage sizes sum to");
  PipelineExecutor pipe(gpt->as_sequential(), ctx, loss, PipelineOptions().microbatches(2));
  EXPECT_ERROR_CONTAINS(pipe.run(ids(3, 1), ids(3, 2)), "have 3 rows, which do not split into 2");
}

TEST(PipelinePartition, ByCountWeightAndSizes) {
  EXPECT_EQ(parallel::partition_by_count(10, 4), (std::vector<int64_t>{0, 3, 6, 8, 10}));
  EXPECT_EQ(parallel::partition_by_weight({1, 1, 1, 1, 8, 1, 1, 1}, 3), (std::vector<int64_t>{0, 4, 5, 8}));
  EXPECT_EQ(parallel::partition_by_sizes({1, 2, 3}, 6, 3), (std::vector<int64_t>{0, 1, 3, 6}));
  EXPECT_ERROR_CONTAINS(parallel::partition_by_sizes({1, 0, 5}, 6, 3), "stage 1 is given 0 layers");
  EXPECT_ERROR_CONTAINS(parallel::partition_by_count(3, 4), "needs at least 4 layers, the model has 3");
}

}  // namespace
}  // namespace tessera
