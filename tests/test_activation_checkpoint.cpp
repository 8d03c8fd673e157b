// Activation checkpointing (nn/activation_checkpoint.h) against the same code
// without it, dropout on: a module drawing from the default generator and from
// ParallelDropout (outputs, input and parameter gradients, the streams left
// behind), a split backward, a module under ShardedModule (ddp, zero2, zero3),
// tessera's GPT at tensor size = world (1D and sequence-parallel) and through
// the pipeline executor; and the activation memory it saves, counted by a CPU
// allocator that records live bytes.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/activation_checkpoint.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/parallel/pipeline_executor.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"

#include "counting_allocator.h"
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

namespace tessera {
namespace {

// Recomputation repeats the same kernels on the same inputs: equality is
// expected; the tolerance the issue allows is the bound asserted.
constexpr double kTolerance = 1e-6;

enum class Mode { kPlain, kModule, kFunction };

// Two layers of linear, GELU, torch dropout (default generator) and
// ParallelDropout (its own stream), each layer checkpointed as `mode` says.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(uint64_t seed)
      : fc1(register_module("fc1", torch::nn::Linear(6, 12))),
        fc2(register_module("fc2", torch::nn::Linear(12, 6))),
        drop(register_module("drop", nn::ParallelDropout(nn::ParallelDropoutOptions(0.3, seed)))) {}

  at::Tensor layer(const at::Tensor& x) {
    at::Tensor h = torch::dropout(at::gelu(fc1(x)), 0.25, is_training());
    return drop(fc2(h)) + x;
  }
  at::Tensor forward(const at::Tensor& x, Mode mode) {
    at::Tensor h = x;
    for (int i = 0; i < 2; ++i) {
      if (mode == Mode::kPlain) h = layer(h);
      if (mode == Mode::kModule)
        h = nn::checkpoint(
            *this, [this](const at::Tensor& in) { return layer(in); }, h);
      if (mode == Mode::kFunction) h = nn::checkpoint([this](const at::Tensor& in) { return layer(in); }, h);
    }
    return h;
  }
  torch::nn::Linear fc1, fc2;
  nn::ParallelDropout drop;
};
TORCH_MODULE(Net);

Net make_net(uint64_t dropout_seed = 11) {
  torch::manual_seed(0);
  Net net(dropout_seed);
  net->to(test::device());
  return net;
}

// Everything a training step leaves behind, for comparison.
struct StepResult {
  std::vector<at::Tensor> tensors;  // outputs, input gradient, parameter gradients, later draws
};

void expect_equal(const StepResult& a, const StepResult& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_LE(test::rel_error(b.tensors[i], a.tensors[i]), kTolerance) << "tensor " << i;
  }
}

// Two steps (forward, backward) of `net` in `mode`, then draws from both streams.
StepResult run_steps(Net net, Mode mode) {
  StepResult r;
  torch::manual_seed(42);
  for (int step = 0; step < 2; ++step) {
    at::Tensor x = test::device_randn({5, 6}, 100 + step).requires_grad_();
    at::Tensor out = net->forward(x, mode);
    (out * test::device_randn({5, 6}, 200 + step)).sum().backward();
    r.tensors.push_back(out.detach());
    r.tensors.push_back(x.grad());
    for (const auto& p : net->parameters()) r.tensors.push_back(p.grad().clone());
  }
  r.tensors.push_back(torch::rand({4}, test::device_options()));  // the default stream torch dropout drew from
  r.tensors.push_back(net->drop->forward(at::ones({16}, test::device_options())));
  return r;
}

TEST(ActivationCheckpoint, ModuleWithDropoutMatchesPlainRun) {
  const StepResult plain = run_steps(make_net(), Mode::kPlain);
  // The dropouts are live: another stream gives other outputs.
  EXPECT_GT(test::rel_error(run_steps(make_net(12), Mode::kPlain).tensors[0], plain.tensors[0]), 1e-3);
  SCOPED_TRACE("module overload");
  expect_equal(plain, run_steps(make_net(), Mode::kModule));
}

TEST(ActivationCheckpoint, FunctionOverloadReplaysTheDefaultGenerator) {
  // ParallelDropout at p = 0 leaves the default generator as the only stream.
  auto run = [](Mode mode) {
    Net net = make_net();
    net->drop->options.p(0.0);
    return run_steps(net, mode);
  };
  expect_equal(run(Mode::kPlain), run(Mode::kFunction));
}

// The zero-bubble pipeline's split: input gradient first (graph retained),
// parameter gradients after. Each pass recomputes; .grad is written once.
TEST(ActivationCheckpoint, SplitBackwardGivesEachGradientOnce) {
  Net plain = make_net(), ckpt = make_net();
  at::Tensor x = test::device_randn({5, 6}, 1);
  torch::manual_seed(3);
  at::Tensor xa = x.clone().requires_grad_();
  plain->forward(xa, Mode::kPlain).sum().backward();
  torch::manual_seed(3);
  at::Tensor xb = x.clone().requires_grad_();
  at::Tensor loss = ckpt->forward(xb, Mode::kModule).sum();
  at::Tensor gx = torch::autograd::grad({loss}, {xb}, {}, /*retain_graph=*/true)[0];
  for (const auto& p : ckpt->parameters()) EXPECT_FALSE(p.grad().defined()) << "the B pass wrote a .grad";
  torch::autograd::backward({loss}, {}, /*retain_graph=*/false, /*create_graph=*/false, ckpt->parameters());
  EXPECT_LE(test::rel_error(gx, xa.grad()), kTolerance);
  const auto pa = plain->parameters(), pb = ckpt->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_LE(test::rel_error(pb[i].grad(), pa[i].grad()), kTolerance) << i;
}

TEST(ActivationCheckpoint, InputWithoutGradStillGivesParameterGradients) {
  for (Mode mode : {Mode::kModule, Mode::kFunction}) {
    SCOPED_TRACE(mode == Mode::kModule ? "module overload" : "function overload");
    Net plain = make_net(), ckpt = make_net();
    // The function overload replays the default generator only.
    if (mode == Mode::kFunction) {
      plain->drop->options.p(0.0);
      ckpt->drop->options.p(0.0);
    }
    at::Tensor x = test::device_randn({5, 6}, 1);
    torch::manual_seed(3);
    plain->forward(x, Mode::kPlain).sum().backward();
    torch::manual_seed(3);
    ckpt->forward(x, mode).sum().backward();
    const auto pa = plain->parameters(), pb = ckpt->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_TRUE(pb[i].grad().defined()) << i;
      EXPECT_LE(test::rel_error(pb[i].grad(), pa[i].grad()), kTolerance) << i;
    }
  }
}

TEST(ActivationCheckpoint, NoGradAndEvalAreThePlainCall) {
  Net net = make_net();
  at::Tensor x = test::device_randn({5, 6}, 1).requires_grad_();
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(net->forward(x, Mode::kModule).requires_grad());
  }
  net->eval();
  EXPECT_TRUE(at::equal(net->forward(x, Mode::kModule), net->forward(x, Mode::kPlain)));
}

TEST(ActivationCheckpoint, ForeignLeafIsAnErrorNotALostGradient) {
  Net net = make_net();
  at::Tensor scale = at::ones({6}, test::device_options()).requires_grad_();
  at::Tensor x = test::device_randn({5, 6}, 1).requires_grad_();
  at::Tensor out = nn::checkpoint(
      *net->fc1, [&](const at::Tensor& in) { return net->fc1(in * scale); }, x);
  EXPECT_ERROR_CONTAINS(out.sum().backward(), "is not a parameter of the module");
}

// ---- ShardedModule: gradient-ready hooks fire inside the checkpointed backward.

double sharded_losses_and_params(const std::string& spec, Mode mode, std::vector<at::Tensor>* params) {
  auto world = test::world();
  Net net = make_net(31 + world->rank());
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig());
  auto sharded = std::make_shared<parallel::ShardedModule>(
      net.ptr(), ctx, parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::parse(spec)).bucket_bytes(4 * 40));
  parallel::ShardedOptimizer opt(
      sharded, std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));
  torch::manual_seed(5 + world->rank());
  double losses = 0.0;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    at::Tensor x = test::device_randn({4, 6}, 1000 * world->rank() + step);
    at::Tensor loss = sharded->run([&] { return net->forward(x, mode).pow(2).mean(); });
    loss.backward();
    opt.step();
    losses += loss.item<double>();
  }
  auto full = sharded->full_params();
  for (const auto& p : net->parameters()) params->push_back(p.detach().clone());
  return losses;
}

TEST(ActivationCheckpoint, UnderShardedModuleEqualsThePlainRun) {
  for (const std::string spec : {"ddp", "zero2", "zero3"}) {
    SCOPED_TRACE(spec);
    std::vector<at::Tensor> plain, ckpt;
    const double a = sharded_losses_and_params(spec, Mode::kPlain, &plain);
    const double b = sharded_losses_and_params(spec, Mode::kModule, &ckpt);
    EXPECT_NEAR(b, a, kTolerance * std::abs(a));
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_LE(test::rel_error(ckpt[i], plain[i]), kTolerance) << i;
  }
}

// ---- tessera's GPT, tensor-parallel over the world.

models::GPTConfig gpt_config(bool checkpoint) {
  auto c = models::GPTConfig::preset("tiny");
  c.dropout(0.1);
  c.checkpoint_activations(checkpoint);
  return c;
}

at::Tensor token_ids(int64_t rows, int64_t seq, uint64_t seed, int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(vocab, {rows, seq}, gen, at::kLong).to(test::device());
}

struct GPTRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> grads;  // full gradients, summed over both steps
};

GPTRun gpt_run(const models::GPTConfig& c, bool sp) {
  torch::manual_seed(0);
  models::GPT gpt(c, nn::make_1d_factory(test::world(), sp, 1234, 5678));
  gpt->to(test::device());
  GPTRun run;
  for (int step = 0; step < 2; ++step) {
    at::Tensor loss = gpt->loss(gpt->forward(token_ids(2, 16, 1 + step, c.vocab())), token_ids(2, 16, 9 + step, c.vocab()));
    loss.backward();
    run.losses.push_back(loss.item<double>());
  }
  gpt->reduce_partial_gradients();
  run.grads = gpt->full_state(/*gradients=*/true);
  return run;
}

class GPTCheckpoint : public ::testing::TestWithParam<bool> {};

TEST_P(GPTCheckpoint, LossAndGradientsEqualWithoutCheckpointing) {
  if (gpt_config(false).heads() % test::world()->size() != 0) GTEST_SKIP() << "the tiny GPT's 4 heads do not split";
  const bool sp = GetParam();
  const GPTRun plain = gpt_run(gpt_config(false), sp);
  const GPTRun ckpt = gpt_run(gpt_config(true), sp);
  auto no_dropout = gpt_config(false);
  no_dropout.dropout(0.0);
  EXPECT_GT(std::abs(gpt_run(no_dropout, sp).losses[0] - plain.losses[0]), 1e-4) << "dropout had no effect";
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_NEAR(ckpt.losses[i], plain.losses[i], kTolerance * plain.losses[i]) << "step " << i;
  ASSERT_EQ(ckpt.grads.size(), plain.grads.size());
  for (const auto& [name, grad] : plain.grads)
    EXPECT_LE(test::rel_error(ckpt.grads.at(name), grad), kTolerance) << "gradient of " << name;
}

INSTANTIATE_TEST_SUITE_P(Variants, GPTCheckpoint, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "SequenceParallel" : "OneD");
                         });

// as_sequential's blocks checkpoint themselves; zero-bubble splits each
// backward into B and W passes, each recomputing the block.
TEST(GPTCheckpointPipeline, EveryScheduleEqualsThePlainPipeline) {
  const int p = test::world()->size();
  if (p > 4) GTEST_SKIP() << "the tiny GPT has 4 layers to pipeline";
  auto ctx = context::ParallelContext::create(test::world(), context::ParallelConfig().pipeline(p));
  for (auto kind : {parallel::ScheduleKind::k1F1B, parallel::ScheduleKind::kZeroBubbleH1}) {
    SCOPED_TRACE(parallel::to_string(kind));
    std::vector<std::vector<at::Tensor>> grads(2);
    std::vector<double> losses(2);
    for (bool checkpoint : {false, true}) {
      const auto c = gpt_config(checkpoint);
      torch::manual_seed(0);
      models::GPT gpt(c, nn::make_1d_factory(ctx->comm(context::ParallelMode::kTensor), false, 1234, 5678));
      gpt->to(test::device());
      parallel::PipelineExecutor pipe(
          gpt->as_sequential(), ctx, [&](const at::Tensor& out, const at::Tensor& y) { return gpt->loss(out, y); },
          parallel::PipelineOptions().schedule(kind).microbatches(2 * p));
      losses[checkpoint] = pipe.run(token_ids(4 * p, 8, 3, c.vocab()), token_ids(4 * p, 8, 4, c.vocab()));
      for (const auto& param : pipe.parameters()) grads[checkpoint].push_back(param.grad().clone());
    }
    EXPECT_NEAR(losses[1], losses[0], kTolerance * losses[0]);
    ASSERT_EQ(grads[1].size(), grads[0].size());
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_LE(test::rel_error(grads[1][i], grads[0][i]), kTolerance) << i;
  }
}

// ---- Memory: live bytes of CPU tensor storage, counted at the allocator.

struct ActivationBytes {
  int64_t after_forward = 0;  // held by the graph (and the logits) when forward returns
  int64_t peak = 0;           // the most held during forward + backward
};

// A GPT large enough that activations dominate: 4 blocks, s = 128 (the
// attention scores are [b, heads, s, s]); tensor-parallel over the world.
ActivationBytes measure(bool checkpoint, test::CountingAllocator& counter) {
  models::GPTConfig c = gpt_config(checkpoint);
  c.layers(4);
  c.hidden(64);
  c.context(128);
  torch::manual_seed(0);
  models::GPT gpt(c, nn::make_1d_factory(test::world(), false, 1234, 5678));
  gpt->to(test::device());
  const at::Tensor ids = token_ids(4, 128, 1, c.vocab()), targets = token_ids(4, 128, 2, c.vocab());
  gpt->loss(gpt->forward(ids), targets).backward();  // allocates .grad: not activation memory
  for (auto& p : gpt->parameters()) p.mutable_grad().zero_();
  ActivationBytes bytes;
  const int64_t base = counter.live();
  counter.reset_peak();
  {
    at::Tensor loss = gpt->loss(gpt->forward(ids), targets);
    bytes.after_forward = counter.live() - base;
    loss.backward();
  }
  bytes.peak = counter.peak() - base;
  return bytes;
}

TEST(ActivationCheckpointMemory, PeakActivationBytesPerRankAreLower) {
  if (test::device().is_cuda()) GTEST_SKIP() << "counts CPU allocations";
  if (gpt_config(false).heads() % test::world()->size() != 0) GTEST_SKIP() << "the tiny GPT's 4 heads do not split";
  ActivationBytes plain, ckpt;
  {
    test::CountingScope scope;
    plain = measure(false, test::CountingAllocator::instance());
    ckpt = measure(true, test::CountingAllocator::instance());
  }
  if (test::world()->rank() == 0) {
    std::printf(
        "[activation memory] tp=%d, GPT 4 blocks h64 4 heads, b4 s128, dropout 0.1, per rank: "
        "held after forward %lld -> %lld bytes, peak over forward+backward %lld -> %lld bytes\n",
        test::world()->size(), static_cast<long long>(plain.after_forward), static_cast<long long>(ckpt.after_forward),
        static_cast<long long>(plain.peak), static_cast<long long>(ckpt.peak));
    std::fflush(stdout);
  }
  EXPECT_GT(plain.after_forward, 0);
  EXPECT_LT(ckpt.after_forward, plain.after_forward / 3);
  EXPECT_LT(ckpt.peak, plain.peak * 3 / 4);
}

}  // namespace
}  // namespace tessera
